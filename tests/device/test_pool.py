import threading

import numpy as np
import pytest
import torch

from tiered_cache.device.pool import PagePool
from tiered_cache.device.pool_ops import TorchPageOps
from tiered_cache.errors import KVShapeError, PageStateError, PoolExhaustedError
from tiered_cache.model.presets import preset_spec
from tiered_cache.model.spec import DType, KVSpec, Layout

SPECS = [
    KVSpec("tiny", 2, 1, 4, page_size=1),
    KVSpec("odd", 3, 3, 24, page_size=5),
    preset_spec("smollm2-135m", page_size=16),
    KVSpec("gqa", 4, 2, 128, page_size=64),
]


def random_kv(spec, n, gen):
    return torch.randn(spec.kv_shape(n), generator=gen).to(spec.dtype.torch)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("dtype", [DType.FP16, DType.BF16, DType.FP32])
@pytest.mark.parametrize("base", SPECS, ids=lambda s: s.model_id)
def test_store_gather_scatter_round_trip(base, dtype, layout):
    spec = base.with_options(dtype=dtype, layout=layout)
    gen = torch.Generator().manual_seed(spec.page_size * 31 + spec.head_dim)
    pool = PagePool(spec, num_pages=12)
    n_tokens = spec.page_size * 3 + max(1, spec.page_size // 2)  # ends off a page boundary
    pages = pool.allocate(spec.pages_for_tokens(n_tokens))
    pool.allocator.free(pool.allocate(1))  # disturb the free list so pages are not 0..n
    kv = random_kv(spec, n_tokens, gen)
    pool.write(pool.slots(pages, n_tokens), kv)
    assert torch.equal(pool.read_tokens(pages, n_tokens), kv)

    staging = pool.gather(pages)
    assert staging.shape == spec.staging_shape(len(pages)) and staging.is_contiguous()
    # Page-first staging: page p holds tokens p*ps .. (p+1)*ps of every layer, K then V.
    first = staging[0]
    expected = kv[:, :, :spec.page_size]
    if layout is Layout.HND:
        expected = expected.transpose(2, 3)
    assert torch.equal(first, expected)

    targets = pool.allocate(len(pages))
    pool.scatter(targets[::-1].copy(), staging.flip(0).contiguous())  # scatter in another order
    assert torch.equal(pool.read_tokens(targets, n_tokens), kv)
    # Bytes: the last page's unwritten tail is whatever the pool held (possibly NaN patterns).
    assert torch.equal(pool.gather(targets).view(torch.uint8), staging.view(torch.uint8))
    pool.check_integrity()


def test_store_writes_only_its_slots_in_shuffled_order():
    spec = KVSpec("m", 2, 2, 8, page_size=4)
    pool = PagePool(spec, 6)
    pages = pool.allocate(3)
    slots = pool.slots(pages, 12)
    order = np.random.default_rng(0).permutation(12)
    kv = torch.randn(spec.kv_shape(12)).half()
    before = pool.kv.clone()
    pool.write(slots[order], kv[:, :, order])
    assert torch.equal(pool.read_tokens(pages, 12), kv)
    untouched = torch.from_numpy(np.setdiff1d(np.arange(6), pages))
    assert torch.equal(pool.kv[:, :, untouched].view(torch.uint8), before[:, :, untouched].view(torch.uint8))


def test_gather_into_a_given_buffer():
    spec = KVSpec("m", 2, 1, 8, page_size=2)
    pool = PagePool(spec, 4)
    pages = pool.allocate(2)
    pool.write(pool.slots(pages, 4), torch.randn(spec.kv_shape(4)).half())
    out = torch.full(spec.staging_shape(2), float("nan"), dtype=torch.float16)
    assert pool.gather(pages, out=out) is out
    assert not torch.isnan(out).any()
    assert torch.equal(out, pool.gather(pages))


def test_errors_are_clear_and_change_nothing():
    spec = KVSpec("m", 2, 2, 8, page_size=4)
    pool = PagePool(spec, 4)
    pages = pool.allocate(2)
    kv = torch.randn(spec.kv_shape(8)).half()
    before = pool.kv.clone()
    with pytest.raises(KVShapeError, match=r"shape \(2, 2, 7, 2, 8\), expected \(2, 2, 8, 2, 8\)"):
        pool.write(pool.slots(pages, 8), kv[:, :, :7])
    with pytest.raises(KVShapeError, match=r"dtype torch\.float32, expected torch\.float16"):
        pool.write(pool.slots(pages, 8), kv.float())
    with pytest.raises(KVShapeError, match=r"must be a torch\.Tensor"):
        pool.write(pool.slots(pages, 8), kv.numpy())
    with pytest.raises(PageStateError, match="same slot twice"):
        pool.write([0, 0], kv[:, :, :2])
    with pytest.raises(PageStateError, match="out of range"):
        pool.write([99], kv[:, :, :1])
    free_page = np.setdiff1d(np.arange(4), pages)[0]
    with pytest.raises(PageStateError, match="are free; allocate them"):
        pool.write([free_page * 4], kv[:, :, :1])
    with pytest.raises(PageStateError, match="are free"):
        pool.gather([free_page])
    with pytest.raises(PageStateError, match="appears twice"):
        pool.gather([pages[0], pages[0]])
    with pytest.raises(KVShapeError, match="staging has shape"):
        pool.scatter(pages, torch.zeros(spec.staging_shape(1), dtype=torch.float16))
    with pytest.raises(PageStateError, match="do not fit"):
        pool.slots(pages, 9)
    assert torch.equal(pool.kv, before)  # none of the failed calls wrote anything
    with pytest.raises(PoolExhaustedError, match="asked for 3 pages, 2 of 4 free"):
        pool.allocate(3)
    assert pool.num_free == 2
    pool.free(pages)
    with pytest.raises(PageStateError, match="double free"):
        pool.free(pages[:1])
    pool.check_integrity()


def test_with_capacity_and_usage():
    spec = preset_spec("smollm2-135m")
    pool = PagePool.with_capacity(spec, "4MiB")
    assert pool.num_pages == 4 * 2**20 // spec.bytes_per_page
    pool.allocate(3)
    usage = pool.usage()
    assert (usage.used_pages, usage.free_pages) == (3, pool.num_pages - 3)
    assert usage.used_bytes == 3 * spec.bytes_per_page
    with pytest.raises(ValueError, match="holds no page"):
        PagePool.with_capacity(spec, "1KiB")
    with pytest.raises(ValueError, match="unknown page ops 'cuda-magic'"):
        PagePool(spec, 2, ops="cuda-magic")


def test_layer_views_are_views_of_the_pool():
    spec = KVSpec("m", 3, 2, 8, page_size=4)
    pool = PagePool(spec, 5)
    pages = pool.allocate(1)
    kv = torch.randn(spec.kv_shape(4)).half()
    pool.write(pool.slots(pages, 4), kv)
    k_layer1 = pool.kv[0, 1]
    assert k_layer1.data_ptr() == pool.kv[0, 1].data_ptr() and k_layer1.shape == (5, 4, 2, 8)
    assert torch.equal(k_layer1[pages[0]], kv[1, 0])


# --- the fast token copies against the reference (TorchPageOps.store, indexed reads) ---------------
FAST_SPECS = [KVSpec("fast", 3, 2, 8, page_size=4), KVSpec("p1", 2, 3, 4, page_size=1),
              KVSpec("bf16", 2, 2, 16, DType.BF16, page_size=8)]
PAGE_ORDERS = {  # name -> pages, in the order tokens fill them
    "consecutive": [3, 4, 5, 6, 7],
    "a few runs": [9, 10, 2, 3, 4, 20, 0],
    "scattered": list(range(46, 0, -2)),  # 23 runs of one page: more than the run copies take
}


class CountingTorchOps(TorchPageOps):
    """The reference ops, counting calls: the fast path must not reach them."""

    def __init__(self):
        self.writes = 0

    def write(self, *args):
        self.writes += 1
        super().write(*args)


def poisoned_pools(spec, num_pages=48, seed=0):
    """Two pools with the same random bytes everywhere: any byte left unwritten shows."""
    fast, reference = PagePool(spec, num_pages), PagePool(spec, num_pages)
    raw = torch.randint(0, 256, (fast.kv.numel() * fast.kv.element_size(),), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    for pool in (fast, reference):
        pool.kv.view(torch.uint8).view(-1).copy_(raw)
        pool.allocate(num_pages)
    fast.ops = CountingTorchOps()
    return fast, reference


def reference_read(pool, pages, n):
    """read_tokens as it was: one advanced index over every token slot."""
    slots = torch.from_numpy(pool.slots(pages, n))
    p, o = slots // pool.spec.page_size, slots % pool.spec.page_size
    if pool.spec.layout is Layout.NHD:
        return pool.kv[:, :, p, o].transpose(0, 1).contiguous()
    return pool.kv[:, :, p, :, o].permute(2, 1, 0, 3, 4).contiguous()


def same_bytes(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("order", list(PAGE_ORDERS))
@pytest.mark.parametrize("spec", FAST_SPECS, ids=lambda s: s.model_id)
@pytest.mark.parametrize("tail", [0, 1, -1], ids=["whole pages", "one token over", "one token short"])
def test_fast_store_and_read_match_the_reference_bytes(spec, order, layout, tail):
    spec = spec.with_options(layout=layout)
    pages = np.array(PAGE_ORDERS[order])
    n = len(pages) * spec.page_size if tail == 0 else (len(pages) - 1) * spec.page_size + tail
    fast, reference = poisoned_pools(spec)
    kv = torch.randn(spec.kv_shape(n), generator=torch.Generator().manual_seed(n)).to(spec.dtype.torch)
    slots = fast.slots(pages, n)
    fast.write(slots, kv)
    TorchPageOps().write(reference.kv, layout, spec.page_size, torch.from_numpy(slots), kv)
    assert fast.ops.writes == 0  # slots filling pages in order take the fast path
    assert same_bytes(fast.kv, reference.kv)
    assert same_bytes(fast.read_tokens(pages, n), reference_read(reference, pages, n))
    assert same_bytes(fast.read_tokens(pages, n), kv)


@pytest.mark.parametrize("layout", list(Layout))
def test_no_tokens_and_arbitrary_slots(layout):
    spec = KVSpec("m", 2, 2, 8, page_size=4, layout=layout)
    fast, reference = poisoned_pools(spec, num_pages=8)
    fast.write([], torch.empty(spec.kv_shape(0), dtype=torch.float16))
    assert same_bytes(fast.kv, reference.kv)
    assert fast.read_tokens([1, 2], 0).shape == spec.kv_shape(0)
    # Offsets not from 0, a page's tokens out of order, a page left half-written mid-run: the
    # reference path (ops.store) writes them.
    for slots in ([5, 6, 7, 8], [4, 5, 7, 6], [4, 5, 8, 9, 10, 11], [13]):
        kv = torch.randn(spec.kv_shape(len(slots))).half()
        calls = fast.ops.writes
        fast.write(slots, kv)
        TorchPageOps().write(reference.kv, layout, spec.page_size, torch.tensor(slots), kv)
        assert fast.ops.writes == calls + 1 and same_bytes(fast.kv, reference.kv)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("order", list(PAGE_ORDERS))
def test_read_tokens_into_a_given_buffer(layout, order):
    spec = KVSpec("m", 2, 2, 8, page_size=4, layout=layout)
    pool, _ = poisoned_pools(spec)
    pages = PAGE_ORDERS[order]
    n = len(pages) * 4 - 2
    kv = torch.randn(spec.kv_shape(n)).half()
    pool.write(pool.slots(pages, n), kv)
    out = torch.full(spec.kv_shape(n), float("nan"), dtype=torch.float16)
    assert pool.read_tokens(pages, n, out=out) is out and torch.equal(out, kv)
    # Any strides: here K/V outermost, seen through a transpose.
    strided = torch.full((2, *spec.kv_shape(n)[:1], *spec.kv_shape(n)[2:]), float("nan"), dtype=torch.float16)
    assert torch.equal(pool.read_tokens(pages, n, out=strided.transpose(0, 1)), kv)
    with pytest.raises(KVShapeError, match="out has shape"):
        pool.read_tokens(pages, n, out=out[:, :, 1:])
    with pytest.raises(KVShapeError, match="out has dtype"):
        pool.read_tokens(pages, n, out=out.float())
    with pytest.raises(PageStateError, match="do not fit"):
        pool.read_tokens(pages, len(pages) * 4 + 1)


def test_sparse_and_meta_tensors_are_refused_before_anything_is_written():
    spec = KVSpec("m", 2, 2, 8, page_size=4)
    pool = PagePool(spec, 4)
    pages = pool.allocate(2)
    before = pool.kv.clone()
    kv = torch.randn(spec.kv_shape(8)).half()
    with pytest.raises(KVShapeError, match=r"kv has layout torch\.sparse_coo, expected a dense"):
        pool.write(pool.slots(pages, 8), kv.to_sparse())
    with pytest.raises(KVShapeError, match="kv is on the meta device"):
        pool.write(pool.slots(pages, 8), kv.to("meta"))
    with pytest.raises(KVShapeError, match="out is on the meta device"):
        pool.read_tokens(pages, 8, out=torch.empty(spec.kv_shape(8), dtype=torch.float16, device="meta"))
    with pytest.raises(KVShapeError, match="staging has layout"):
        pool.scatter(pages, torch.zeros(spec.staging_shape(2), dtype=torch.float16).to_sparse())
    assert torch.equal(pool.kv, before)


def test_a_large_pool_is_pretouched_in_the_background_and_keeps_what_is_written_meanwhile():
    spec = preset_spec("smollm2-135m", page_size=16)
    pool = PagePool.with_capacity(spec, "512MiB")
    assert isinstance(pool.pretouch, threading.Thread) and pool.pretouch.daemon  # not zero-filled
    pages = pool.allocate(4)
    kv = torch.randn(spec.kv_shape(60)).half()
    pool.write(pool.slots(pages, 60), kv)  # most likely while the thread still runs
    pool.pretouch.join()
    assert torch.equal(pool.read_tokens(pages, 60), kv)
    more = pool.allocate(pool.num_free)[-3:]
    pool.write(pool.slots(more, 48), kv[:, :, :48])
    assert torch.equal(pool.read_tokens(more, 48), kv[:, :, :48])
    assert PagePool(spec, 2).pretouch is None  # a small pool is zero-filled at once


def test_where_the_pretouch_writes_zeros_allocate_waits_for_it(monkeypatch):
    from tiered_cache.device import memory

    monkeypatch.setattr(memory, "_populate", lambda address, length: False)  # e.g. not Linux
    spec = preset_spec("smollm2-135m", page_size=16)
    pool = PagePool.with_capacity(spec, "64MiB")
    assert not pool.pretouch.preserves_bytes
    pages = pool.allocate(2)
    assert not pool.pretouch.is_alive()  # its zeros are written before anyone may write a page
    kv = torch.randn(spec.kv_shape(32)).half()
    pool.write(pool.slots(pages, 32), kv)
    assert torch.equal(pool.read_tokens(pages, 32), kv)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("order", list(PAGE_ORDERS))
@pytest.mark.parametrize("spec", FAST_SPECS, ids=lambda s: s.model_id)
def test_page_run_gather_and_scatter_match_the_reference_ops(spec, order, layout):
    spec = spec.with_options(layout=layout)
    pages = np.array(PAGE_ORDERS[order])
    fast, reference = poisoned_pools(spec, seed=3)
    staging = torch.randn(spec.staging_shape(len(pages)), generator=torch.Generator().manual_seed(5))
    staging = staging.to(spec.dtype.torch)
    fast.scatter(pages, staging)
    TorchPageOps().scatter(reference.kv, torch.from_numpy(pages), staging)
    assert same_bytes(fast.kv, reference.kv)
    expected = torch.empty_like(staging)
    TorchPageOps().gather(reference.kv, torch.from_numpy(pages), expected)
    assert same_bytes(fast.gather(pages), expected) and same_bytes(expected, staging)


@pytest.mark.parametrize("pages, rows", [
    ([3, 4, 5, 6], [10, 11, 12, 13]),  # one run on both sides: views only
    ([3, 4, 9, 10, 0], [7, 8, 2, 3, 15]),  # a few runs
    (list(range(19, -1, -1)), list(range(20))),  # every page its own run: the gathered fallback
])
def test_scatter_rows_copies_source_rows_into_pages(pages, rows):
    spec = KVSpec("rows", 2, 2, 8, dtype=DType.FP32, page_size=4)
    pool = PagePool(spec, 20)
    source = torch.randn(spec.staging_shape(16 if max(rows) < 16 else 20), generator=torch.Generator().manual_seed(1))
    pool.allocate(20)
    pool.scatter_rows(np.array(pages), source, np.array(rows))
    assert torch.equal(pool.gather(np.array(pages)), source[torch.tensor(rows)])
    with pytest.raises(PageStateError):
        pool.scatter_rows(np.array(pages[:2]), source, np.array(rows[:1]))


def test_a_pool_on_a_device_that_is_not_here_is_refused_by_name():
    spec = KVSpec("where", 1, 1, 8, page_size=2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"'cuda'.*sees no CUDA device"):
            PagePool(spec, 4, "cuda")
    else:
        with pytest.raises(ValueError, match=r"'cuda:99'.*CUDA device\(s\) here"):
            PagePool(spec, 4, "cuda:99")
    with pytest.raises(ValueError, match="'gpu0' is not a torch device"):
        PagePool(spec, 4, "gpu0")
    with pytest.raises(ValueError, match=r"'meta'.*lives on 'cpu' or 'cuda"):
        PagePool(spec, 4, "meta")
    assert PagePool(spec, 4, "cpu").device == torch.device("cpu")


class _KernelsThatDoNotCompile(TorchPageOps):
    """Page ops picked for a CUDA pool whose kernels fail to compile (no NVRTC, a CuPy built for
    another CUDA): a fault this machine cannot cause, so the ops say it themselves."""

    name = "uncompiled"

    def warm_up(self) -> None:
        raise RuntimeError("nvrtc: library not found")


def test_kernels_that_do_not_compile_fall_back_to_torch_ops_unless_named(monkeypatch, caplog):
    import tiered_cache.device.pool as pool_module
    import tiered_cache.device.pool_ops as pool_ops
    from tiered_cache.device.pool_ops import select_ops

    spec = SPECS[0]
    monkeypatch.setitem(pool_ops._REGISTRY, "uncompiled", _KernelsThatDoNotCompile())
    monkeypatch.setattr(pool_module, "select_ops",
                        lambda device, name=None: select_ops(device, name or "uncompiled"))
    with caplog.at_level("WARNING", logger="tiered_cache.device.pool"):
        pool = PagePool(spec, 4)
    assert pool.ops.name == "torch" and "did not compile" in caplog.text
    kv = torch.randn(spec.kv_shape(spec.page_size)).to(spec.dtype.torch)
    pages = pool.allocate(1)
    pool.write(pool.slots(pages, spec.page_size), kv)
    assert torch.equal(pool.read_tokens(pages, spec.page_size), kv)  # the pool works on torch's ops
    with pytest.raises(RuntimeError, match="nvrtc"):
        PagePool(spec, 4, ops="uncompiled")  # named: no silent substitute
