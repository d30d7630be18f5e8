"""How many of a model's layers `tiered-cache bench gpu` can build on the device: each layer's
weights beside the longest prompt's KV (as many copies as are alive at once), its logits and prefill
activations, and what CUDA and the caching allocator keep for themselves.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tiered_cache.model.hf_config import read_hf_config, spec_from_hf_config

GiB = 2**30
# Copies of the longest prompt's KV alive at once on the device, at worst: the page pool, the
# prefix KV a writer puts from, and inside `generate` the gathered prefix, the DynamicCache built
# from it, and `kv_of_cache`'s per-layer stack, stack and contiguous transpose.
KV_COPIES = 7
RESERVE_BYTES = 2 * GiB  # CUDA context, cuBLAS workspaces, the copy limit's 256 MiB buffer
RESERVE_SHARE = 0.03  # and the caching allocator's fragmentation


class DoesNotFit(ValueError):
    """Not one layer of the model fits beside the KV of the longest prompt."""


def layers_that_fit(config: dict[str, Any], free_bytes: int, longest_tokens: int, dtype: str = "bf16",
                    pool_prefixes: int = 1) -> int:
    """How many of `config`'s layers fit in `free_bytes` of device memory, with the KV of a
    `longest_tokens` prompt (KV_COPIES times, the pool's copy `pool_prefixes` times), its
    full-prompt logits and prefill activations beside the weights, all in `dtype`. At most the
    config's own layer count. Raises DoesNotFit if not one fits."""
    hf = read_hf_config(config)
    spec = spec_from_hf_config(config, model_id="sizing", dtype=dtype)
    dtype_bytes = spec.dtype.itemsize
    per_layer_params = replace(hf, num_layers=2).num_params - replace(hf, num_layers=1).num_params
    other_params = hf.num_params - hf.num_layers * per_layer_params  # embeddings, lm_head, final norm
    kv_per_layer = spec.bytes_for_tokens(longest_tokens) // hf.num_layers
    # A prefill's logits for every position: `generate` keeps only the last (`logits_to_keep=1`)
    # where the model takes it, but a model that does not would spend this much.
    logits = longest_tokens * hf.vocab_size * dtype_bytes
    activations = longest_tokens * (4 * hf.intermediate_size + 8 * hf.hidden_size) * dtype_bytes
    room = free_bytes - RESERVE_BYTES - int(RESERVE_SHARE * free_bytes) - other_params * dtype_bytes \
        - logits - activations
    copies = KV_COPIES - 1 + pool_prefixes
    layers = min(hf.num_layers, room // (per_layer_params * dtype_bytes + copies * kv_per_layer))
    if layers < 1:
        raise DoesNotFit(f"not one layer of this model fits in {free_bytes / GiB:.1f} GiB of free device memory "
                         f"with a {longest_tokens:,}-token prompt: ask for fewer --tokens")
    return int(layers)
