"""`TensorReads`: the tensor API's `get` of a prefix, each page copied once into the output tensor,
from wherever it lies.

Pages on the device are read from the pool; pages in host RAM are copied from their rows into
the output (one strided copy per run of rows, under the cache's lock so the rows stay put), not
loaded into the pool and read back (a second copy of every byte: docs/PERFORMANCE.md, "bench
promote"); they stay in host RAM for the next `get`. Pages below host RAM are read by their tier
straight into their place in the output (`TierChain.get_into`: each verified there, no staging
and no pool page in between); they are not kept above their tier, whose copy the next `get`
reads again (the caller holds the KV now; a paged `load` is what caches pages in the pool).
Pages go through the pool instead (`via_pool`: a paged load, read back) for an output on another
device, or pages whose inner layout is not the output's (HND).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from tiered_cache.cache.handle import HOST, CacheHandle
from tiered_cache.device.memory import empty_cpu
from tiered_cache.model.spec import Layout
from tiered_cache.tiers.base import Tier

if TYPE_CHECKING:
    from tiered_cache.cache.core import CacheCore


class TensorReads:
    def __init__(self, core: CacheCore) -> None:
        self.spec, self.pool, self.host, self.chain = core.spec, core.pool, core.host, core.chain
        self._lock = core.lock  # guards host RAM's index and rows, and `in_flight`
        self._in_flight = core.in_flight  # pages on their way below, still served from memory
        self.moves = core.moves  # pages read up from host RAM count as its loads, as a paged load's do
        self._observe = core.reuse.observe  # (tier, seconds, pages) of a read from one tier: the reuse policy's sample

    def get(self, handle: CacheHandle, out: torch.Tensor | None, load: Callable[[CacheHandle], np.ndarray],
            spare: Callable[[tuple[int, ...]], torch.Tensor | None]) -> tuple[int, torch.Tensor]:
        """`TieredCache.get` of a matched `handle`: (tokens, their KV) in `out` (checked by the
        caller) or in a tensor of its own (`spare`'s, when it has one of the shape, else new);
        `load` is the paged load, for `via_pool`."""
        ps = self.spec.page_size
        if not self.direct(out):  # via_pool: load, read back
            pages = load(handle)
            n = len(pages) * ps
            target = out[:, :, :n] if out is not None else spare(self.spec.kv_shape(n)) if n else None
            return n, self.pool.read_tokens(pages, n, out=target)
        whole = handle.available_pages * ps
        if out is None:
            shape = self.spec.kv_shape(whole)
            made = spare(shape) if whole else None
            out = made if made is not None else empty_cpu(shape, self.spec.dtype.torch)
            n = self.read(handle, out)
            return n, out if n == whole else out[:, :, :n].clone()  # a short prefix: a tensor of its own
        n = self.read(handle, out)
        return n, out[:, :, :n]

    def direct(self, out: torch.Tensor | None) -> bool:
        """Whether pages can be copied straight into `out` (None: a tensor made for the call, on
        the pool's device)."""
        if self.spec.layout is not Layout.NHD:
            return False
        if out is None:
            return self.pool.device.type == "cpu"
        return out.device.type == "cpu" and out.is_contiguous()

    def read(self, handle: CacheHandle, out: torch.Tensor) -> int:
        """Copy the handle's prefix into `out` (tensor-API shape, contiguous, on the CPU, at least
        `available_pages` pages of tokens long): the device's pages, the pages below host RAM by
        their tiers, then host RAM's. Returns the tokens that arrived, a whole number of pages
        from the first."""
        ps = self.spec.page_size
        start = handle.num_device_pages
        if start:
            self.pool.read_tokens(handle.device_pages, start * ps, out=out[:, :, :start * ps])
        keys, plan = handle.keys[start:handle.available_pages], handle.plan[:handle.available_pages - start]
        arrived = self._from_below(keys, plan, out, start)
        n = from_host = 0
        started = time.perf_counter()
        with self._lock:
            while n < len(keys):
                if plan[n] != HOST:
                    if not arrived.get(n):
                        break
                    n += 1
                    continue
                end = next((i for i in range(n, len(keys)) if plan[i] != HOST), len(keys))
                got = self._from_host(keys[n:end], out, start + n)
                from_host += got
                n += got
                if n < end:
                    break
        self.moves.loads[Tier.HOST] += from_host
        if from_host:
            self._observe(self.host.name, time.perf_counter() - started, from_host)
        return (start + n) * ps

    def _from_below(self, keys: list[bytes], plan: list[int], out: torch.Tensor, first: int) -> dict[int, bool]:
        """Read the pages `plan` places below host RAM straight into pages `first + i` of `out`
        (one call per tier, each page verified in place); whether each arrived, by position."""
        below = [i for i, where in enumerate(plan) if where != HOST]
        if not below:
            return {}
        ps = self.spec.page_size
        raw = out.view(torch.uint8)
        layers = self.spec.num_layers
        # Each page's (layers, 2, bytes) blocks, strided in the output: a view, never a copy.
        dests = [raw[:, :, (first + i) * ps:(first + i + 1) * ps].view(layers, 2, -1).numpy() for i in below]
        started = time.perf_counter()
        got = self.chain.get_into([keys[i] for i in below], [plan[i] for i in below], dests, self.spec)
        tiers = {plan[i] for i, ok in zip(below, got, strict=True) if ok}
        if len(tiers) == 1:  # a rate per tier: mixed reads tell none
            self._observe(self.chain.tiers[tiers.pop()].name, time.perf_counter() - started, sum(got))
        return dict(zip(below, got, strict=True))

    def _from_host(self, keys: list[bytes], out: torch.Tensor, first: int) -> int:
        """Copy the leading run of `keys` held in host RAM (or on their way below) into pages
        `first`.. of `out` (lock held); how many arrived."""
        n = 0
        while n < len(keys):
            key = keys[n]
            if key in self._in_flight:
                self._pages(out, first + n, 1).copy_(_page_major(self._in_flight[key].unsqueeze(0)))
                n += 1
                continue
            rows = self.host.leading_rows(keys[n:])
            if not len(rows):
                break
            runs = np.flatnonzero(np.diff(rows) != 1) + 1  # consecutive rows: one copy each run
            for run in np.split(np.arange(len(rows)), runs):
                a, k = int(rows[run[0]]), len(run)
                self._pages(out, first + n + int(run[0]), k).copy_(_page_major(self.host.slab[a:a + k]))
            n += len(rows)
        return n

    def _pages(self, out: torch.Tensor, first: int, k: int) -> torch.Tensor:
        """Pages `first`..`first + k` of `out` as (layers, 2, k, page, heads, dim)."""
        ps = self.spec.page_size
        return out[:, :, first * ps:(first + k) * ps].unflatten(2, (k, ps))


def _page_major(rows: torch.Tensor) -> torch.Tensor:
    """Host rows (k, layers, 2, page, heads, dim) viewed as (layers, 2, k, page, heads, dim)."""
    return rows.permute(1, 2, 0, *range(3, rows.dim()))
