"""What `PagedSequence` (paged.py) hands transformers: a `Cache` whose layers write to and read
from the sequence's pool pages, the rotary pieces that re-index keys to their live positions,
and the attention each key received (for `HeavyHitter`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def paged_cache(sequence: Any, num_layers: int) -> Any:
    """A transformers `Cache` whose layers store into and read from `sequence`'s pages (a
    `PagedSequence`: its `update_layer` and how many tokens it holds)."""
    from transformers.cache_utils import Cache, DynamicLayer

    class PagedLayer(DynamicLayer):
        def __init__(self, layer: int) -> None:
            super().__init__()
            self.layer = layer

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            return sequence.update_layer(self.layer, key_states, value_states)

        def get_seq_length(self) -> int:
            return sequence._past

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("a paged sequence is not cropped; drop tokens through a retention policy")

    return Cache(layers=[PagedLayer(i) for i in range(num_layers)])


def rotary_inv_freq(model: Any) -> torch.Tensor:
    """The rotary inverse frequencies of a transformers model (rotations by any angle add up
    for these; rope types that also rescale cos/sin are refused)."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise ValueError(f"{type(model).__name__} has no rotary embedding to re-index keys with")
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        raise ValueError("re-indexing keys needs a rotary embedding without attention scaling (yarn/longrope)")
    return rotary.inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_received(attentions: Any) -> np.ndarray:
    """Attention each key got in one forward, summed over layers, heads and queries."""
    if not attentions or attentions[0] is None:
        raise ValueError("HeavyHitter needs attention weights: load the model with attn_implementation='eager'")
    total = sum(a[0].float().sum(dim=(0, 1)) for a in attentions)
    return total.cpu().numpy().astype(np.float64)
