"""The vLLM connector's block copies (`integrations/vllm/block_copy.py`), timed as its hooks call
them: a save gathers a request's blocks out of vLLM's per-layer KV (flash layout) into pinned host
pages, a load scatters host pages (as the tiers hand them) back into blocks. Each beside the
plain pinned copy of the same bytes in the same run (the limit of the crossing), and our kernels
beside the same steps as torch ops. Every timed copy is checked against the reference slices of
`layout.py` before its figure is printed: a copier that moved the wrong bytes raises."""

from __future__ import annotations

import torch

from tiered_cache.bench.timing import Comparison, best_time, timed
from tiered_cache.integrations.vllm.block_copy import BlockKernels, DeviceBlocks
from tiered_cache.integrations.vllm.layout import gather_blocks
from tiered_cache.model.spec import KVSpec

GB = 1e9


def vllm_flash_layers(spec: KVSpec, num_blocks: int, device: str) -> list[torch.Tensor]:
    """vLLM's flash KV cache of this shape: per layer (2, num_blocks, block_size, kv_heads, head_dim),
    random bytes."""
    shape = (2, num_blocks, spec.page_size, spec.num_kv_heads, spec.head_dim)
    return [torch.randn(shape, device=device).to(spec.dtype.torch) for _ in range(spec.num_layers)]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_connector_copy(spec: KVSpec, tokens: int = 8192, device: str = "cuda",
                         kernels: BlockKernels | None = None, repeat: int = 5) -> list[Comparison]:
    """Save and load of `tokens` tokens' blocks, scattered over a cache twice that size.
    `kernels`: our launch (`cupy_ops.launch_blocks`) or None for the torch ops alone."""
    blocks = spec.pages_for_tokens(tokens)
    layers = vllm_flash_layers(spec, 2 * blocks, device)
    dev = layers[0].device
    ids = torch.randperm(2 * blocks)[:blocks].tolist()  # scattered, as in a running engine
    copiers = {"torch ops": DeviceBlocks(layers, "flash", spec.num_kv_heads, spec.head_dim, spec.page_size)}
    if kernels is not None:
        copiers["our kernels"] = DeviceBlocks(layers, "flash", spec.num_kv_heads, spec.head_dim, spec.page_size,
                                              kernels)
    reference = gather_blocks(layers, ids, "flash", spec.head_dim)
    total = reference.numel() * reference.element_size()
    pinned = dev.type == "cuda"
    host = torch.empty(reference.shape, dtype=reference.dtype, pin_memory=pinned)
    on_device = torch.empty(reference.shape, dtype=reference.dtype, device=dev)

    def down() -> None:
        host.copy_(on_device, non_blocking=pinned)
        _synchronize(dev)

    def up() -> None:
        on_device.copy_(host, non_blocking=pinned)
        _synchronize(dev)

    down()  # each limit after one unmeasured call
    limit_down = best_time(down, repeat)
    up()
    limit_up = best_time(up, repeat)
    limit = "pinned copy" if pinned else "memcpy"
    pages = [p.clone() for p in reference]  # host pages as the tiers give them (not pinned)
    scale = f"{tokens:,} tokens, {blocks} blocks, {total / 2**20:,.0f} MiB"
    rows = []
    for name, copier in copiers.items():
        def save(copier: DeviceBlocks = copier) -> torch.Tensor:
            got, ready = copier.gather(ids)
            ready()
            return got

        first = best_time(save, 1)
        best, got = timed(save, repeat)
        if not torch.equal(got, reference):
            raise AssertionError(f"connector save ({name}) gathered bytes unlike vLLM's blocks")
        rows += [Comparison(scale, f"connector save ({name})", total / best / GB, f"{limit} to host",
                            total / limit_down / GB, "GB/s", True, work=total, baseline_work=total),
                 Comparison(scale, f"connector save ({name}): first call", total / first / GB, "its steady calls",
                            total / best / GB, "GB/s", True)]
        for t in layers:
            t.zero_()
        _synchronize(dev)

        def load(copier: DeviceBlocks = copier) -> None:
            copier.scatter(ids, pages, range(spec.num_layers))

        first = best_time(load, 1)
        best = best_time(load, repeat)
        if not torch.equal(gather_blocks(layers, ids, "flash", spec.head_dim), reference):
            raise AssertionError(f"connector load ({name}) wrote bytes unlike the pages")
        rows += [Comparison(scale, f"connector load ({name})", total / best / GB, f"{limit} from host",
                            total / limit_up / GB, "GB/s", True, work=total, baseline_work=total),
                 Comparison(scale, f"connector load ({name}): first call", total / first / GB, "its steady calls",
                            total / best / GB, "GB/s", True)]
    return rows
