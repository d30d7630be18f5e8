"""The KV a token must carry, as a pure function of the tokens up to and including it.

A real model's K/V for token i depends on tokens[:i+1]; so does this oracle's, so any page served
for the wrong prefix, a stale page or a page the engine never wrote shows up as different bytes.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from tiered_cache.model.spec import KVSpec


def token_kv(spec: KVSpec, tokens: list[int]) -> torch.Tensor:
    """KV of every token of `tokens`, shape (layers, 2, n, heads, dim), in the spec's dtype."""
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim
    rows = []
    for i in range(len(tokens)):
        seed = hashlib.sha256(np.asarray(tokens[:i + 1], dtype="<i4").tobytes()).digest()
        rng = np.random.default_rng(int.from_bytes(seed[:8], "little"))
        rows.append(rng.standard_normal(per_token).astype(np.float32))
    if not rows:
        return torch.empty(spec.kv_shape(0), dtype=spec.dtype.torch)
    flat = torch.from_numpy(np.stack(rows))  # (n, layers*2*heads*dim)
    kv = flat.reshape(len(tokens), spec.num_layers, 2, spec.num_kv_heads, spec.head_dim)
    return kv.permute(1, 2, 0, 3, 4).contiguous().to(spec.dtype.torch)
