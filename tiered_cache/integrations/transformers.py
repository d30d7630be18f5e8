"""Hugging Face transformers <-> `TieredCache`: reuse a cached prefix in a causal LM's generation.

`generate()` looks the prompt up in the cache, reads the cached prefix out of the pool straight
into the model's past (`hf_context`: buffers with room for the rest, so no forward copies the
context again), prefills only the rest, stores the prompt's new full pages, and decodes greedily. It reports
time to first token (TTFT) and how many prompt tokens came from which tier. With `cache=None`
it is plain generation with the same decoding code, the reference for equivalence tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tiered_cache.cache import TieredCache
from tiered_cache.cache.canary import pages_differ
from tiered_cache.device.pool import device_index
from tiered_cache.integrations.hf_context import context_from_pool
from tiered_cache.integrations.model_identity import derived_model_id
from tiered_cache.model.hf_config import spec_from_hf_config
from tiered_cache.model.spec import DType, KVSpec


@dataclass
class GenerationResult:
    tokens: list[int]  # generated token ids (greedy)
    ttft_s: float  # lookup + load + prefill of the uncached rest + first token
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose KV came from the cache
    sources: dict[str, int] = field(default_factory=dict)  # tier -> reused tokens
    bytes_loaded: int = 0  # KV bytes read from the cache for the reused tokens
    stored_tokens: int = 0  # prompt tokens newly cached after the prefill
    decode_s: float = 0.0
    first_logits: torch.Tensor | None = None  # next-token logits after the prompt (for KL checks)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens


def spec_for(model: Any, dtype: DType | str = DType.FP16, page_size: int = 16,
             model_id: str | None = None) -> KVSpec:
    """The KVSpec of a transformers model's KV, stored as `dtype`.

    `model_id` names the weights (e.g. a Hub repo id plus revision). Without it the id is
    derived from the weights themselves, `"<model_type>@weights:<hash>"` (see
    `derived_model_id`), never from the folder it was loaded from: a fine-tune does not share
    pages with its base, and one checkpoint shares them from any folder or process.
    Raises ValueError if the weights are not loaded (meta device) and no `model_id` is given.
    """
    return spec_from_hf_config(model.config.to_dict(), model_id=model_id or derived_model_id(model),
                               dtype=dtype, page_size=page_size)


def kv_of_cache(cache: Any) -> torch.Tensor:
    """A `DynamicCache` of batch 1 as one (layers, 2, tokens, kv_heads, head_dim) tensor."""
    layers = [torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]  # (2, heads, n, dim)
    return torch.stack(layers).transpose(2, 3).contiguous()


def cache_of_kv(kv: torch.Tensor, model: Any) -> Any:
    """A `DynamicCache` holding `kv` (layers, 2, n, heads, dim), cast to the model's dtype."""
    from transformers import DynamicCache

    dtype = next(model.parameters()).dtype
    cache = DynamicCache(config=model.config)
    for layer in range(kv.shape[0]):
        keys = kv[layer, 0].transpose(0, 1).unsqueeze(0).to(dtype)  # (1, heads, n, dim)
        values = kv[layer, 1].transpose(0, 1).unsqueeze(0).to(dtype)
        cache.update(keys, values, layer)
    return cache


