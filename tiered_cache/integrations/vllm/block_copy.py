"""Copies between vLLM's per-layer KV and our pages (vLLM-free, torch only).

Two copiers with one interface (`gather`, `scatter`), picked by `block_copier` from where vLLM
keeps its KV:
- `HostBlocks` (vLLM's CPU cache): torch slices (`layout.py`), one copy a block where the layers
  are slices of one tensor;
- `DeviceBlocks` (a CUDA cache): our transfer kernels (`kernels/gather_blocks.cu`,
  `scatter_blocks.cu`) on a copy stream of their own: a save gathers the blocks into device
  staging and crosses to pinned host memory in one DMA; a load goes through two pinned buffers
  of its own in turns (the next run of pages copied into one while the other crosses), each run
  one DMA and one scatter. Without CuPy the same steps run as torch ops on the device.
A page is (layers, 2, kv_heads, block_size, head_dim) whatever vLLM's layout: `BlockStrides`
describes the layout, so one kernel serves the CPU layout and the CUDA ones.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tiered_cache.integrations.vllm.layout import gather_blocks, scatter_blocks

log = logging.getLogger(__name__)

# Each of a CUDA load's two pinned buffers: runs of this size keep the DMA busy while the next is
# copied in, and two of them stay small beside the engine's host memory.
LOAD_BUFFER_BYTES = 64 << 20


def _ready() -> None:
    """A host copy that is complete when returned."""


@dataclass(frozen=True)
class BlockStrides:
    """Where one (block, K/V, head) unit of a layer lies, in bytes: its block_size token rows are
    `token` apart, each `row` bytes long (head_dim contiguous elements)."""
    row: int
    kv: int
    block: int
    token: int
    head: int

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return self.row, self.kv, self.block, self.token, self.head

    @classmethod
    def of(cls, layer: torch.Tensor, kind: str, head_dim: int) -> BlockStrides:
        """The strides of one layer in vLLM's `kind` layout ("cpu" or "flash", `layout.layout_of`);
        ValueError when a head's elements are not contiguous (no row to copy whole)."""
        size, s = layer.element_size(), layer.stride()
        if s[-1] != 1:
            raise ValueError(f"KV layer strides {s}: head_dim elements are not contiguous")
        if kind == "cpu":  # (blocks, heads, block_size, 2 * head_dim): V follows K in each row
            return cls(head_dim * size, head_dim * size, s[0] * size, s[2] * size, s[1] * size)
        return cls(head_dim * size, s[0] * size, s[1] * size, s[2] * size, s[3] * size)  # (2, blocks, bs, heads, d)


