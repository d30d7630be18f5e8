"""A Llama of a real shape with random weights, for `tiered-cache bench gpu`.

The shapes ship as Hugging Face `config.json` files in `tiered_cache/data/models/`. Weights are
random (TTFT and KV bytes depend on the shape, not on the values), made directly on the device in
the compute dtype: HF's initialisation is skipped and the tensors are filled on the device, so an
8B model is ready in seconds instead of minutes of CPU init and a 16 GB copy. A model whose layers
do not fit the GPU (Llama-3-70B on one H100) is cut to as many layers as fit; each layer keeps its
KV shape, so a page of one layer is the real model's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import torch

from tiered_cache.bench.gpu_args import MODELS
from tiered_cache.integrations.grouped_attention import use_grouped_attention
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


@dataclass(frozen=True)
class RandomModel:
    name: str
    model: Any  # a transformers LlamaForCausalLM
    layers: int  # layers built
    total_layers: int  # layers of the real model
    model_id: str  # names these weights in the KV spec (never derived: hashing 16 GB is slow)


def model_config(name: str) -> dict[str, Any]:
    """The shipped `config.json` of `name` (one of MODELS). Raises ValueError naming the choices."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; shipped: {', '.join(MODELS)}")
    text = resources.files("tiered_cache.data").joinpath("models", f"{name}.json").read_text()
    return dict(json.loads(text))


def layers_that_fit(config: dict[str, Any], free_bytes: int, longest_tokens: int, dtype: str = "bf16") -> int:
    """How many of `config`'s layers fit in `free_bytes` of device memory, with the KV of a
    `longest_tokens` prompt (KV_COPIES times), its full-prompt logits and prefill activations
    beside the weights, all in `dtype`. At most the config's own layer count. Raises DoesNotFit
    if not one fits."""
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
    layers = min(hf.num_layers, room // (per_layer_params * dtype_bytes + KV_COPIES * kv_per_layer))
    if layers < 1:
        raise DoesNotFit(f"not one layer of this model fits in {free_bytes / GiB:.1f} GiB of free device memory "
                         f"with a {longest_tokens:,}-token prompt: ask for fewer --tokens")
    return int(layers)


def build_random_model(config: dict[str, Any], device: str, dtype: torch.dtype, seed: int = 0) -> Any:
    """A LlamaForCausalLM of `config` on `device` in `dtype`, eval mode, weights N(0, initializer_range)
    and RMSNorm scales 1 (as trained scales are near 1: activations keep their size)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters made in the compute dtype, never in fp32 and then cast
    try:
        with torch.device(device), _no_init_weights():
            model = LlamaForCausalLM(LlamaConfig(**config))
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(seed)
    std = float(config.get("initializer_range", 0.02))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
    use_grouped_attention(model)  # as load_causal_lm does: GQA over a reused prefix, heads not repeated
    return model.eval()


def load_random_model(name: str, device: str, dtype: torch.dtype, longest_tokens: int, seed: int = 0) -> RandomModel:
    """`name`'s shape with random weights; on CUDA cut to the layers that fit beside the KV of a
    `longest_tokens` prompt (free memory is read now, before anything is built)."""
    config = model_config(name)
    total = int(config["num_hidden_layers"])
    layers = total
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        layers = layers_that_fit(config, free, longest_tokens, str(dtype).removeprefix("torch."))
    config = {**config, "num_hidden_layers": layers}
    model = build_random_model(config, device, dtype, seed)
    model_id = f"random:{name}:{layers}of{total}:seed{seed}:{str(dtype).removeprefix('torch.')}"
    return RandomModel(name, model, layers, total, model_id)


def _no_init_weights() -> Any:
    """transformers' context that skips weight initialisation (moved between major versions)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined,no-redef]
    return no_init_weights()
