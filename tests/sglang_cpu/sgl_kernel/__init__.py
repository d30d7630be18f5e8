"""Test-only stand-in for the two CPU helpers of `sgl-kernel`'s CPU build that SGLang imports on a
CPU (that build is not on PyPI), as plain torch. Never used by tiered-cache itself."""

from __future__ import annotations

import ctypes

import numpy as np
import torch


def _rows(address: int, rows: int, row_bytes: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * (rows * row_bytes)).from_address(address), np.uint8).reshape(rows, row_bytes)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """Each buffer (a layer's K or V, by address) copies its rows `src_loc` to rows `tgt_loc`."""
    if src_loc.numel() == 0:
        return
    src, tgt = src_loc.long().numpy(), tgt_loc.long().numpy()
    rows = int(max(src.max(), tgt.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        buffer = _rows(int(address), rows, int(stride))
        buffer[tgt] = buffer[src]


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 row_stride: int) -> None:
    """Each request's token slots [start, end) take the next run of `out_cache_loc`."""
    at = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        req_to_token[row, start:end] = out_cache_loc[at:at + end - start].to(req_to_token.dtype)
        at += end - start


def __getattr__(name: str):
    """Any other kernel SGLang imports but a text model on the torch backend never calls."""
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no stand-in in the SGLang CPU tests")

    unavailable.__name__ = name
    return unavailable
