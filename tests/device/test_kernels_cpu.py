"""The CUDA kernels' logic, checked on the CPU: `kernels/*.cu` compiled with g++ against a tiny
CUDA shim (tests/kernel_emulation/) and run block by block, compared byte for byte with the torch
reference on fresh random data, with poisoned outputs so every byte must be written. The GPU
tests (test_kernels_gpu.py) check the same on a real device; this one runs everywhere."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tiered_cache.device.kernel_source import kernel_dir
from tiered_cache.device.pool import PagePool
from tiered_cache.model.spec import DType, KVSpec, Layout

HERE = Path(__file__).resolve().parents[1] / "kernel_emulation"
i64p = ctypes.POINTER(ctypes.c_int64)
u8p = ctypes.POINTER(ctypes.c_uint8)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    compiler = shutil.which("g++")
    assert compiler, "g++ is needed to emulate the CUDA kernels on the CPU"
    out = tmp_path_factory.mktemp("kernels") / "emulated.so"
    subprocess.run([compiler, "-O1", "-std=c++17", "-shared", "-fPIC", f"-I{kernel_dir()}", f"-I{HERE}",
                    "-o", str(out), str(HERE / "emulate.cpp")], check=True, capture_output=True)
    library = ctypes.CDLL(str(out))
    u32, i64 = ctypes.c_uint, ctypes.c_int64
    move = [u32, u32, u8p, u8p, i64p, i64, i64, i64, i64]
    library.run_gather.argtypes = move
    library.run_scatter.argtypes = move
    library.run_copy.argtypes = [u32, u32, u8p, i64p, i64p, i64, i64, i64, i64]
    library.run_store.argtypes = [u32, u32, u8p, u8p, i64p, i64, i64, i64, i64, i64, i64, ctypes.c_int]
    blocks = [u32, u32, i64p, u8p, i64p, *[i64] * 9]
    library.run_gather_blocks.argtypes = blocks
    library.run_scatter_blocks.argtypes = blocks
    return library


def ptr(t: torch.Tensor, kind=u8p):
    return ctypes.cast(t.data_ptr(), kind)


SPECS = [
    KVSpec("fp16-nhd", 2, 2, 64, DType.FP16, 16),
    KVSpec("bf16-hnd", 3, 2, 32, DType.BF16, 16, Layout.HND),
    KVSpec("fp32-p1", 2, 1, 8, DType.FP32, 1),
    KVSpec("fp16-p64", 1, 4, 16, DType.FP16, 64, Layout.HND),
    KVSpec("odd-dim-5", 2, 3, 5, DType.FP16, 4),  # 10-byte rows: the byte path
    KVSpec("odd-dim-6", 2, 3, 6, DType.FP16, 4),  # 12-byte rows: the 4-byte path
    KVSpec("fp8", 2, 2, 24, DType.FP8_E4M3, 8),
]


def random_pool(spec, num_pages, seed):
    pool = PagePool(spec, num_pages)
    raw = torch.randint(0, 256, (pool.kv.numel() * pool.kv.element_size(),), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    pool.kv.view(torch.uint8).view(-1).copy_(raw)
    return pool


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.model_id)
def test_gather_and_scatter_kernels_match_torch(lib, spec):
    pool = random_pool(spec, 9, 1)
    pages = torch.tensor([7, 2, 5, 0], dtype=torch.int64)
    raw = pool.kv.view(torch.uint8)  # references on bytes: torch lacks float8 indexing on the CPU
    expected = raw.index_select(2, pages).permute(2, 1, 0, *range(3, raw.dim())).contiguous()
    staging = torch.full_like(expected, 0xAB)  # poisoned: every byte must be written
    block_bytes = pool.kv[0, 0, 0].numel() * pool.kv.element_size()
    lib.run_gather(3, 64, ptr(pool.kv), ptr(staging), ptr(pages, i64p), 4, spec.num_layers, 9, block_bytes)
    assert torch.equal(staging, expected)

    target = random_pool(spec, 9, 2)
    reference = target.kv.view(torch.uint8).clone()
    dest = torch.tensor([1, 8, 3, 4], dtype=torch.int64)
    reference.index_copy_(2, dest, staging.permute(2, 1, 0, *range(3, raw.dim())))
    lib.run_scatter(2, 32, ptr(staging), ptr(target.kv), ptr(dest, i64p), 4, spec.num_layers, 9, block_bytes)
    assert torch.equal(target.kv.view(torch.uint8), reference)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.model_id)
def test_copy_kernel_matches_torch_and_leaves_other_pages(lib, spec):
    pool = random_pool(spec, 9, 5)
    src, dst = torch.tensor([6, 1, 3], dtype=torch.int64), torch.tensor([2, 8, 0], dtype=torch.int64)
    raw = pool.kv.view(torch.uint8)
    expected = raw.clone()
    expected[:, :, dst] = raw[:, :, src]  # the torch reference, on bytes (float8 has no CPU indexing)
    block_bytes = pool.kv[0, 0, 0].numel() * pool.kv.element_size()
    lib.run_copy(2, 64, ptr(pool.kv), ptr(src, i64p), ptr(dst, i64p), 3, spec.num_layers, 9, block_bytes)
    assert torch.equal(raw, expected)  # the pages not copied into are untouched as well


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.model_id)
def test_store_kernel_matches_torch(lib, spec):
    torch_pool = PagePool(spec, 6)
    pages = torch_pool.allocate(3)
    n = 2 * spec.page_size + 1 if spec.page_size > 1 else 3
    slots = torch.from_numpy(torch_pool.slots(pages, n)[np.random.default_rng(3).permutation(n)].copy())
    kv = torch.randint(0, 256, (int(np.prod(spec.kv_shape(n))) * spec.dtype.itemsize,), dtype=torch.uint8,
                       generator=torch.Generator().manual_seed(4)).view(spec.dtype.torch).view(spec.kv_shape(n))
    if spec.dtype is not DType.FP8_E4M3:
        torch_pool.write(slots.numpy(), kv)
    else:  # torch cannot index_put float8 on the CPU: compare bytes through a uint8 view instead
        torch_pool.ops.write(torch_pool.kv.view(torch.uint8), spec.layout, spec.page_size, slots,
                             kv.view(torch.uint8))
    emulated = torch.full_like(torch_pool.kv.view(torch.uint8), 0).view(torch_pool.kv.dtype)
    row_bytes = spec.head_dim * spec.dtype.itemsize
    lib.run_store(4, 64, ptr(kv), ptr(emulated), ptr(slots, i64p), spec.num_layers, n, spec.num_kv_heads, 6,
                  spec.page_size, row_bytes, int(spec.layout is Layout.HND))
    assert torch.equal(emulated.view(torch.uint8), torch_pool.kv.view(torch.uint8))


def emulated_launch(lib):
    """`cupy_ops.launch_blocks`'s contract, run by the emulated kernels on CPU tensors."""
    def launch(kernel, pointers, staging, blocks, heads, block_size, strides):
        run = lib.run_gather_blocks if kernel == "gather_blocks" else lib.run_scatter_blocks
        run(3, 64, ptr(pointers, i64p), ptr(staging), ptr(blocks, i64p), blocks.numel(), pointers.numel(), heads,
            block_size, *strides)
    return launch


