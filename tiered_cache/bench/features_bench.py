"""`tiered-cache bench fork`, `bench swap` and `bench retention`: the engine features against what they replace.

- fork: device pool pages held by n parallel samples of one prompt, each writing `new_tokens`,
  with copy-on-write forks against every sample holding its own copy of the prompt (what an
  engine without sharing does). The claim: forks cost the prompt once, plus each sample's own
  tokens, plus at most one copied page per sample.
- retention: a long generation under `SinkWindow` against keeping every token: peak pool pages
  (flat against growing) and decode time per token (attention over a window, plus re-rotating
  its keys, against attention over everything).
- swap: preempting an N-token request by `swap_out` + `swap_in` (its pages to host RAM and back)
  against recomputing its prefill on the real model (SmolLM2-135M), measured in the same run.
"""

from __future__ import annotations

import time

import torch

from tiered_cache.bench.timing import Comparison, timed
from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.model.spec import KVSpec


def _cache(spec: KVSpec, pages: int, host_pages: int = 1) -> TieredCache:
    cfg = CacheConfig(pool_capacity=pages * spec.bytes_per_page, host_capacity=host_pages * spec.bytes_per_page,
                      malloc_tuning=False, high_watermark=1.0, low_watermark=0.99)
    return TieredCache(spec, cfg, lower=[])


def bench_fork(spec: KVSpec, prompt_tokens: int, new_tokens: int, counts: list[int]) -> list[Comparison]:
    """Pool pages used by n samples (for each n in `counts`), with forks vs without sharing."""
    rows = []
    prompt = list(range(prompt_tokens))
    kv = torch.randn(spec.kv_shape(prompt_tokens + new_tokens)).to(spec.dtype.torch)
    for n in counts:
        own = spec.pages_for_tokens(prompt_tokens + new_tokens)
        with _cache(spec, n * own + 1) as cache:  # room for the no-sharing case
            forked = _forked_pages(cache, prompt, kv, new_tokens, n)
        with _cache(spec, n * own + 1) as cache:
            handles = []
            for i in range(n):
                h = cache.match([*prompt, i])
                cache.allocate(h, prompt_tokens + new_tokens)
                cache.write(h, kv)
                handles.append(h)
            unshared = cache.stats().pool.used_pages
            for h in handles:
                cache.release(h)
        # Slots holding no token of their own: each sample's partly filled last page, and the prompt
        # tokens a copy-on-write repeats. The claim: under one page per sample.
        waste = forked - (prompt_tokens + n * new_tokens) / spec.page_size
        rows.append(Comparison(f"n={n}", f"pool pages, forks (waste {waste / n:.2f} page/sample)", forked,
                               "every sample its own copy",
                               unshared, "pages", False, work=forked, baseline_work=unshared))
    return rows


def _forked_pages(cache: TieredCache, prompt: list[int], kv: torch.Tensor, new_tokens: int, n: int) -> int:
    parent = cache.match(prompt)
    cache.allocate(parent, len(prompt))
    cache.write(parent, kv[:, :, :len(prompt)])
    cache.commit(parent, prompt)  # the prompt's full pages go to the tree; forks lock them
    forks = cache.fork(parent, n)
    cache.release(parent)
    for fork in forks:
        for t in range(new_tokens):  # token by token, as decoding writes
            cache.allocate(fork, 1)
            cache.write(fork, kv[:, :, len(prompt) + t:len(prompt) + t + 1])
    used = cache.stats().pool.used_pages
    for fork in forks:
        cache.release(fork)
    return used


def bench_swap(lengths: list[int], repeat: int = 3) -> list[Comparison]:
    """swap_out + swap_in of an N-token SmolLM2 request vs recomputing its prefill."""
    from tiered_cache.integrations.document import document
    from tiered_cache.integrations.paged import PagedSequence
    from tiered_cache.integrations.smollm2 import load_model
    from tiered_cache.integrations.transformers import spec_for

    model, tokenizer = load_model()
    ids = tokenizer(document()).input_ids
    spec = spec_for(model, dtype="fp32", page_size=16)
    rows = []
    for n in lengths:
        prompt = (ids * (n // len(ids) + 1))[:n]
        pages = spec.pages_for_tokens(n)
        with _cache(spec, pages + 4, host_pages=pages + 4) as cache:
            sequence, _ = PagedSequence.start(cache, model, prompt, commit=False)

            def swap(sequence: PagedSequence = sequence) -> int:
                moved = sequence.swap_out()
                sequence.swap_in()
                return moved

            swap_s, moved = timed(swap, repeat)
            sequence.release()
        with torch.inference_mode():
            prefill_s, out = timed(lambda p=prompt: model(torch.tensor([p]), use_cache=True), repeat)
        rows.append(Comparison(f"{n:,} tokens ({pages} pages)", "swap_out + swap_in", swap_s * 1e3,
                               "recompute the prefill", prefill_s * 1e3, "ms", False,
                               work=moved * spec.bytes_per_page, baseline_work=out.logits.shape[1]))
    return rows


def bench_retention(new_tokens: int, window: int, sink: int = 4) -> list[Comparison]:
    """A SmolLM2 generation of `new_tokens` under SinkWindow(sink, window) vs keeping every token:
    peak device pool pages and decode time per token, in the same run."""
    from tiered_cache.integrations.paged import PagedSequence
    from tiered_cache.integrations.smollm2 import load_model
    from tiered_cache.integrations.transformers import spec_for
    from tiered_cache.retention import SinkWindow

    model, tokenizer = load_model()
    spec = spec_for(model, dtype="fp32", page_size=16)
    prompt = tokenizer("The keeper of the lighthouse wrote in the log").input_ids
    figures = {}
    for name, policy in (("window", SinkWindow(sink, window)), ("all", None)):
        with _cache(spec, spec.pages_for_tokens(len(prompt) + new_tokens) + 4) as cache:
            sequence, logits = PagedSequence.start(cache, model, prompt, policy=policy, commit=False)
            peak, start = 0, time.perf_counter()
            for _ in range(new_tokens):
                logits = sequence.forward([int(logits.argmax())])
                peak = max(peak, cache.stats().pool.used_pages)
            figures[name] = (peak, (time.perf_counter() - start) / new_tokens, sequence.num_live)
            sequence.release()
    scale = f"{new_tokens:,} new tokens"
    (w_peak, w_time, w_live), (a_peak, a_time, a_live) = figures["window"], figures["all"]
    return [
        Comparison(scale, f"peak pool pages, SinkWindow({sink}, {window})", w_peak, "every token kept", a_peak,
                   "pages", False, work=w_live, baseline_work=a_live),
        Comparison(scale, f"decode per token, SinkWindow({sink}, {window})", w_time * 1e3, "every token kept",
                   a_time * 1e3, "ms", False, work=w_live, baseline_work=a_live),
    ]