@torch.inference_mode()
def generate(model: Any, prompt: Sequence[int], cache: TieredCache | None = None, max_new_tokens: int = 32,
             eos_token_id: int | None = None, namespace: str | None = None,
             on_token: Callable[[int], None] | None = None) -> GenerationResult:
    """Greedy generation of up to `max_new_tokens` after `prompt` (token ids), reusing `cache`.
    `on_token` is called with each new token as it is chosen (a server streams them).

    At least the prompt's last token is always computed (its logits give the first new token),
    so a fully cached prompt reuses all but that token.
    """
    ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("generate() needs a non-empty prompt")
    start = time.perf_counter()
    past, reused, sources, loaded, planned = None, 0, {}, 0, []
    handle = cache.match(ids, namespace) if cache is not None else None
    try:
        if handle is not None:
            # An engine prefetches at admission and loads when the request is scheduled; here the
            # two are back to back, so load() simply waits for the prefetch it started.
            cache.prefetch(handle)
            pages = cache.load(handle)
            planned = cache.page_sources(handle) if cache.canary.fraction else []  # where each page was read
            reused = min(len(pages) * cache.spec.page_size, len(ids) - 1)
            if reused > 0:
                # Room for the rest of the prompt and the answer: the model appends there, no copy.
                past = context_from_pool(model, cache.pool, pages, reused, len(ids) + max_new_tokens)
                if past is None:
                    kv = cache.pool.read_tokens(pages, len(pages) * cache.spec.page_size)[:, :, :reused]
                    past = cache_of_kv(kv, model)
                loaded = reused * cache.spec.bytes_per_token
                sources = {tier: n * cache.spec.page_size for tier, n in handle.sources.items() if n}
                _trim_sources(sources, reused)
        device = getattr(model, "device", None)  # inputs go where the weights are (a GPU worker)
        keyword = cache_keyword(model)
        inputs = upload_tokens([ids[reused:]], device)
        on_cuda = inputs.device.type == "cuda"
        forward_started = time.perf_counter()
        # On CUDA the load's copies may still run: the forward's kernels are launched meanwhile and
        # run once the copies end. What it costs alone is the longer of its launching (host) and
        # its run on the GPU from the copies' end (events), not the wall time that includes the load.
        if on_cuda:
            stream = torch.cuda.current_stream(inputs.device)
            timing = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            timing[0].record(stream)
        out = model(inputs, use_cache=True, **{keyword: past}, **last_logits_only(model))
        launched = time.perf_counter() - forward_started
        if on_cuda:
            timing[1].record(stream)
            timing[1].synchronize()
        if cache is not None:  # the reuse policy weighs loads against this rate
            forward_s = (max(launched, timing[0].elapsed_time(timing[1]) / 1e3) if on_cuda
                         else time.perf_counter() - forward_started)
            cache.observe_prefill(len(ids) - reused, forward_s)
        logits = out.logits[0, -1].float()
        next_token = int(logits.argmax())
        ttft = time.perf_counter() - start
        stored = 0
        if cache is not None:
            full = kv_of_cache(out.past_key_values).to(cache.spec.dtype.torch)
            stored = cache.put(ids, full, namespace)
            if handle is not None and reused >= cache.spec.page_size and cache.canary.due():
                _check_reuse(model, cache, handle, planned, ids, reused // cache.spec.page_size, full)
    finally:
        if handle is not None:
            cache.release(handle)  # also when loading or the model raised: no lock may leak
    tokens = [next_token]
    if on_token is not None:
        on_token(next_token)
    past_kv = out.past_key_values
    decode_start = time.perf_counter()
    while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
        step = model(torch.tensor([[tokens[-1]]], device=device), use_cache=True, **{keyword: past_kv})
        past_kv = step.past_key_values
        tokens.append(int(step.logits[0, -1].argmax()))
        if on_token is not None:
            on_token(tokens[-1])
    return GenerationResult(tokens, ttft, len(ids), reused, sources, loaded, stored,
                            time.perf_counter() - decode_start, logits)


def _check_reuse(model: Any, cache: TieredCache, handle: Any, planned: list[str], ids: list[int], pages: int,
                 kv: torch.Tensor) -> None:
    """Hand the canary (cache/canary.py) this hit: off the request path, the first `pages` pages
    of `ids` are recomputed and compared with the KV that was reused (`kv`'s first tokens, as the
    model saw them); `planned`: the tier of each page. Dropped when a check is already waiting."""
    tokens = pages * cache.spec.page_size
    keys, tiers = list(handle.keys[:pages]), planned[:pages]
    reused, prefix, namespace, canary = kv[:, :, :tokens], ids[:tokens], handle.namespace, cache.canary
    device = getattr(model, "device", None)

    def check() -> None:
        with torch.inference_mode():
            out = model(torch.tensor([prefix], device=device), use_cache=True, **last_logits_only(model))
            fresh = kv_of_cache(out.past_key_values).to(reused.dtype)
        canary.record(namespace, keys, tiers, pages_differ(reused, fresh, cache.spec.page_size))

    canary.submit(check)


def last_logits_only(model: Any) -> dict[str, int]:
    """`logits_to_keep=1` where the model's forward takes it: the prompt's next-token logits are
    all `generate` reads, and the rest cost a vocabulary-wide matmul and (at 32k tokens of a
    128k vocabulary) gigabytes of memory that an engine's prefill never spends."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(type(model).forward).parameters else {}


def cache_keyword(model: Any) -> str:
    """The keyword a model's forward takes its KV cache under: `cache` where it has it
    (transformers 5.2x renamed `past_key_values`, which warns until its removal)."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def upload_tokens(ids: list[list[int]], device: Any) -> torch.Tensor:
    """Token ids on the model's device (`device_index`: on CUDA the host does not wait for the
    stream, where a load's copies may still be running and the forward is meant to queue meanwhile)."""
    if device is None:
        return torch.tensor(ids)
    return device_index(np.asarray(ids, dtype=np.int64), torch.device(device))


def _trim_sources(sources: dict[str, int], reused: int) -> None:
    """Charge the one recomputed token (when the whole prompt was cached) to the last tier."""
    excess = sum(sources.values()) - reused
    for tier in reversed(list(sources)):
        if excess <= 0:
            break
        cut = min(excess, sources[tier])
        sources[tier] -= cut
        excess -= cut
