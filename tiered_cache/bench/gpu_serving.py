"""`bench gpu`'s default state, the one serving lives in: every round a prompt whose prefix this
cache never read, loaded into a pool of `pool_prefixes` prefixes that is full and stays full.

Per prefix length: `rounds + 1` prompts of their own random tokens, computed once by an upper
cache (each one's first-token logits are that prompt's reference) and written by a writer cache
into every lower row's tier. A reuse row's cache (the upper one for `device` and `host`, a new
reader for each lower row, its channels warmed up) has its pool filled with filler pages of
other prefixes, then loads one prompt per round, the first unmeasured (a new instance's first
load: the row's `first`). Filler pages are in no lower tier, so making room copies them to host
RAM: the background demoter, above the high watermark, does it between rounds, the gap between
one request's prefill and the next.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tiered_cache.bench.gpu_args import SUFFIX
from tiered_cache.bench.gpu_rows import GpuRow, Progress, measure_reuse
from tiered_cache.bench.gpu_sources import TIER_OF, Servers, cache_config, fill_tier
from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.integrations.transformers import generate
from tiered_cache.model.spec import KVSpec

_SETTLE_S = 30.0  # at most this long for a round's demotions to finish before the next round
_SLACK_PAGES = 4


@dataclass
class Prompts:
    """A length's prompts: each a prefix of `tokens` random tokens and a suffix shorter than a page,
    with the first-token logits recomputation gives it."""

    tokens: int
    prompts: list[list[int]]
    references: list[torch.Tensor]


class ServingSource:
    """A cache in the serving state (see the module doc) and the prompts it reads, one per round."""

    def __init__(self, row: str, cache: TieredCache, prompts: Prompts, pool_prefixes: int, seed: int) -> None:
        self.row = row
        self.cache = cache
        self._prompts = prompts
        shape, dtype = cache.spec.kv_shape(prompts.tokens), cache.spec.dtype.torch
        filler = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(cache.pool.device, dtype)
        tokens = torch.Generator().manual_seed(seed + 1)
        for _ in range(pool_prefixes):  # each a prefix of its own, the same bytes under other keys
            cache.put(torch.randint(0, 2**20, (prompts.tokens,), generator=tokens).tolist(), filler)
        cache.demoter.flush(_SETTLE_S)

    def prompts(self) -> Iterator[tuple[list[int], torch.Tensor]]:
        """Each prompt (none read by this cache before) and its reference logits, one per round."""
        return zip(self._prompts.prompts, self._prompts.references, strict=True)

    def reset(self) -> None:
        """Between rounds: the last load's demotions finish; nothing is dropped."""
        self.cache.flush()
        self.cache.demoter.flush(_SETTLE_S)


def serving_config(device: str, spec: KVSpec, tokens: int, pool_prefixes: int, host_prefixes: int) -> CacheConfig:
    """A cache whose pool holds `pool_prefixes` prefixes of `tokens` and its host RAM
    `host_prefixes`, with the default watermarks (the background demoter makes the room)."""
    prefix = spec.bytes_for_tokens(tokens)
    slack = _SLACK_PAGES * spec.bytes_per_page
    return cache_config(device, pool_prefixes * prefix + slack, host_prefixes * prefix + slack).replace(
        high_watermark=CacheConfig.high_watermark, low_watermark=CacheConfig.low_watermark)


