"""Pages between SGLang's host pool and our store servers (SGLang-free): reads checked into their
destinations, writes encoded from the pool, and the counts of both.

A read keeps SGLang's rule: only the leading run of pages that arrived counts, so every page after
the first miss or refused page reads as a miss.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tiered_cache.config import CacheConfig
from tiered_cache.integrations.sglang.pages import PageFormat
from tiered_cache.integrations.sglang.stats import BatchStats
from tiered_cache.model.spec import KVSpec
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.wire.codec import encode_page

_DEFAULT_BUDGET_S = 10.0  # one batch's bound when the config sets none: SGLang's storage thread waits on it


class StoreTransfers:
    def __init__(self, config: CacheConfig, record_batches: bool = False) -> None:
        self.config = config
        self.remote = RemoteTier(config.remote_addresses, token=config.remote_token, tls_ca=config.remote_tls_ca,
                                 timeout_s=config.remote_timeout_s,
                                 budget_s=config.remote_budget_s or _DEFAULT_BUDGET_S,
                                 namespace=config.remote_namespace)
        self.batches = BatchStats(record_batches)
        self.pages_read = self.pages_written = self.pages_missed = self.bytes_read = self.bytes_written = 0
        self.write_failures = self.faults = self.clears = 0
        # Channels, the arena map and the bulk connection open beside SGLang's start, not on its first
        # request; a server that is down opens its breaker there, as on any call.
        threading.Thread(target=self.remote.warm, name="tiered-cache-warm", daemon=True).start()

    def fingerprint(self, spec: KVSpec) -> None:
        """Servers skip and refuse blobs of any other model, layout or rank than `spec`'s."""
        self.remote.fingerprint = bytes.fromhex(spec.fingerprint)

    def leading(self, keys: Sequence[bytes]) -> int:
        return self.remote.contains_prefix(keys) if keys else 0

    def read(self, fmt: PageFormat, keys: Sequence[bytes], dests: Sequence[np.ndarray]) -> list[bool]:
        """Each page, checked, written into its destination; True for the leading run that arrived."""
        if not keys:
            return []
        start = time.perf_counter()
        arrived = self.remote.get_into(keys, dests, fmt.spec)
        run = next((i for i, n in enumerate(arrived) if not n), len(arrived))
        self.pages_read += run
        self.pages_missed += len(keys) - run
        self.bytes_read += run * fmt.spec.bytes_per_page
        self.batches.record("prefetch", run, fmt.spec.bytes_per_page, start)
        return [i < run for i in range(len(keys))]

    def write(self, fmt: PageFormat, keys: Sequence[bytes], pages: Sequence[np.ndarray]) -> list[bool]:
        """Each page as a checksummed blob into the store; all True when the servers hold them all."""
        if not keys:
            return []
        start = time.perf_counter()
        items = [(key, encode_page(page, fmt.spec, key)) for key, page in zip(keys, pages, strict=True)]
        held = self.remote.put(items)
        self.pages_written += held
        self.bytes_written += held * fmt.spec.bytes_per_page
        self.batches.record("backup", held, fmt.spec.bytes_per_page, start)
        if held < len(keys):
            self.write_failures += 1
            return [False] * len(keys)  # which ones the servers refused is not known: none counts
        return [True] * len(keys)

    def stats(self) -> dict[str, Any]:
        return {"pages_read": self.pages_read, "pages_missed": self.pages_missed, "pages_written": self.pages_written,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "write_failures": self.write_failures, "faults": self.faults, "clears": self.clears,
                "tier": self.remote.stats().to_dict()}

    def close(self) -> None:
        self.remote.close()
