"""Reading the parts of a Hugging Face `config.json` that size a model's KV cache and weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_cache.model.dtype import DType
from tiered_cache.model.spec import KVSpec, Layout


@dataclass(frozen=True)
class HFModelConfig:
    """What tiered-cache needs from a transformer config, with defaults resolved."""

    model_id: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_experts: int
    tie_word_embeddings: bool
    attention_bias: bool
    max_context: int | None
    dtype: DType
    mla_latent: int | None = None  # MLA: kv_lora_rank + qk_rope_head_dim values per token and layer
    weights_estimated: bool = True  # False where the layout is not the dense/Mixtral one counted here

    @property
    def num_params(self) -> int:
        """Parameter count of a Llama-style decoder (gated MLP, RMSNorm), MoE-aware.

        Exact for the Llama, Mistral, Mixtral, Qwen2 and SmolLM families; an estimate elsewhere.
        """
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attention += q + 2 * kv
        mlp = 3 * h * self.intermediate_size * self.num_experts
        router = h * self.num_experts if self.num_experts > 1 else 0
        per_layer = attention + mlp + router + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h


def _load(config: dict[str, Any] | str | Path) -> tuple[dict[str, Any], str]:
    if isinstance(config, dict):
        return config, "<dict>"
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no Hugging Face config at {path}")
    try:
        return json.loads(path.read_text()), str(path)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def _positive_int(cfg: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ValueError(f"{source}: missing required key {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{source}: {key!r} must be a positive integer, got {value!r}")
    return value


def read_hf_config(config: dict[str, Any] | str | Path) -> HFModelConfig:
    """Parse a config (dict, `config.json` path, or model folder). Raises ValueError naming the bad key.

    `model_id` here is a display name for sizing (`_name_or_path`, else `model_type`), not an
    identity: `spec_from_hf_config` does not fall back to it.
    """
    return _parse(*_load(config))


_RECURRENT_KEYS = ("ssm_cfg", "ssm_state_size", "mamba_d_state", "layers_block_type", "attn_layer_indices",
                   "state_size", "linear_attn_config")


def _parse(cfg: dict[str, Any], source: str) -> HFModelConfig:
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the LM config inside
        cfg = {**cfg["text_config"], "_name_or_path": cfg.get("_name_or_path", "")}
    recurrent = [k for k in _RECURRENT_KEYS if k in cfg]
    if recurrent:
        raise ValueError(f"{source}: {cfg.get('model_type', 'this model')} keeps a recurrent state ({recurrent[0]}: "
                         f"SSM or hybrid layers), not a fixed KV per token: tiered-cache cannot size or cache it")
    layers = _positive_int(cfg, "num_hidden_layers", source)
    heads = _positive_int(cfg, "num_attention_heads", source)
    kv_heads = _positive_int(cfg, "num_key_value_heads", source, default=heads)
    hidden = _positive_int(cfg, "hidden_size", source)
    if heads % kv_heads:
        raise ValueError(
            f"{source}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"{source}: hidden_size ({hidden}) is not divisible by num_attention_heads ({heads})")
        head_dim = hidden // heads
    head_dim = _positive_int({"head_dim": head_dim}, "head_dim", source)
    dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    mla = None
    if cfg.get("kv_lora_rank"):  # DeepSeek-V2/V3 MLA: one compressed latent per token and layer
        mla = _positive_int(cfg, "kv_lora_rank", source) + _positive_int(cfg, "qk_rope_head_dim", source, default=0)
    return HFModelConfig(
        model_id=str(cfg.get("_name_or_path") or cfg.get("model_type") or "unknown-model"),
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size", source, default=4 * hidden),
        vocab_size=_positive_int(cfg, "vocab_size", source, default=32000),
        num_experts=_positive_int(cfg, "num_local_experts", source, default=1),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        max_context=cfg.get("max_position_embeddings"),
        dtype=DType.parse(dtype_name),
        mla_latent=mla,
        weights_estimated=not (mla or "n_routed_experts" in cfg or "moe_intermediate_size" in cfg),
    )


def sizing_spec(hf: HFModelConfig, dtype: DType | str | None = None, page_size: int = 16) -> KVSpec:
    """A spec whose sizes are the model's KV sizes, for `tiered-cache size` only (it keys no page).
    MLA stores one latent of `mla_latent` values per token and layer, not a K and a V: sized as
    one head of mla_latent/2 values counted twice."""
    kv_dtype = DType.parse(dtype) if dtype is not None else hf.dtype
    if hf.mla_latent is None:
        return KVSpec(model_id="sizing-only", num_layers=hf.num_layers, num_kv_heads=hf.num_kv_heads,
                      head_dim=hf.head_dim, dtype=kv_dtype, page_size=page_size)
    if hf.mla_latent % 2:
        raise ValueError(f"an MLA latent of {hf.mla_latent} values (odd) cannot be sized yet")
    return KVSpec(model_id="sizing-only", num_layers=hf.num_layers, num_kv_heads=1, head_dim=hf.mla_latent // 2,
                  dtype=kv_dtype, page_size=page_size)


def spec_from_hf_config(config: dict[str, Any] | str | Path, *, model_id: str | None = None,
                        dtype: DType | str | None = None, page_size: int = 16,
                        layout: Layout = Layout.NHD) -> KVSpec:
    """Build a spec from a Hugging Face `config.json` (a dict, a file, or a folder holding one).

    GQA/MQA come from `num_key_value_heads` (absent means one KV head per attention head);
    `head_dim` is used when given, else `hidden_size // num_attention_heads`. Multimodal configs
    with a `text_config` use that. The KV dtype defaults to the config's `torch_dtype`/`dtype`.
    `model_id` names the weights (see `KVSpec`): pages are shared only between equal ids, so it
    must differ whenever the weights do. Without it the config's `_name_or_path` is used; a
    config without one raises ValueError rather than guess (`model_type` names an architecture,
    not weights: a base model and its fine-tune would share pages).
    """
    cfg, source = _load(config)
    hf = _parse(cfg, source)
    if hf.mla_latent is not None:
        raise ValueError(f"{source}: MLA attention (kv_lora_rank) stores a compressed latent, not K and V per "
                         f"head; the cache does not hold MLA pages yet (`tiered-cache size` sizes them)")
    model_id = model_id if model_id is not None else str(cfg.get("_name_or_path") or "")
    if not model_id:
        raise ValueError(
            f"{source}: no model identity (no model_id and no _name_or_path); pass model_id=... naming "
            "the weights, e.g. the Hub repo id plus revision ('meta-llama/Llama-3.1-8B@<commit>'), or "
            "build the spec from the loaded model with tiered_cache.integrations.transformers.spec_for(model), "
            "which hashes its weights")
    return KVSpec(model_id=model_id, num_layers=hf.num_layers, num_kv_heads=hf.num_kv_heads,
                  head_dim=hf.head_dim, dtype=DType.parse(dtype) if dtype is not None else hf.dtype,
                  page_size=page_size, layout=layout)

