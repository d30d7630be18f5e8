"""A Llama of a real shape with random weights, for `tiered-cache bench gpu`.

The shapes ship as Hugging Face `config.json` files in `tiered_cache/data/models/`. Weights are
random (TTFT and KV bytes depend on the shape, not on the values), made directly on the device in
the compute dtype: HF's initialisation is skipped and the tensors are filled on the device, so an
8B model is ready in seconds instead of minutes of CPU init and a 16 GB copy. A model whose layers
do not fit the GPU (Llama-3-70B on one H100) is cut to as many layers as fit (gpu_fit.py); each
layer keeps its KV shape, so a page of one layer is the real model's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from tiered_cache.bench.gpu_args import MODELS
from tiered_cache.bench.gpu_fit import layers_that_fit
from tiered_cache.integrations.grouped_attention import use_grouped_attention


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


def load_random_model(name: str, device: str, dtype: torch.dtype, longest_tokens: int, pool_prefixes: int = 1,
                      seed: int = 0) -> RandomModel:
    """`name`'s shape with random weights; on CUDA cut to the layers that fit beside the KV of a
    `longest_tokens` prompt in a pool of `pool_prefixes` of them (free memory is read now, before
    anything is built)."""
    config = model_config(name)
    total = int(config["num_hidden_layers"])
    layers = total
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        layers = layers_that_fit(config, free, longest_tokens, str(dtype).removeprefix("torch."), pool_prefixes)
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
