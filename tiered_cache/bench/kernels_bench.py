"""`tiered-cache bench kernels` (needs CUDA): the CuPy gather/scatter against a device-to-device
copy of the same bytes, and offload to pinned host memory against a plain pinned async copy and
against the naive torch way (`index_select` then `.cpu()`), all measured in the same run."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tiered_cache.bench.timing import Comparison
from tiered_cache.device.pool import PagePool
from tiered_cache.device.transfers import PinnedBuffers, Transfers
from tiered_cache.model.spec import KVSpec

GB = 1e9


def _cuda_time(fn: Callable[[], object], repeat: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def bench_kernels(spec: KVSpec, num_pages: int = 1024) -> list[Comparison]:
    if not torch.cuda.is_available():
        raise RuntimeError("bench kernels needs a CUDA device; the CPU path is the torch reference")
    pool = PagePool(spec, 2 * num_pages, "cuda")
    pages = pool.allocate(num_pages)[torch.randperm(num_pages).numpy()]  # scattered, as in a real pool
    total = num_pages * spec.bytes_per_page
    staging = torch.empty(spec.staging_shape(num_pages), dtype=pool.kv.dtype, device="cuda")
    src = torch.empty_like(staging)
    d2d = _cuda_time(lambda: staging.copy_(src))
    scale = f"{num_pages} × {spec.bytes_per_page / 2**20:.2f} MiB"
    rows = [
        Comparison(scale, f"gather ({pool.ops.name})", total / _cuda_time(lambda: pool.gather(pages, out=staging)) / GB,
                   "device-to-device copy", total / d2d / GB, "GB/s", True),
        Comparison(scale, f"scatter ({pool.ops.name})", total / _cuda_time(lambda: pool.scatter(pages, staging)) / GB,
                   "device-to-device copy", total / d2d / GB, "GB/s", True),
    ]
    transfers = Transfers(pool, PinnedBuffers(pool, num_pages, 1))
    pinned = torch.empty(staging.shape, dtype=staging.dtype, pin_memory=True)

    def offload() -> None:
        transfers.offload(pages).release()

    plain = _cuda_time(lambda: pinned.copy_(staging, non_blocking=True))
    index = torch.as_tensor(pages, device="cuda")
    naive = _cuda_time(lambda: pool.kv.index_select(2, index).cpu(), repeat=3)
    ours = _cuda_time(offload)
    rows += [Comparison(scale, "offload to pinned host", total / ours / GB, "pinned cudaMemcpyAsync",
                        total / plain / GB, "GB/s", True),
             Comparison(scale, "offload to pinned host", total / ours / GB, "naive index_select + .cpu()",
                        total / naive / GB, "GB/s", True)]
    return rows
