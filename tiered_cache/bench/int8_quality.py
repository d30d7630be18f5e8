"""How much the lossy int8 codec changes a model's output: the share of prompts whose greedy
continuation differs, and the mean KL divergence of the next-token distribution, with the
prompt's cached prefix read back through int8 blobs (`tiered-cache bench int8`)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.integrations.transformers import generate, spec_for


@dataclass(frozen=True)
class Int8Quality:
    prompts: int
    greedy_differs: int  # prompts whose greedy continuation is not identical
    mean_kl: float  # KL(no cache || int8 cache) of the next-token distribution, nats
    max_kl: float
    new_tokens: int


def int8_quality(model: Any, prompts: list[list[int]], shared_prefix: list[int], new_tokens: int = 16,
                 eos_token_id: int | None = None) -> Int8Quality:
    """Cache `shared_prefix` through int8 blobs on disk, then answer each prompt (which starts with
    it) from that cache and without one."""
    spec = spec_for(model, "fp16", model_id="int8-quality")
    with tempfile.TemporaryDirectory() as folder:
        cache = TieredCache(spec, CacheConfig(pool_capacity="128MiB", host_capacity="128MiB", lower_tiers=["disk"],
                                              disk_path=folder, codec="int8", write_policy="write_through"))
        generate(model, shared_prefix, cache, max_new_tokens=1)
        cache.flush()  # write-through copies run in the background
        differs, kls = 0, []
        for prompt in prompts:
            cache.flush()
            cache.evict()
            cache.host.delete(list(cache.host.index))  # the prefix now comes back through int8 blobs
            lossy = generate(model, prompt, cache, new_tokens, eos_token_id)
            plain = generate(model, prompt, None, new_tokens, eos_token_id)
            assert lossy.sources.get("disk"), "the prefix should have come from int8 blobs on disk"
            differs += lossy.tokens != plain.tokens
            p = torch.log_softmax(plain.first_logits, -1)
            q = torch.log_softmax(lossy.first_logits, -1)
            kls.append(float((p.exp() * (p - q)).sum()))
    return Int8Quality(len(prompts), differs, sum(kls) / len(kls), max(kls), new_tokens)
