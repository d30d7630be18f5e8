"""The CuPy kernels and the asynchronous transfers on a real GPU (marked `gpu`: skipped without
CUDA). Bitwise equality with the torch reference on fresh random data, poisoned outputs, and a
race test that writes KV and offloads it at once."""

import pytest
import torch

from tiered_cache.device.pool import PagePool
from tiered_cache.device.pool_ops import select_ops
from tiered_cache.device.transfers import PinnedBuffers, Transfers
from tiered_cache.model.spec import DType, KVSpec, Layout

pytestmark = pytest.mark.gpu
SPECS = [
    KVSpec("fp16", 4, 8, 128, DType.FP16, 16),
    KVSpec("bf16-hnd", 4, 8, 128, DType.BF16, 16, Layout.HND),
    KVSpec("p1", 2, 2, 64, DType.FP16, 1),
    KVSpec("p64", 2, 2, 64, DType.BF16, 64),
    KVSpec("odd", 3, 3, 80, DType.FP16, 16),
    KVSpec("odd5", 2, 3, 5, DType.FP16, 4),
    KVSpec("fp32", 2, 4, 96, DType.FP32, 16),
]


def pools(spec, num_pages=40):
    cuda = PagePool(spec, num_pages, "cuda", ops="cupy")
    reference = PagePool(spec, num_pages, "cuda", ops="torch")
    assert cuda.ops.name == "cupy" and select_ops(torch.device("cuda")).name == "cupy"
    return cuda, reference


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.model_id)
def test_kernels_match_torch_bit_for_bit(spec):
    """Every kernel writes the bytes torch's reference ops write, and only its target pages: the
    reference pool mirrors every allocation and every call, so after each step the two pools are
    byte-identical, and a copy leaves every page outside its targets as it was."""
    cuda, reference = pools(spec)
    for pool in (cuda, reference):
        pool.kv.view(torch.uint8).fill_(0xAB)  # poison: every byte must be written
    n = 7 * spec.page_size + 3  # a partly filled last page
    num = spec.pages_for_tokens(n)

    def allocate(count):
        pages_c, pages_r = cuda.allocate(count), reference.allocate(count)
        assert (pages_c == pages_r).all()  # the same allocator state: the same page ids
        return pages_c[::-1].copy()  # out of order, so the kernels' indexing is what moves the bytes

    def same_bytes():
        torch.cuda.synchronize()
        return torch.equal(cuda.kv.view(torch.uint8), reference.kv.view(torch.uint8))

    pages = allocate(num)
    kv = torch.randn(spec.kv_shape(n), device="cuda").to(spec.dtype.torch)
    cuda.write(cuda.slots(pages, n), kv)
    reference.write(reference.slots(pages, n), kv)
    assert same_bytes()
    staged = cuda.gather(pages)
    assert torch.equal(staged.view(torch.uint8), reference.gather(pages).view(torch.uint8))
    target = allocate(num)
    cuda.scatter(target, staged)
    reference.scatter(target, staged)
    assert same_bytes()
    assert torch.equal(cuda.read_tokens(target, n), kv)
    copies = allocate(num)  # copy-on-write's page copy
    before = cuda.kv.clone()
    cuda.copy_pages(pages, copies)
    reference.copy_pages(pages, copies)
    assert torch.equal(cuda.read_tokens(copies, n), kv)
    assert same_bytes()
    untouched = torch.ones(cuda.num_pages, dtype=torch.bool)
    untouched[torch.from_numpy(copies)] = False
    untouched = untouched.cuda()
    assert torch.equal(cuda.kv[:, :, untouched].view(torch.uint8), before[:, :, untouched].view(torch.uint8))


