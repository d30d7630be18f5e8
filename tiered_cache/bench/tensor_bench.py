"""`tiered-cache bench tensor`: KV of one prefix moved through the tensor API, beside a memcpy of
the same bytes measured in the same run: `PagePool.write` / `read_tokens`, `TieredCache.put` /
`get`, and the paged `match` + `load` up from host RAM."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from tiered_cache.bench.timing import Comparison, best_time
from tiered_cache.device.memory import empty_cpu
from tiered_cache.model.spec import KVSpec

if TYPE_CHECKING:
    from tiered_cache.cache import TieredCache

GIB = 2**30
MEMCPY = "memcpy (torch copy_)"


def bench_tensor(spec: KVSpec, num_tokens: int, repeat: int = 5) -> list[Comparison]:
    """One row per operation, each in GiB/s of KV moved beside the memcpy figure."""
    assert num_tokens > 0 and num_tokens % spec.page_size == 0, "whole pages: the cache keeps only those"
    total = spec.bytes_for_tokens(num_tokens)
    kv = torch.randn(spec.kv_shape(num_tokens), generator=torch.Generator().manual_seed(0)).to(spec.dtype.torch)
    scale = f"{num_tokens:,} tokens, {total / 2**20:,.0f} MiB"
    memcpy = _Memcpy(kv, repeat)  # sampled before, between and after: on a shared machine it drifts
    _progress(f"{spec.model_id}, {num_tokens:,} tokens ({total / 2**20:,.0f} MiB of {spec.dtype.value} KV): "
              f"memcpy {memcpy.sample():.2f} GiB/s; PagePool ...")
    times = _pool_times(spec, kv, repeat)
    memcpy.sample()
    _progress("TieredCache put / get / match + load ...")
    times += _cache_times(spec, kv, repeat)
    baseline = memcpy.sample()  # the best of all samples: ratios are not flattered by a slow moment
    return [Comparison(scale, op, total / s / GIB, MEMCPY, baseline, "GiB/s", True) for op, s in times]


class _Memcpy:
    """torch copy_ of the same bytes between two preallocated tensors, both touched and on huge
    pages where Linux gives them (as the pool is); `sample()` returns the best rate so far."""

    def __init__(self, kv: torch.Tensor, repeat: int) -> None:
        self.src, self.dst = (empty_cpu((kv.numel(),), kv.dtype) for _ in range(2))
        self.src.copy_(kv.reshape(-1))
        self.dst.zero_()
        self.repeat, self.best = repeat, 0.0

    def sample(self) -> float:
        seconds = best_time(lambda: self.dst.copy_(self.src), self.repeat)
        self.best = max(self.best, self.src.numel() * self.src.element_size() / seconds / GIB)
        return self.best


def _pool_times(spec: KVSpec, kv: torch.Tensor, repeat: int) -> list[tuple[str, float]]:
    from tiered_cache.device.pool import PagePool

    n = kv.shape[2]
    pool = PagePool(spec, spec.pages_for_tokens(n))
    if pool.pretouch is not None:
        pool.pretouch.join()  # measure copies, not the first touch of the pool
    pages = pool.allocate(pool.num_pages)
    slots = pool.slots(pages, n)
    out = torch.zeros_like(kv)
    write_s = best_time(lambda: pool.write(slots, kv), repeat)
    read_s = best_time(lambda: pool.read_tokens(pages, n, out=out), repeat)
    new_s = best_time(lambda: pool.read_tokens(pages, n), repeat)
    _verify(out, kv, "PagePool.read_tokens")
    return [("PagePool.write (pages in order)", write_s),
            ("PagePool.read_tokens (out=)", read_s),
            ("PagePool.read_tokens (new tensor)", new_s)]


def _cache_times(spec: KVSpec, kv: torch.Tensor, repeat: int) -> list[tuple[str, float]]:
    from tiered_cache.cache import TieredCache
    from tiered_cache.config import CacheConfig

    n = kv.shape[2]
    total = spec.bytes_for_tokens(n)
    # Room for a few prefixes on the device and two in host RAM: 1 GiB and 512 MiB for 256 MiB.
    config = CacheConfig(pool_capacity=4 * total, host_capacity=2 * total)
    cache = TieredCache(spec, config)
    try:
        put_s = get_s = get_out_s = load_s = float("inf")
        out = torch.zeros_like(kv)  # touched once: a caller that reuses its output buffer
        for rep in range(repeat):
            tokens = np.arange(rep * n, (rep + 1) * n, dtype=np.int64)  # a new prefix: put copies it all
            _evict_all(cache)  # room on the device, outside the timed part
            put_s = min(put_s, _timed(lambda t=tokens: _expect(cache.put(t, kv), n, "put")))
            get_s = min(get_s, _timed(lambda t=tokens: _expect(cache.get(t)[0], n, "get")))
            get_out_s = min(get_out_s, _timed(lambda t=tokens: _expect(cache.get(t, out=out)[0], n, "get")))
            _evict_all(cache)  # down to host RAM: every load comes from there
            load_s = min(load_s, _timed(lambda t=tokens: _match_load(cache, t, n // spec.page_size)))
        _verify(cache.get(tokens)[1], kv, "TieredCache.get")
        _verify(out, kv, "TieredCache.get(out=)")
    finally:
        cache.close()
    return [("TieredCache.put (new prefix)", put_s),
            ("TieredCache.get (device hit)", get_s),
            ("TieredCache.get (device hit, out=)", get_out_s),
            ("match + load + release (from host RAM)", load_s)]


def _match_load(cache: TieredCache, tokens: np.ndarray, num_pages: int) -> None:
    handle = cache.match(tokens)
    try:
        _expect(len(cache.load(handle)), num_pages, "load")
    finally:
        cache.release(handle)


def _evict_all(cache: TieredCache) -> None:
    cache.evict()
    flush = getattr(cache, "flush", None)  # background demotion, where the cache has it: not timed
    if flush is not None:
        flush()


def _timed(fn: Callable[[], object]) -> float:
    return best_time(fn, repeat=1)


def _expect(got: int, wanted: int, what: str) -> None:
    if got != wanted:
        raise RuntimeError(f"{what} moved {got:,} instead of {wanted:,}: the figure would be wrong")


def _verify(got: torch.Tensor, kv: torch.Tensor, what: str) -> None:
    if not torch.equal(got.view(torch.uint8), kv.view(torch.uint8)):
        raise RuntimeError(f"{what} returned other bytes than were stored")


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
