"""A store server's memory is what its RAM tier counts: a real server in another process, its RAM
tier overfilled by Puts over gRPC, keeps its resident memory within 1.5x `--ram` plus a fixed
32 MiB, for pages from about 130 bytes to 64 MiB. A blob kept as a view into its received message
(the whole message alive) or an entry cost counted short would grow past it with small pages
(measured before the fix: +134 MiB for a 32 MiB tier of ~100-byte blobs).

`long` (make test-long): a 32 MiB tier of 130-byte pages is a quarter of a million Puts."""

from __future__ import annotations

import os

import pytest
from service_helpers import checksummed

from tiered_cache.client.store_client import StoreClient
from tiered_cache.model.spec import KVSpec
from tiered_cache.server.process import StoreProcess
from tiered_cache.shm.arena import CAPACITY_PER_RECORD
from tiered_cache.wire import codec
from tiered_cache.wire.codec import Codec

pytestmark = pytest.mark.long
MiB = 2**20
FIXED_BOUND = 32 * MiB  # the interpreter's arenas, gRPC's buffers, a batch in flight

SPECS = {  # (spec, --ram): pages of ~130 bytes as blobs, 64 KiB and 64 MiB
    "tiny": (KVSpec("rss-tiny", 1, 1, 1, page_size=1), 32 * MiB),  # enough that 4x could not pass
    "medium": (KVSpec("rss-medium", 4, 4, 64, page_size=16), 24 * MiB),
    "large": (KVSpec("rss-large", 32, 8, 128, page_size=64), 136 * MiB),
}


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) * 1024


def blobs(spec: KVSpec, count: int, start: int) -> list[tuple[bytes, bytes]]:
    """`count` distinct pages of `spec` (keys of their own; the server never derives keys)."""
    shape, dtype_id = spec.staging_shape(1)[1:], codec._DTYPES.index(spec.dtype)
    payload = os.urandom(spec.bytes_per_page)
    out = []
    for i in range(start, start + count):
        key = i.to_bytes(32, "little")
        out.append((key, checksummed(spec, Codec.RAW.wire_id, dtype_id, shape, spec.bytes_per_page, payload, key)))
    return out


@pytest.mark.parametrize("shm", ["off", "on"])
@pytest.mark.parametrize("size", list(SPECS))
def test_resident_memory_stays_within_the_ram_tiers_bound(size, shm):
    spec, ram = SPECS[size]
    if shm == "on" and size != "tiny":
        pytest.skip("the shared-memory arena's bound does not depend on the page size: tiny pages cover it")
    blob_bytes = len(blobs(spec, 1, 0)[0][1])
    total = 1.5 * ram  # half again what the tier holds: it evicts all along the last third
    if shm == "on":  # the arena keeps a record per CAPACITY_PER_RECORD bytes at most: six times
        # that many, which without the bound would take some 100 MiB of records
        total = min(total, 6 * ram // CAPACITY_PER_RECORD * blob_bytes)
    per_put = max(1, min(4096, 8 * MiB // blob_bytes))
    # No disk below: the bound is the RAM tier's (a disk tier's index grows with its own capacity).
    args = ["--ram", str(ram), "--shm", shm, "--max-page", str(blob_bytes), "--no-disk"]
    with StoreProcess(args) as server, StoreClient(server.address, shm=False, timeout_s=60,
                                                   max_message_bytes=blob_bytes + MiB) as client:
        pid = server.proc.pid
        client.put(blobs(spec, 1, 10**9))  # the server's first Put: its pools and buffers exist
        before = rss(pid)
        sent = 0
        while sent < total:
            batch = blobs(spec, per_put, sent // blob_bytes)
            ack = client.put(batch)
            assert not ack.refused, ack.refused[0].message
            sent += per_put * blob_bytes
        grown = rss(pid) - before
        stats = {t.name: t for t in client.stats().tiers}
        assert 0 < stats["ram"].used_bytes <= ram and stats["ram"].evictions > 0
    assert grown <= 1.5 * ram + FIXED_BOUND, (
        f"{size} pages ({blob_bytes:,} B), shm {shm}: RSS grew {grown / MiB:.0f} MiB "
        f"for a {ram / MiB:.0f} MiB RAM tier")