def test_gather_into_a_device_tensor_makes_no_temporary_copy():
    """A pool made on "cuda" gathers straight into an `out` on cuda:0 (no staged copy in between:
    that doubled the bytes moved and halved `bench kernels`)."""
    spec = SPECS[0]
    pool = PagePool(spec, 64, "cuda")
    pages = pool.allocate(32)
    pool.write(pool.slots(pages, 32 * spec.page_size), torch.randn(spec.kv_shape(32 * spec.page_size),
                                                                   device="cuda").to(spec.dtype.torch))
    out = torch.empty(spec.staging_shape(32), dtype=pool.kv.dtype, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    pool.gather(pages[::-1].copy(), out=out)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < out.numel() * out.element_size() // 2
    assert torch.equal(out[0], pool.gather(pages[-1:])[0])


def test_write_then_offload_at_once_copies_finished_kv():
    spec = SPECS[0]
    pool = PagePool(spec, 64, "cuda")
    transfers = Transfers(pool, PinnedBuffers(pool, 32, 2))
    pages = pool.allocate(32)
    n = 32 * spec.page_size
    for round_ in range(5):
        kv = torch.full(spec.kv_shape(n), float(round_ + 1), device="cuda", dtype=spec.dtype.torch)
        kv = kv @ torch.eye(spec.head_dim, device="cuda", dtype=spec.dtype.torch)  # keep the stream busy
        pool.write(pool.slots(pages, n), kv)
        ticket = transfers.offload(pages)  # no synchronize: the copy stream must wait by itself
        assert torch.all(ticket.wait() == round_ + 1)
        ticket.release()


def test_pages_freed_during_offload_are_not_reallocated_mid_copy():
    spec = SPECS[0]
    pool = PagePool(spec, 64, "cuda")
    transfers = Transfers(pool, PinnedBuffers(pool, 32, 1))
    pages = pool.allocate(32)
    n = 32 * spec.page_size
    kv = torch.ones(spec.kv_shape(n), device="cuda", dtype=spec.dtype.torch)
    pool.write(pool.slots(pages, n), kv)
    ticket = transfers.offload(pages)  # no synchronize: the copy may still be running
    pool.free(pages)
    new = pool.allocate(32)  # without pins, LIFO allocation would hand back exactly `pages`
    assert not set(new.tolist()) & set(pages.tolist())
    pool.write(pool.slots(new, n), kv * 2)  # on the compute stream, concurrent with the copy
    assert torch.all(ticket.wait() == 1)
    ticket.release()
    assert pool.num_free == 32 and pool.allocator.num_pending == 0
    pool.check_integrity()


def test_layer_by_layer_load_back():
    spec = SPECS[1]
    pool = PagePool(spec, 16, "cuda")
    transfers = Transfers(pool, PinnedBuffers(pool, 8, 1))
    pages = pool.allocate(8)
    kv = torch.randn(spec.kv_shape(8 * spec.page_size), device="cuda").to(spec.dtype.torch)
    pool.write(pool.slots(pages, 8 * spec.page_size), kv)
    host = transfers.offload(pages).wait().clone().pin_memory()
    targets = pool.allocate(8)
    load = transfers.load(host, targets)
    for layer in range(spec.num_layers):
        load.wait_layer(layer)
        assert torch.equal(pool.kv[:, layer, torch.as_tensor(targets, device="cuda")],
                           pool.kv[:, layer, torch.as_tensor(pages, device="cuda")])
    load.synchronize()
    pool.free(targets)  # synchronize() unpinned them: free at once
    assert pool.allocator.num_pending == 0
    pool.check_integrity()


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[1]], ids=lambda s: s.model_id)
def test_host_copier_moves_pinned_rows_into_pages_and_back_on_the_copy_stream(spec):
    """The CUDA path of `HostCopier` (DMA per run of rows into a chunk buffer, scatter kernel;
    gather kernel, DMA per run back) gives the bytes the CPU path gives, across chunk boundaries,
    and writes no page or row outside its targets."""
    from tiered_cache.device.host_copy import HostCopier

    pool = PagePool(spec, 40, "cuda")
    pool.kv.view(torch.uint8).fill_(0xAB)
    copier = HostCopier(pool, chunk_bytes=5 * spec.bytes_per_page)
    slab = torch.randn(spec.staging_shape(24)).to(spec.dtype.torch).pin_memory()
    rows = [3, 4, 5, 9, 10, 0, 1, 2, 20, 19, 18, 7]
    pages = pool.allocate(len(rows) + 4)[2:2 + len(rows)][::-1].copy()
    before = pool.kv.clone()
    copier.to_pool(slab, rows, pages)
    for row, page in zip(rows, pages, strict=True):
        assert torch.equal(pool.gather([page])[0].cpu(), slab[row])
    others = torch.ones(pool.num_pages, dtype=torch.bool)
    others[torch.from_numpy(pages)] = False
    others = others.cuda()
    assert torch.equal(pool.kv[:, :, others].view(torch.uint8), before[:, :, others].view(torch.uint8))
    back = torch.zeros_like(slab).pin_memory()
    dest = [(r * 7) % 24 for r in rows]
    copier.from_pool(pages, back, dest)
    for src, dst in zip(rows, dest, strict=True):
        assert torch.equal(back[dst], slab[src])
    assert not back[[r for r in range(24) if r not in dest]].any()


