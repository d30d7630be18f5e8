"""How many threads check pages beside a transfer: half the cores this process may use, 2 to 8."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tiered_cache.wire.checksum import checker_threads


@pytest.mark.parametrize(("cores", "threads"), [(1, 2), (2, 2), (4, 2), (6, 3), (16, 8), (17, 8), (64, 8)])
def test_half_the_cores_between_two_and_eight(cores: int, threads: int) -> None:
    assert checker_threads(cores) == threads


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_counts_the_cores_this_process_may_run_on_not_the_machines() -> None:
    # Held to one core of a machine that says it has 64: the floor of two, not 32 (the machine's
    # count halved) nor 8 (capped).
    code = ("import os; os.cpu_count = lambda: 64; from tiered_cache.wire.checksum import checker_threads; "
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); print(checker_threads())")
    held = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert held.stdout.strip() == "2"


def test_the_tiers_and_the_arena_copier_take_the_rules_count(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    # A 16-core node is what they are for; this machine may have 2, so its count is faked (the
    # only fake here: the tiers and the copier are real).
    from tiered_cache.device.arena_copy import ArenaCopier
    from tiered_cache.device.pool import PagePool
    from tiered_cache.model.presets import preset_spec
    from tiered_cache.tiers.disk import DiskTier
    from tiered_cache.tiers.remote import RemoteTier
    from tiered_cache.wire.codec import encode_page

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    tier = RemoteTier(["127.0.0.1:9"], timeout_s=1)
    try:
        assert tier.checkers == 8 and tier._checker._max_workers == 8
    finally:
        tier.close()
    copier = ArenaCopier(PagePool(preset_spec("smollm2-135m"), 4))
    try:
        assert copier.checkers == 8
    finally:
        copier.close()
    spec = preset_spec("smollm2-135m")
    disk = DiskTier(str(tmp_path), "64MiB")
    try:
        n = 8 * 2**20 // spec.bytes_per_page + 1  # past the bytes a call reads on threads
        pages = torch.randn(spec.staging_shape(n)).to(spec.dtype.torch)
        keys = [i.to_bytes(32, "big") for i in range(n)]
        disk.put([(k, encode_page(p, spec, k)) for k, p in zip(keys, pages, strict=True)])
        dests = np.zeros((n, spec.bytes_per_page), dtype=np.uint8)
        assert all(disk.get_into(keys, list(dests), spec))
        assert np.array_equal(dests, pages.view(torch.uint8).reshape(n, -1).numpy())
        assert disk._readers is not None and disk._readers._max_workers == 8
    finally:
        disk.close()