def measure_serving(model: object, spec: KVSpec, n: int, rows: tuple[str, ...], rounds: int, device: str,
                    pool_prefixes: int, servers: Servers, recompute: GpuRow, progress: Progress,
                    seed: int) -> list[GpuRow]:
    """Every reuse row at prefix length `n` in the serving state."""
    count = rounds + 1  # the unmeasured first round's prompt and one per measured round
    lower = [r for r in rows if r not in ("device", "host")]
    # Host RAM takes what the pool demotes (the filler's room at the low watermark after the fill,
    # then a prefix's worth a round), and for the host row the prompts too.
    demoted = (pool_prefixes + 3) // 4 + count + 2
    prompts, out = _upper_rows(model, spec, n, rows, lower, rounds, device, pool_prefixes, servers, recompute,
                               progress, seed, count, demoted)
    # The upper cache's pool and host RAM go back before the readers' come: at long prompts both
    # would not fit beside each other (the device's memory, and the host's with the lower tiers).
    _release_memory()
    for row in lower:
        settings = serving_config(device, spec, n, pool_prefixes, demoted)
        reader = TieredCache(spec, settings.replace(**servers.lower_settings(row, n)))
        source = None
        try:
            reader.warming.join()  # its channels open now: a running engine has them open
            source = ServingSource(row, reader, prompts, pool_prefixes, seed)
            out.append(measure_reuse(model, source, TIER_OF[row], source.prompts(), n, rounds, recompute, device,
                                     progress))
        finally:
            reader.close()
            del reader, source  # the next row's reader is built with this one's memory back
            _release_memory()
    return out


def _release_memory() -> None:
    """What freed caches held goes back: device memory, and the pinned host memory torch's caching
    host allocator keeps (in blocks rounded up to a power of two) where this torch can release it."""
    gc.collect()
    if not torch.cuda.is_available():
        return
    torch.cuda.empty_cache()
    empty_host = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty_host is not None:
        empty_host()


def _upper_rows(model: object, spec: KVSpec, n: int, rows: tuple[str, ...], lower: list[str], rounds: int,
                device: str, pool_prefixes: int, servers: Servers, recompute: GpuRow, progress: Progress, seed: int,
                count: int, demoted: int) -> tuple[Prompts, list[GpuRow]]:
    """The prompts computed by the upper cache (and written into the `lower` rows' tiers), and the
    device and host rows read from it. Nothing of the upper cache outlives this call."""
    out = []
    with TieredCache(spec, serving_config(device, spec, n, pool_prefixes, count + demoted)) as upper:
        prompts = _compute(model, upper, spec, n, count, lower, servers, progress, seed)
        for row in (r for r in rows if r in ("device", "host")):
            if row == "host":
                upper.flush()
                upper.evict()  # every prompt's pages to host RAM; the filler fills the pool after
            source = ServingSource(row, upper, prompts, pool_prefixes if row == "host" else 0, seed)
            out.append(measure_reuse(model, source, TIER_OF[row], source.prompts(), n, rounds, recompute, device,
                                     progress))
    return prompts, out


def _compute(model: object, upper: TieredCache, spec: KVSpec, n: int, count: int, lower: list[str],
             servers: Servers, progress: Progress, seed: int) -> Prompts:
    """`count` prompts of `n`-token prefixes computed by `upper` (which keeps them) and written into
    every lower row's tier."""
    vocab = model.config.vocab_size  # type: ignore[attr-defined]
    made = Prompts(n, [], [])
    for i in range(count):
        ids = torch.randint(0, vocab, (n + SUFFIX,), generator=torch.Generator().manual_seed(seed * 1000 + i))
        prompt = ids.tolist()
        result = generate(model, prompt, upper, 1)  # computes the prefix (never seen) and caches it
        if result.reused_tokens or result.first_logits is None:
            raise RuntimeError(f"prompt {i} of the {n:,}-token prefixes was not computed ({result.sources})")
        made.prompts.append(prompt)
        made.references.append(result.first_logits)
        if lower:
            _, kv = upper.get(prompt[:n])
            # The writer's pool holds this one prefix: beside the upper's full pool, one as large
            # would not fit the device at long prompts.
            writer = serving_config(upper.config.device, spec, n, 1, 1)
            for row in lower:
                fill_tier(spec, writer.replace(**servers.lower_settings(row, n)), prompt[:n], kv)
            del kv
        progress(f"  prompt {i + 1}/{count} computed" + (f" and written to {', '.join(lower)}" if lower else ""))
    return made
