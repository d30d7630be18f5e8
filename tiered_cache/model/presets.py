"""Well-known models, described by the fields of their Hugging Face `config.json`.

Keeping the config rather than derived numbers means KV sizes and parameter counts come from the
same code path as any user-supplied config (`spec_from_hf_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from tiered_cache.model.hf_config import HFModelConfig, read_hf_config, spec_from_hf_config
from tiered_cache.model.spec import DType, KVSpec


def _llama(layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int, ctx: int,
           **extra: Any) -> dict[str, Any]:
    return {
        "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv, "intermediate_size": inter, "vocab_size": vocab,
        "max_position_embeddings": ctx, "torch_dtype": "bfloat16", **extra,
    }


_CONFIGS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-2-7b-hf": _llama(32, 4096, 32, 32, 11008, 32000, 4096, torch_dtype="float16"),
    "meta-llama/Llama-2-70b-hf": _llama(80, 8192, 64, 8, 28672, 32000, 4096, torch_dtype="float16"),
    "meta-llama/Llama-3.1-8B": _llama(32, 4096, 32, 8, 14336, 128256, 131072),
    "meta-llama/Meta-Llama-3-70B": _llama(80, 8192, 64, 8, 28672, 128256, 8192),
    "mistralai/Mistral-7B-v0.1": _llama(32, 4096, 32, 8, 14336, 32000, 32768),
    "mistralai/Mixtral-8x7B-v0.1": _llama(32, 4096, 32, 8, 14336, 32000, 32768, num_local_experts=8),
    "Qwen/Qwen2.5-7B": _llama(28, 3584, 28, 4, 18944, 152064, 32768, model_type="qwen2"),
    "HuggingFaceTB/SmolLM2-135M-Instruct": _llama(30, 576, 9, 3, 1536, 49152, 8192,
                                                  tie_word_embeddings=True),
}

# Short names people type; each maps to a model id above.
_ALIASES = {
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-2-70b": "meta-llama/Llama-2-70b-hf",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3-70b": "meta-llama/Meta-Llama-3-70B",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}


@dataclass(frozen=True)
class ModelPreset:
    """A named model: its KV spec (fp16 KV, 16-token pages) and the config it came from."""

    name: str
    config: HFModelConfig
    spec: KVSpec

    @property
    def num_params(self) -> int:
        return self.config.num_params

    @property
    def weight_bytes(self) -> int:
        """Weights in the checkpoint's own dtype."""
        return self.num_params * self.config.dtype.itemsize


def preset_names() -> list[str]:
    return sorted(_ALIASES)


@cache
def get_preset(name: str) -> ModelPreset:
    """Look a model up by short name (`llama-3-70b`) or model id. Raises KeyError listing known names."""
    key = name.strip().lower()
    model_id = _ALIASES.get(key) or next((m for m in _CONFIGS if m.lower() == key), None)
    if model_id is None:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(preset_names())} "
                       "(or pass a Hugging Face config.json)")
    short = next(alias for alias, target in _ALIASES.items() if target == model_id)
    config = replace(read_hf_config(_CONFIGS[model_id]), model_id=model_id)
    spec = spec_from_hf_config(_CONFIGS[model_id], model_id=model_id, dtype=DType.FP16)
    return ModelPreset(name=short, config=config, spec=spec)


def preset_spec(name: str, **changes: Any) -> KVSpec:
    """The spec of a well-known model by name, e.g. `preset_spec("llama-3-70b", page_size=64)`."""
    spec = get_preset(name).spec
    return replace(spec, **changes) if changes else spec
