"""Where the gather kernel's time goes, on a CUDA machine: the whole `PagePool.gather` call, the
bare kernel launch with prepared arguments, random vs sorted pages, and launch shapes, each
beside a device-to-device copy of the same bytes (events, median of 20 after warm-up).
Usage: python3 scripts/kernel_variants.py [MODEL ...]   (default llama-3.1-8b smollm2-135m)"""

from __future__ import annotations

import statistics
import sys

import cupy
import numpy as np
import torch

from tiered_cache.device import cupy_ops
from tiered_cache.device.pool import PagePool
from tiered_cache.model.presets import get_preset


def timed(fn, repeat: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main(models: list[str]) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for model in models:
        one_model(model, sms)


def one_model(model: str, sms: int) -> None:
    spec = get_preset(model).spec
    n = 2048
    pool = PagePool(spec, 2 * n, "cuda")
    pool.kv.view(torch.uint8).random_(0, 255)
    pages = pool.allocate(n)[np.random.default_rng(0).permutation(n)]
    total = n * spec.bytes_per_page
    staging = torch.empty(spec.staging_shape(n), dtype=pool.kv.dtype, device="cuda")
    src = torch.empty_like(staging).random_(0, 100)
    d2d = timed(lambda: staging.copy_(src))
    rows = [("device-to-device copy", d2d)]
    rows.append(("PagePool.gather (whole call)", timed(lambda: pool.gather(pages, out=staging))))
    reference = pool.kv.index_select(2, torch.as_tensor(pages, device="cuda")).permute(2, 1, 0, 3, 4, 5)
    # Random bytes hold NaNs: compare bytes, not values.
    expected = reference.reshape(staging.shape).contiguous().view(torch.uint8)
    assert torch.equal(staging.view(torch.uint8), expected), "gather wrote wrong bytes"
    kernel = cupy_ops._kernel("gather_pages")
    layers = pool.kv.shape[1]
    block_bytes = pool.kv[0, 0, 0].numel() * pool.kv.element_size()
    units = n * layers * 2
    for label, order in (("random pages", pages), ("sorted pages", np.sort(pages))):
        idx = cupy.asarray(torch.as_tensor(order, device="cuda"))
        args = (cupy.asarray(pool.kv.view(torch.uint8)), cupy.asarray(staging.view(torch.uint8)), idx,
                np.int64(n), np.int64(layers), np.int64(pool.kv.shape[2]), np.int64(block_bytes))
        for threads, grid_name, grid in ((256, "1 warp/unit", -(-units // 8)), (256, "SMs x 16", sms * 16),
                                         (512, "SMs x 8", sms * 8), (1024, "SMs x 2", sms * 2)):
            grid = min(grid, 65535)

            def launch(grid=grid, threads=threads, args=args, kernel=kernel):
                with cupy_ops._external_stream(cupy, torch.cuda.current_stream().cuda_stream):
                    kernel((grid,), (threads,), args)

            rows.append((f"bare kernel, {label}, {threads} threads, {grid_name} ({grid})", timed(launch)))
    print(f"\n{model}: {n} pages x {spec.bytes_per_page / 2**20:.2f} MiB, block {block_bytes} B, {units} units")
    for name, t in rows:
        print(f"  {name:<62} {t * 1e3:8.3f} ms  {total / t / 1e9:8.1f} GB/s  {d2d / t:5.2f}x copy")


def profile_gather(model: str = "llama-3.1-8b") -> None:
    """Where the host time of a whole `PagePool.gather` call goes (cProfile, 20 calls)."""
    import cProfile
    import pstats

    spec = get_preset(model).spec
    pool = PagePool(spec, 4096, "cuda")
    pages = pool.allocate(2048)[np.random.default_rng(0).permutation(2048)]
    staging = torch.empty(spec.staging_shape(2048), dtype=pool.kv.dtype, device="cuda")
    pool.gather(pages, out=staging)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        pool.gather(pages, out=staging)
        torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--profile"]:
        profile_gather(*sys.argv[2:])
    else:
        main(sys.argv[1:] or ["llama-3.1-8b", "smollm2-135m"])
