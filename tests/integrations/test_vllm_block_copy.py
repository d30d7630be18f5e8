"""The connector's block copiers (`block_copy.py`) against the reference slices of `layout.py`:
`DeviceBlocks` (the staged path a CUDA cache takes: gather into staging, one copy across, scatter)
run here with torch ops on CPU tensors, in every layout vLLM hands out (the CPU one, the flash one,
and the flash shape over a head-major allocation, as backends with another stride order give it).
Its kernels run by emulation in tests/device/test_kernels_cpu.py and on a GPU in test_kernels_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tiered_cache.integrations.vllm.block_copy import BlockStrides, DeviceBlocks, HostBlocks, block_copier
from tiered_cache.integrations.vllm.layout import gather_blocks, layout_of, scatter_blocks

LAYERS, HEADS, DIM, BS, BLOCKS = 4, 2, 8, 4, 10


def vllm_layers(kind: str, seed: int, dtype: torch.dtype = torch.float32, dim: int = DIM) -> list[torch.Tensor]:
    """Layers of random bytes as vLLM lays them out: "cpu", "flash", or "flash-hnd" (the flash
    shape as a view of a (2, blocks, heads, block_size, dim) allocation)."""
    g = torch.Generator().manual_seed(seed)
    shape = {"cpu": (BLOCKS, HEADS, BS, 2 * dim), "flash": (2, BLOCKS, BS, HEADS, dim),
             "flash-hnd": (2, BLOCKS, HEADS, BS, dim)}[kind]
    out = []
    for _ in range(LAYERS):
        t = torch.randint(-100, 100, shape, generator=g).to(dtype)
        out.append(t.transpose(2, 3) if kind == "flash-hnd" else t)
    return out


KINDS = ["cpu", "flash", "flash-hnd"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("dtype", "dim"), [(torch.float32, DIM), (torch.float16, 5), (torch.bfloat16, DIM)])
def test_the_staged_copier_gathers_and_scatters_the_bytes_the_reference_does(kind, dtype, dim):
    src = vllm_layers(kind, 1, dtype, dim)
    layout = layout_of(src[0], HEADS, dim)
    copier = DeviceBlocks(src, layout, HEADS, dim, BS)
    pages, ready = copier.gather([7, 2, 9])
    ready()
    assert torch.equal(pages, gather_blocks(src, [7, 2, 9], layout, dim))

    # A layer group (layers 1-2) into other blocks: the same writes as the reference, nothing else.
    staged, reference = vllm_layers(kind, 2, dtype, dim), vllm_layers(kind, 2, dtype, dim)
    group = [page[1:3] for page in pages]
    DeviceBlocks(staged, layout, HEADS, dim, BS).scatter([1, 5, 3], group, range(1, 3))
    scatter_blocks(reference[1:3], [1, 5, 3], group, layout, dim)
    assert all(torch.equal(a, b) for a, b in zip(staged, reference, strict=True))
    assert not torch.equal(staged[1], vllm_layers(kind, 2, dtype, dim)[1])  # it did write


def test_strides_name_where_a_unit_lies_in_each_layout():
    cpu = vllm_layers("cpu", 0)[0]
    assert BlockStrides.of(cpu, "cpu", DIM) == BlockStrides(DIM * 4, DIM * 4, HEADS * BS * 2 * DIM * 4,
                                                           2 * DIM * 4, BS * 2 * DIM * 4)
    flash = vllm_layers("flash-hnd", 0)[0]  # heads before tokens in memory
    assert BlockStrides.of(flash, "flash", DIM) == BlockStrides(DIM * 4, BLOCKS * HEADS * BS * DIM * 4,
                                                               HEADS * BS * DIM * 4, DIM * 4, BS * DIM * 4)
    with pytest.raises(ValueError, match="not contiguous"):
        BlockStrides.of(torch.zeros(2, BLOCKS, BS, HEADS, 2 * DIM)[..., ::2], "flash", DIM)


def test_layers_unlike_each_other_are_refused_by_the_staged_copier_and_copied_by_slices():
    layers = vllm_layers("flash", 3)
    layers[2] = layers[2].contiguous().transpose(2, 3).contiguous().transpose(2, 3)  # other strides
    with pytest.raises(ValueError, match="differ"):
        DeviceBlocks(layers, "flash", HEADS, DIM, BS)
    assert isinstance(block_copier(layers, "flash", HEADS, DIM, BS), HostBlocks)  # a CPU cache: slices
    pages, ready = HostBlocks(layers, "flash", DIM).gather([4])
    ready()
    assert torch.equal(pages, gather_blocks(layers, [4], "flash", DIM))


@pytest.mark.parametrize("pages_a_buffer", [0, 1, 2.5, 100])
def test_a_load_larger_than_its_buffers_crosses_in_runs_and_writes_every_block(pages_a_buffer):
    """A load goes through two fixed buffers in turns: runs of as many pages as a buffer holds
    (a page larger than a buffer on its own); every block written as the reference writes it."""
    src = vllm_layers("flash", 1, torch.bfloat16, DIM)
    pages, ready = DeviceBlocks(src, "flash", HEADS, DIM, BS).gather([0, 3, 5, 6, 8, 9, 1])
    ready()
    page_bytes = pages[0][1:4].numel() * pages.element_size()
    staged, reference = vllm_layers("flash", 2, torch.bfloat16, DIM), vllm_layers("flash", 2, torch.bfloat16, DIM)
    copier = DeviceBlocks(staged, "flash", HEADS, DIM, BS, load_buffer_bytes=int(pages_a_buffer * page_bytes) or 1)
    group = [page[1:4] for page in pages]
    copier.scatter([9, 2, 4, 0, 7, 1, 5], group, range(1, 4))
    scatter_blocks(reference[1:4], [9, 2, 4, 0, 7, 1, 5], group, "flash", DIM)
    assert all(torch.equal(a, b) for a, b in zip(staged, reference, strict=True))
    copier.scatter([3, 6], [group[0], group[6]], range(1, 4))  # the buffers again, another load
    scatter_blocks(reference[1:4], [3, 6], [group[0], group[6]], "flash", DIM)
    assert all(torch.equal(a, b) for a, b in zip(staged, reference, strict=True))

def test_the_connector_copy_bench_times_checked_copies_beside_the_plain_copy(monkeypatch):
    """`bench kernels`' connector rows (here on the CPU, torch ops): a save and a load row per
    copier, each beside the plain copy of the same bytes; a copier that moves the wrong bytes
    gives no figure."""
    from tiered_cache.bench.connector_copy_bench import bench_connector_copy
    from tiered_cache.model.spec import KVSpec

    spec = KVSpec("tiny", num_layers=3, num_kv_heads=2, head_dim=8, dtype="bf16", page_size=4)
    rows = bench_connector_copy(spec, tokens=40, device="cpu", repeat=2)
    steady = [r for r in rows if "first call" not in r.operation]
    assert [r.operation for r in steady] == ["connector save (torch ops)", "connector load (torch ops)"]
    assert all(r.work == r.baseline_work == 10 * spec.bytes_per_page and r.value > 0 for r in steady)
    assert [r.baseline_name for r in steady] == ["memcpy to host", "memcpy from host"]

    real = DeviceBlocks.gather

    def off_by_one(self, ids):
        return real(self, [(i + 1) % 20 for i in ids])

    monkeypatch.setattr(DeviceBlocks, "gather", off_by_one)
    with pytest.raises(AssertionError, match="save"):
        bench_connector_copy(spec, tokens=40, device="cpu", repeat=1)