def test_a_page_demoted_while_its_load_is_still_queued_is_demoted_whole():
    """Loads and demotions run on two copy streams (PCIe is full duplex): a demotion of pages whose
    load was only queued (`wait=False`, as a host RAM hit returns) still reads them whole, because
    the demotion's stream waits for the loads queued before it; the streams are two."""
    from tiered_cache.device.host_copy import HostCopier

    spec = SPECS[0]
    pool = PagePool(spec, 64, "cuda")
    copier = HostCopier(pool, chunk_bytes=4 * spec.bytes_per_page)
    assert copier._loads.copies.stream != copier._demotions.copies.stream
    slab = torch.randn(spec.staging_shape(48)).to(spec.dtype.torch).pin_memory()
    rows, pages = list(range(48)), pool.allocate(48)
    queued = copier.to_pool(slab, rows, pages, wait=False)
    back = torch.zeros_like(slab).pin_memory()
    copier.from_pool(pages, back, rows)  # queued at once, behind the load only through its event
    assert queued is not None
    queued.wait()
    assert torch.equal(back, slab)


@pytest.mark.parametrize("kind", ["flash", "flash-hnd", "cpu"])
def test_the_vllm_connectors_device_copier_moves_blocks_with_our_kernels(kind):
    """The connector's CUDA path (`DeviceBlocks` with CuPy's launch): pages gathered right after
    the engine's stream wrote the blocks are those bytes; a layer group scattered back writes what
    torch's slices write, and only its blocks."""
    from tests.integrations.test_vllm_block_copy import BS, HEADS, vllm_layers
    from tiered_cache.device import cupy_ops
    from tiered_cache.integrations.vllm.block_copy import DeviceBlocks, block_copier
    from tiered_cache.integrations.vllm.layout import gather_blocks, layout_of, scatter_blocks

    src = [t.cuda() for t in vllm_layers(kind, 1, torch.float16, 128)]
    layout = layout_of(src[0], HEADS, 128)
    copier = block_copier(src, layout, HEADS, 128, BS)
    assert isinstance(copier, DeviceBlocks) and copier.kernels is cupy_ops.launch_blocks
    for t in src:
        t.add_(1)  # queued on the engine's stream just before the gather
    pages, ready = copier.gather([6, 0, 9, 2])
    ready()
    assert pages.is_pinned() and torch.equal(pages, gather_blocks(src, [6, 0, 9, 2], layout, 128))

    staged = [t.cuda() for t in vllm_layers(kind, 2, torch.float16, 128)]
    reference = [t.clone() for t in staged]
    group = [page[1:3] for page in pages]
    block_copier(staged, layout, HEADS, 128, BS).scatter([3, 8, 1, 4], group, range(1, 3))
    scatter_blocks(reference[1:3], [3, 8, 1, 4], group, layout, 128)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(staged, reference, strict=True))
