"""vLLM's paged KV tensors <-> tiered-cache pages (vLLM-free, torch only).

A vLLM block is one of our pages. Our pages for vLLM use the HND layout: per layer
(2, kv_heads, block_size, head_dim), the order of vLLM's CPU cache, so a copy is a slice.
Layouts understood, per layer tensor:
- CPU:   (num_blocks, kv_heads, block_size, 2 * head_dim), K and V packed in the last dim;
- flash: (2, num_blocks, block_size, kv_heads, head_dim) (CUDA backends), transposed on copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def layout_of(layer: torch.Tensor, kv_heads: int, head_dim: int) -> str:
    """"cpu" or "flash" for one layer's KV tensor; ValueError naming the shape otherwise."""
    shape = tuple(layer.shape)
    if layer.dim() == 4 and shape[1] == kv_heads and shape[3] == 2 * head_dim:
        return "cpu"
    if layer.dim() == 5 and shape[0] == 2 and shape[3] == kv_heads and shape[4] == head_dim:
        return "flash"
    raise ValueError(f"unsupported vLLM KV layout {shape} for {kv_heads} KV heads of dim {head_dim}: "
                     "expected (blocks, heads, block_size, 2*dim) or (2, blocks, block_size, heads, dim)")


def gather_blocks(layers: Sequence[torch.Tensor], block_ids: Sequence[int], kind: str, head_dim: int) -> torch.Tensor:
    """A copy of `block_ids` of every layer as pages: (n, layers, 2, kv_heads, block_size, head_dim).
    Each layer's blocks are selected (one copy) and written into their place in the pages (the
    second): no per-layer pages stacked after."""
    first = layers[0]
    index = torch.tensor(list(block_ids), dtype=torch.long, device=first.device)
    heads = first.shape[1] if kind == "cpu" else first.shape[3]
    block_size = first.shape[2]
    out = torch.empty((len(index), len(layers), 2, heads, block_size, head_dim), dtype=first.dtype,
                      device=first.device)
    for i, layer in enumerate(layers):
        if kind == "cpu":  # (n, heads, bs, 2d): K then V in each row
            blocks = layer.index_select(0, index).unflatten(-1, (2, head_dim)).permute(0, 3, 1, 2, 4)
        else:  # (2, n, bs, heads, d)
            blocks = layer.index_select(1, index).permute(1, 0, 3, 2, 4)
        out[:, i].copy_(blocks)
    return out.cpu()


def stacked_view(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The layers as one (num_layers, *layer shape) view, when they are views of one storage
    at evenly spaced offsets, alike in shape, strides and dtype (vLLM allocates its CPU cache as
    one tensor and hands each layer a slice); None otherwise. Writing through it is writing
    into the layers themselves."""
    first = layers[0]
    base = first.untyped_storage().data_ptr()
    if any(t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype
           or t.device != first.device or t.untyped_storage().data_ptr() != base for t in layers):
        return None
    step = layers[1].storage_offset() - first.storage_offset() if len(layers) > 1 else 0
    if len(layers) > 1 and (step <= 0 or any(t.storage_offset() != first.storage_offset() + i * step
                                             for i, t in enumerate(layers))):
        return None
    return first.as_strided((len(layers), *first.shape), (step, *first.stride()), first.storage_offset())


def scatter_blocks(layers: Sequence[torch.Tensor], block_ids: Sequence[int], pages: Sequence[torch.Tensor],
                   kind: str, head_dim: int) -> None:
    """Write each page (layers, 2, kv_heads, block_size, head_dim) into its block of every layer,
    straight from the page (no intermediate tensor). Where the layers are slices of one tensor
    (`stacked_view`), one copy a block writes every layer: 6 copies instead of 180 for 6 blocks
    of SmolLM2's 30 layers, whose Python and dispatch cost would otherwise dominate a small load."""
    stacked = stacked_view(layers)
    if stacked is not None:
        for block, page in zip(block_ids, pages, strict=True):
            if kind == "cpu":  # (L, heads, bs, 2d) -> (L, 2, heads, bs, d)
                stacked[:, block].unflatten(-1, (2, head_dim)).permute(0, 3, 1, 2, 4).copy_(page)
            else:  # (L, 2, bs, heads, d) <- (L, 2, heads, bs, d)
                stacked[:, :, block].copy_(page.transpose(2, 3))
        return
    for block, page in zip(block_ids, pages, strict=True):
        for i, layer in enumerate(layers):
            if kind == "cpu":
                # K and V halves of the packed last dim as one (2, heads, block_size, dim) view:
                # one copy per layer, half the calls of copying K and V apart.
                layer[block].unflatten(-1, (2, head_dim)).permute(2, 0, 1, 3).copy_(page[i])
            else:
                layer[0, block].copy_(page[i, 0].transpose(0, 1))
                layer[1, block].copy_(page[i, 1].transpose(0, 1))
