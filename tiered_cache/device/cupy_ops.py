"""`CupyPageOps`: the page pool's data movements as CUDA kernels (`kernels/*.cu`), compiled at run
time by CuPy (NVRTC) and launched on torch's current CUDA stream, on torch tensors without
copies (through `__cuda_array_interface__` of uint8 views, so bf16 works too).

Same calls and same bytes as `TorchPageOps`; `pool_ops.select_ops` picks this one for CUDA
tensors when CuPy is installed.
"""

from __future__ import annotations

import warnings
from functools import cache
from typing import Any

import numpy as np

from tiered_cache.device.kernel_source import kernel_dir, kernel_source
from tiered_cache.model.spec import Layout

_THREADS = 256  # per block: 8 warps
_MAX_BLOCKS = 65535


def available() -> bool:
    """CuPy imports and sees a CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@cache
def _kernel(name: str) -> Any:
    import cupy

    module = cupy.RawModule(code=kernel_source(name), options=(f"-I{kernel_dir()}", "--std=c++17"))
    return module.get_function(name)


def _bytes(tensor: Any) -> Any:
    import cupy
    import torch

    return cupy.asarray(tensor.view(torch.uint8))


def _on_torch_stream(launch: Any) -> None:
    import cupy
    import torch

    with _external_stream(cupy, torch.cuda.current_stream().cuda_stream):
        launch()


def _external_stream(cupy: Any, handle: int) -> Any:
    """A CuPy view of torch's stream `handle`: `Stream.from_external` where CuPy has it (14+,
    which deprecates `ExternalStream`), else `ExternalStream`."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            return from_external(_StreamHandle(handle))
        except (TypeError, AttributeError, ValueError):
            pass  # an older protocol: the deprecated class still works
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle)


class _StreamHandle:
    """The CUDA stream protocol (`__cuda_stream__`: version 0, the handle) for a raw handle."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


_KERNELS = ("store_kv", "gather_pages", "scatter_pages", "copy_pages", "gather_blocks", "scatter_blocks")


class CupyPageOps:
    name = "cupy"

    def warm_up(self) -> None:
        """Compile (or load from CuPy's cache) and load every kernel now, so the first request that
        moves pages does not pay for NVRTC and module loading (hundreds of ms on a fresh machine)."""
        for name in _KERNELS:
            _kernel(name)

    def write(self, pool: Any, layout: Layout, page_size: int, slots: Any, kv: Any) -> None:
        layers, _, tokens, heads, dim = kv.shape
        rows = layers * 2 * tokens * heads
        warps = _THREADS // 32
        grid = (min(_MAX_BLOCKS, -(-rows // warps)),)
        args = (_bytes(kv.contiguous()), _bytes(pool), _index(slots), np.int64(layers), np.int64(tokens),
                np.int64(heads), np.int64(pool.shape[2]), np.int64(page_size), np.int64(dim * kv.element_size()),
                np.int32(layout is Layout.HND))
        _on_torch_stream(lambda: _kernel("store_kv")(grid, (_THREADS,), args))

    def gather(self, pool: Any, pages: Any, out: Any) -> None:
        self._move("gather_pages", pool, pages, out, source=pool, target=out)

    def scatter(self, pool: Any, pages: Any, staging: Any) -> None:
        self._move("scatter_pages", pool, pages, staging.contiguous(), source=None, target=pool)

    def copy(self, pool: Any, src: Any, dst: Any) -> None:
        num_layers, pool_pages = pool.shape[1], pool.shape[2]
        block_bytes = pool[0, 0, 0].numel() * pool.element_size()
        n = src.numel()
        grid = (min(_MAX_BLOCKS, -(-n * num_layers * 2 // (_THREADS // 32))),)
        args = (_bytes(pool), _index(src), _index(dst), np.int64(n), np.int64(num_layers), np.int64(pool_pages),
                np.int64(block_bytes))
        _on_torch_stream(lambda: _kernel("copy_pages")(grid, (_THREADS,), args))

    def _move(self, kernel: str, pool: Any, pages: Any, staging: Any, source: Any, target: Any) -> None:
        num_layers, pool_pages = pool.shape[1], pool.shape[2]
        block_bytes = pool[0, 0, 0].numel() * pool.element_size()
        n = pages.numel()
        grid = (min(_MAX_BLOCKS, -(-n * num_layers * 2 // (_THREADS // 32))),)  # one warp per block
        first, second = (_bytes(pool), _bytes(staging)) if kernel == "gather_pages" else \
            (_bytes(staging), _bytes(pool))
        args = (first, second, _index(pages), np.int64(n), np.int64(num_layers), np.int64(pool_pages),
                np.int64(block_bytes))
        _on_torch_stream(lambda: _kernel(kernel)(grid, (_THREADS,), args))


def _index(indices: Any) -> Any:
    import cupy
    import torch

    return cupy.asarray(indices.to(torch.int64).contiguous())


def launch_blocks(kernel: str, pointers: Any, staging: Any, blocks: Any, heads: int, block_size: int,
                  strides: tuple[int, int, int, int, int]) -> None:
    """`gather_blocks` or `scatter_blocks` (kernels/) on torch's current stream: an engine's
    per-layer KV (`pointers`: one int64 device address a layer) <-> `staging`, our pages of
    `blocks` (n, layers, 2, heads, block_size, row). `strides`: (row bytes, then the K/V, block,
    token and head strides in bytes)."""
    row, kv, block, token, head = strides
    n, num_layers = blocks.numel(), pointers.numel()
    grid = (min(_MAX_BLOCKS, -(-n * num_layers * 2 * heads // (_THREADS // 32))),)  # one warp a unit
    args = (_index(pointers), _bytes(staging), _index(blocks), np.int64(n), np.int64(num_layers), np.int64(heads),
            np.int64(block_size), np.int64(row), np.int64(kv), np.int64(block), np.int64(token), np.int64(head))
    _on_torch_stream(lambda: _kernel(kernel)(grid, (_THREADS,), args))
