"""SDPA for grouped-query attention without copying the reused context per query head.

Transformers' `sdpa` attention repeats every key and value head once per query head of its group
whenever there is an attention mask (`repeat_kv`), which there is whenever a prompt's uncached
rest is computed over a reused prefix: at 32k tokens of an 8B model (4 query heads per KV head)
that writes 16 GiB per forward before attention reads it all again. Here the query heads of a
group are folded into the query length instead, (batch, kv_heads, group * q, dim), and each
folded row keeps its own row of the mask: the same attention, read from the unrepeated context.
It is used where it is exact and pays (a 4D mask shared by the heads, or one query token);
everything else goes to transformers' own `sdpa` unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "tiered_cache_grouped_sdpa"
# Attention arguments some models pass that this does not implement: with any of them set, the
# call goes to transformers' own sdpa (which applies or refuses them).
_NOT_HERE = ("position_bias", "softcap", "s_aux", "sinks", "sliding_window", "head_mask", "output_attentions")
_registered = False


def grouped_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An `AttentionInterface` function: query (batch, heads, q, dim), key and value (batch,
    kv_heads, kv, dim); returns (batch, q, heads, dim) as transformers' `sdpa` does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads if kv_heads else 0
    mask_fits = (attention_mask is None and q == 1) or (
        isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
        and attention_mask.shape[2] == q)
    # Anything this does not implement (position bias, softcap, sinks, ...) goes to transformers' own.
    extra = any(kwargs.get(name) is not None for name in _NOT_HERE)
    if (group <= 1 or heads != group * kv_heads or not mask_fits or dropout or extra
            or key.shape[-1] != value.shape[-1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    folded = query.reshape(batch, kv_heads, group * q, dim)  # heads kv*group+r: rows r*q+t of kv head kv
    mask = attention_mask
    if mask is not None:
        rows = mask.shape[-1]
        mask = mask[:, :, None].expand(mask.shape[0], 1, group, q, rows).reshape(mask.shape[0], 1, group * q, rows)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    out = out.reshape(batch, heads, q, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def use_grouped_attention(model: Any) -> bool:
    """Switch a model that uses transformers' `sdpa` to `grouped_sdpa` (the same attention; masks
    made as for `sdpa`). True when switched or already so; False (the model untouched) where it
    uses another attention or this transformers cannot register one."""
    global _registered
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == NAME:
        return True
    if current != "sdpa":
        return False
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    if not _registered:
        AttentionInterface.register(NAME, grouped_sdpa)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    model.set_attn_implementation(NAME)
    return True
