"""Validating token sequences at the API boundary: one flat array of little-endian int32."""

from __future__ import annotations

from typing import Any

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")
_MAX_TOKEN = 2**31 - 1


def as_token_array(tokens: Any) -> np.ndarray:
    """A 1-D little-endian int32 numpy array of `tokens` (list, tuple, numpy array or torch tensor).

    Raises TypeError for non-integer input (floats, bools, strings) and ValueError for a wrong
    number of dimensions or ids outside [0, 2**31).
    """
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # torch.Tensor without importing torch
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim == 1 and arr.size == 0:
        return np.empty(0, dtype=TOKEN_DTYPE)  # np.asarray([]) is float64; an empty list is still valid
    if arr.dtype.kind not in "iu":
        raise TypeError(f"tokens must be integers, got an array of {arr.dtype} (from {type(tokens).__name__})")
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one flat sequence, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN):
        raise ValueError(f"token ids must lie in [0, 2**31), found {int(arr.min())}..{int(arr.max())}")
    return arr.astype(TOKEN_DTYPE, copy=False)
