"""The reused prefix handed to a Hugging Face model as its past, with no copy beyond the one read
out of the pool.

A `DynamicCache` built from a tensor copies it (its first `update` concatenates onto an empty
tensor), and every forward after that concatenates the whole context again to append a few
tokens: at 32k tokens of an 8B model that is 4 GiB copied twice before the first token, and
again per decoded token. Here the pool's pages are read once, straight into per-layer buffers
with room for the rest of the prompt and the tokens to generate; the model's appends write into
that room. A layer whose buffer is full (or that someone else reshaped) grows as `DynamicLayer`
does, so a longer generation stays correct, only slower.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def _layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class RoomyLayer(DynamicLayer):
        """A `DynamicLayer` whose keys and values are the first `length` tokens of buffers of
        (1, kv_heads, room, head_dim): an update writes into the room instead of concatenating."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
            super().__init__()
            self._room_keys, self._room_values = keys, values
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True
            self._set_length(length)

        def _set_length(self, length: int) -> None:
            self.length = length
            self.keys = self._room_keys[:, :, :length]
            self.values = self._room_values[:, :, :length]

        def _owns_views(self) -> bool:
            keys = self.keys
            return (self._room_keys is not None and isinstance(keys, torch.Tensor)
                    and keys.data_ptr() == self._room_keys.data_ptr() and keys.shape[-2] == self.length
                    and keys.shape[:2] == self._room_keys.shape[:2])

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            n = key_states.shape[-2]
            if (self._owns_views() and self.length + n <= self._room_keys.shape[-2]
                    and key_states.shape[:2] == self._room_keys.shape[:2]):
                end = self.length + n
                self._room_keys[:, :, self.length:end].copy_(key_states)
                self._room_values[:, :, self.length:end].copy_(value_states)
                self._set_length(end)
                return self.keys, self.values
            self._room_keys = self._room_values = None  # out of room: grow by concatenation from here
            return super().update(key_states, value_states, *args, **kwargs)

        def crop(self, tokens_to_remove: int) -> None:
            if self._owns_views() and tokens_to_remove < 0:
                self._set_length(max(0, self.length + tokens_to_remove))
                return
            self._room_keys = self._room_values = None
            super().crop(tokens_to_remove)

    return RoomyLayer


def context_from_pool(model: Any, pool: Any, pages: Any, tokens: int, room: int) -> Any | None:
    """A `DynamicCache` holding the first `tokens` tokens' KV stored over `pool` `pages`, read
    straight into buffers of `room` >= `tokens` tokens per layer on the model's device; None where
    this model's cache is not one plain layer per pool layer in the pool's dtype (the caller then
    builds one from a tensor)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    spec = pool.spec
    cache = DynamicCache(config=model.config)
    weights = next(model.parameters())
    if (len({p.device for p in model.parameters()}) > 1  # layers spread over devices: their past too
            or len(cache.layers) != spec.num_layers or any(type(layer) is not DynamicLayer for layer in cache.layers)
            or weights.dtype != pool.kv.dtype or room < tokens):
        return None
    heads, dim = spec.num_kv_heads, spec.head_dim
    buffer = torch.empty((spec.num_layers, 2, 1, heads, room, dim), dtype=weights.dtype, device=weights.device)
    # (layers, 2, tokens, heads, dim) as the pool reads it, lying in the buffers' layout.
    pool.read_tokens(pages, tokens, out=buffer[:, :, 0, :, :tokens].permute(0, 1, 3, 2, 4))
    roomy = _layer_class()
    cache.layers = [roomy(buffer[i, 0], buffer[i, 1], tokens) for i in range(spec.num_layers)]
    return cache
