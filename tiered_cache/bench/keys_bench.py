"""`tiered-cache bench keys`: page-key hashing throughput beside raw SHA-256 of the same bytes."""

from __future__ import annotations

import hashlib

import numpy as np

from tiered_cache.bench.timing import Comparison, best_time, timed
from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.presets import preset_spec


def bench_keys(num_tokens: int = 32768, page_sizes: tuple[int, ...] = (1, 16, 64, 256),
               seed: int = 0) -> list[Comparison]:
    tokens = np.random.default_rng(seed).integers(0, 128_000, size=num_tokens, dtype=np.int64)
    raw = tokens.astype("<i4").tobytes()
    raw_s = best_time(lambda: hashlib.sha256(raw).digest(), repeat=20)
    rows = []
    for page_size in page_sizes:
        keyer = PageKeyer(preset_spec("llama-3.1-8b", page_size=page_size), "bench")
        ours_s, keys = timed(lambda k=keyer: k.keys(tokens), repeat=5)
        # work: tokens the keys cover (whole pages; a partial last page gets no key) vs tokens hashed
        rows.append(Comparison(f"{num_tokens:,} tokens", f"page keys, {page_size}-token pages",
                               num_tokens / ours_s / 1e6, "one SHA-256 over all tokens",
                               num_tokens / raw_s / 1e6, "M tokens/s", True,
                               len(set(keys)) * page_size, len(raw) // 4))
    return rows