def block_view(layer: torch.Tensor, strides: BlockStrides, heads: int, block_size: int) -> torch.Tensor:
    """The layer as (num_blocks, 2, heads, block_size, head_dim): each block one of our pages'
    layers, a view (writes go to vLLM's KV)."""
    size = layer.element_size()
    elems = [x // size for x in (strides.block, strides.kv, strides.head, strides.token)]
    num_blocks = layer.shape[0] if layer.dim() == 4 else layer.shape[1]
    shape = (num_blocks, 2, heads, block_size, strides.row // size)
    return layer.as_strided(shape, (*elems, 1), layer.storage_offset())


class BlockKernels(Protocol):
    def __call__(self, kernel: str, pointers: torch.Tensor, staging: torch.Tensor, blocks: torch.Tensor, heads: int,
                 block_size: int, strides: tuple[int, int, int, int, int]) -> None: ...


class HostBlocks:
    """vLLM's KV in host memory: torch slices, straight from and into the layers."""

    def __init__(self, layers: Sequence[torch.Tensor], kind: str, head_dim: int) -> None:
        self.layers, self.kind, self.head_dim = list(layers), kind, head_dim

    def gather(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, Callable[[], None]]:
        """A host copy of `block_ids` of every layer as pages (n, layers, 2, heads, block_size,
        head_dim), and a call that returns once the copy is complete."""
        return gather_blocks(self.layers, block_ids, self.kind, self.head_dim), _ready

    def mark(self) -> None:
        """Nothing to order against on the host."""
        return None

    def scatter(self, block_ids: Sequence[int], pages: Sequence[torch.Tensor], layers: range,
                after: Any = None) -> None:
        """Write each page (len(layers), 2, heads, block_size, head_dim) into its block of the
        layers `layers`; complete when returned."""
        scatter_blocks(self.layers[layers.start:layers.stop], block_ids, pages, self.kind, self.head_dim)


class DeviceBlocks:
    """vLLM's KV on a device: one DMA a run of blocks, gathered and scattered by our kernels
    (`kernels`, CuPy's launch on a GPU) or by torch ops on the device (`kernels=None`), on a copy
    stream ordered after the engine's stream. The layers must share their strides (vLLM's do)."""

    def __init__(self, layers: Sequence[torch.Tensor], kind: str, heads: int, head_dim: int, block_size: int,
                 kernels: BlockKernels | None = None, load_buffer_bytes: int = LOAD_BUFFER_BYTES) -> None:
        self.layers = list(layers)
        first = self.layers[0]
        self.strides = BlockStrides.of(first, kind, head_dim)
        if any(t.stride() != first.stride() or t.dtype != first.dtype or t.device != first.device
               for t in self.layers):
            raise ValueError("vLLM's KV layers differ in strides, dtype or device")
        self.device, self.dtype = first.device, first.dtype
        self.heads, self.block_size, self.head_dim = heads, block_size, head_dim
        self.kernels = kernels
        self.pointers = torch.tensor([t.data_ptr() for t in self.layers], dtype=torch.int64, device=self.device)
        self.views = [block_view(t, self.strides, heads, block_size) for t in self.layers]
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        # A load's pinned buffers, made here so no request pays for pinning them: pages (host
        # memory the tiers hand out, never pinned) are copied into one while the other crosses.
        self._load_lock = threading.Lock()
        self._buffers = [torch.empty(load_buffer_bytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        self._crossed = [torch.cuda.Event() if self.cuda else None for _ in range(2)]

    def _page_shape(self, layers: int) -> tuple[int, ...]:
        return layers, 2, self.heads, self.block_size, self.head_dim

    def _host(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.cuda)

    def mark(self) -> Any:
        """An event after the engine's work queued so far (on the calling thread's stream), for a
        `scatter` from another thread to follow: a block handed to a new request may still be read
        by the step before. None off CUDA."""
        return torch.cuda.current_stream(self.device).record_event() if self.cuda else None

    def _on_copy_stream(self, after: Any = None) -> Any:
        """The copy stream, ordered after `after` (an event) or else after the engine's work so far
        (the KV it wrote); a no-op context off CUDA."""
        if self.stream is None:
            return _NoStream()
        if after is not None:
            self.stream.wait_event(after)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def gather(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, Callable[[], None]]:
        """Pinned host pages of `block_ids` (n, layers, 2, heads, block_size, head_dim) and a call
        that waits for the DMA. The engine's stream is ordered after the gather, so vLLM may write
        the blocks again at once; the caller waits (`ready`) before reading the pages."""
        engine = torch.cuda.current_stream(self.device) if self.cuda else None
        host = self._host((len(block_ids), *self._page_shape(len(self.layers))))
        with self._on_copy_stream():
            blocks = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
            staging = torch.empty(host.shape, dtype=self.dtype, device=self.device)
            if self.kernels is not None:
                self.kernels("gather_blocks", self.pointers, staging, blocks, self.heads, self.block_size,
                             self.strides.as_tuple())
            else:
                for i, view in enumerate(self.views):
                    staging[:, i] = view.index_select(0, blocks)
            host.copy_(staging, non_blocking=self.cuda)
        if engine is None:
            return host, _ready
        done = torch.cuda.Event()
        done.record(self.stream)
        engine.wait_event(done)
        return host, done.synchronize

    def scatter(self, block_ids: Sequence[int], pages: Sequence[torch.Tensor], layers: range,
                after: Any = None) -> None:
        """Write each page (len(layers), 2, heads, block_size, head_dim) into its block of the
        layers `layers`: pages into pinned staging, one DMA, one scatter; complete when returned.
        `after`: `mark()`'s event from the engine's thread (a loader thread's own stream is not
        the engine's)."""
        if not block_ids:
            return
        shape = self._page_shape(len(layers))
        page_bytes = self.dtype.itemsize * math.prod(shape)
        run = max(1, self._buffers[0].numel() // page_bytes)
        with self._load_lock, self._on_copy_stream(after):
            # Every block id crosses first, from pinned memory: a pageable copy would wait for
            # the stream, so each run's ids would wait for the run before to cross.
            ids = torch.tensor(list(block_ids), dtype=torch.int64)
            blocks = (ids.pin_memory() if self.cuda else ids).to(self.device, non_blocking=self.cuda)
            for turn, start in enumerate(range(0, len(block_ids), run)):
                part = pages[start:start + run]
                buffer, crossed = self._buffers[turn % 2], self._crossed[turn % 2]
                if len(part) * page_bytes > buffer.numel():  # a page larger than a buffer
                    buffer = torch.empty(len(part) * page_bytes, dtype=torch.uint8, pin_memory=self.cuda)
                if crossed is not None:
                    crossed.synchronize()  # this buffer's last run is across
                host = buffer[:len(part) * page_bytes].view(self.dtype).view(len(part), *shape)
                torch.stack(list(part), out=host)
                staging = host.to(self.device, non_blocking=self.cuda)
                if crossed is not None:
                    crossed.record(self.stream)
                self._scatter_run(blocks[start:start + run], staging, layers)
        if self.stream is not None:
            self.stream.synchronize()  # in before the layer group is signalled

    def _scatter_run(self, blocks: torch.Tensor, staging: torch.Tensor, layers: range) -> None:
        """Scatter `staging` (pages of `layers` on the device) into `blocks` (their ids, on the
        device) of vLLM's KV."""
        if self.kernels is not None:
            self.kernels("scatter_blocks", self.pointers[layers.start:layers.stop], staging, blocks, self.heads,
                         self.block_size, self.strides.as_tuple())
        else:
            for j, layer in enumerate(layers):
                self.views[layer].index_copy_(0, blocks, staging[:, j])


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


BlockCopier = HostBlocks | DeviceBlocks


def block_copier(layers: Sequence[torch.Tensor], kind: str, heads: int, head_dim: int, block_size: int
                 ) -> BlockCopier:
    """`DeviceBlocks` for a CUDA cache (our kernels when CuPy sees the device, torch ops on the
    device otherwise), `HostBlocks` for vLLM's CPU cache."""
    if layers[0].device.type != "cuda":
        return HostBlocks(layers, kind, head_dim)
    from tiered_cache.device import cupy_ops

    kernels = cupy_ops.launch_blocks if cupy_ops.available() else None
    try:
        return DeviceBlocks(layers, kind, heads, head_dim, block_size, kernels)
    except ValueError as e:  # layers unlike each other: torch slices, a copy a block and layer
        log.warning("tiered-cache: %s; copying blocks layer by layer", e)
        return HostBlocks(layers, kind, head_dim)