@pytest.mark.parametrize("kind", ["cpu", "flash", "flash-hnd"])
@pytest.mark.parametrize(("dtype", "dim"), [(torch.float16, 8), (torch.float16, 5), (torch.float16, 6),
                                            (torch.bfloat16, 16), (torch.float32, 3)])
def test_block_kernels_through_the_connectors_copier_match_the_reference_slices(lib, kind, dtype, dim):
    """gather_blocks / scatter_blocks (16-byte, 4-byte and byte rows) launched as the connector's
    `DeviceBlocks` launches them on a GPU: its pointer table, strides and layer groups."""
    from tests.integrations.test_vllm_block_copy import BS, HEADS, vllm_layers
    from tiered_cache.integrations.vllm.block_copy import DeviceBlocks
    from tiered_cache.integrations.vllm.layout import gather_blocks, layout_of, scatter_blocks

    src = vllm_layers(kind, 5, dtype, dim)  # each layer its own allocation
    layout = layout_of(src[0], HEADS, dim)
    pages, ready = DeviceBlocks(src, layout, HEADS, dim, BS, emulated_launch(lib)).gather([6, 0, 9, 2])
    ready()
    assert torch.equal(pages, gather_blocks(src, [6, 0, 9, 2], layout, dim))

    emulated, reference = vllm_layers(kind, 6, dtype, dim), vllm_layers(kind, 6, dtype, dim)
    group = [page[2:4] for page in pages]  # the last two layers' group
    DeviceBlocks(emulated, layout, HEADS, dim, BS, emulated_launch(lib)).scatter([3, 8, 1, 4], group, range(2, 4))
    scatter_blocks(reference[2:4], [3, 8, 1, 4], group, layout, dim)
    assert all(torch.equal(a, b) for a, b in zip(emulated, reference, strict=True))
    assert not torch.equal(emulated[3], vllm_layers(kind, 6, dtype, dim)[3])


def test_every_kernel_compiles_for_sm90_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed (make check-kernels skips too)")
    # All at once (each nvcc is one process, mostly single-threaded): the same compiles, side by side.
    compiles = {source: subprocess.Popen([nvcc, "-arch=sm_90", "-c", "-o", str(tmp_path / f"{source.stem}.o"),
                                          str(source)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for source in sorted(kernel_dir().glob("*.cu"))}
    failed = {source.name: out for source, proc in compiles.items()
              if (out := proc.communicate(timeout=300)[0]) is not None and proc.returncode != 0}
    assert not failed, failed


def test_dispatch_picks_torch_without_cuda_and_explains_cupy():
    from tiered_cache.device.pool_ops import select_ops

    assert select_ops(torch.device("cpu")).name == "torch"
    assert PagePool(SPECS[0], 2).ops.name == "torch"
    if not torch.cuda.is_available():
        assert select_ops(torch.device("cuda")).name == "torch"  # no device: the reference path
        with pytest.raises(ValueError, match="need CuPy and a CUDA device"):
            select_ops(torch.device("cpu"), "cupy")
