import numpy as np
import pytest
import torch

from tiered_cache.device.pool import PagePool
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
    pool.store(pool.slots(pages, n_tokens), kv)
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
    assert torch.equal(pool.gather(targets), staging)
    pool.check_integrity()


def test_store_writes_only_its_slots_in_shuffled_order():
    spec = KVSpec("m", 2, 2, 8, page_size=4)
    pool = PagePool(spec, 6)
    pages = pool.allocate(3)
    slots = pool.slots(pages, 12)
    order = np.random.default_rng(0).permutation(12)
    kv = torch.randn(spec.kv_shape(12)).half()
    pool.store(slots[order], kv[:, :, order])
    assert torch.equal(pool.read_tokens(pages, 12), kv)
    untouched = np.setdiff1d(np.arange(6), pages)
    assert torch.count_nonzero(pool.kv[:, :, torch.from_numpy(untouched)]) == 0


def test_gather_into_a_given_buffer():
    spec = KVSpec("m", 2, 1, 8, page_size=2)
    pool = PagePool(spec, 4)
    pages = pool.allocate(2)
    pool.store(pool.slots(pages, 4), torch.randn(spec.kv_shape(4)).half())
    out = torch.full(spec.staging_shape(2), float("nan"), dtype=torch.float16)
    assert pool.gather(pages, out=out) is out
    assert not torch.isnan(out).any()
    assert torch.equal(out, pool.gather(pages))


def test_errors_are_clear_and_change_nothing():
    spec = KVSpec("m", 2, 2, 8, page_size=4)
    pool = PagePool(spec, 4)
    pages = pool.allocate(2)
    kv = torch.randn(spec.kv_shape(8)).half()
    with pytest.raises(KVShapeError, match=r"shape \(2, 2, 7, 2, 8\), expected \(2, 2, 8, 2, 8\)"):
        pool.store(pool.slots(pages, 8), kv[:, :, :7])
    with pytest.raises(KVShapeError, match=r"dtype torch\.float32, expected torch\.float16"):
        pool.store(pool.slots(pages, 8), kv.float())
    with pytest.raises(KVShapeError, match=r"must be a torch\.Tensor"):
        pool.store(pool.slots(pages, 8), kv.numpy())
    with pytest.raises(PageStateError, match="same slot twice"):
        pool.store([0, 0], kv[:, :, :2])
    with pytest.raises(PageStateError, match="out of range"):
        pool.store([99], kv[:, :, :1])
    free_page = np.setdiff1d(np.arange(4), pages)[0]
    with pytest.raises(PageStateError, match="are free; allocate them"):
        pool.store([free_page * 4], kv[:, :, :1])
    with pytest.raises(PageStateError, match="are free"):
        pool.gather([free_page])
    with pytest.raises(PageStateError, match="appears twice"):
        pool.gather([pages[0], pages[0]])
    with pytest.raises(KVShapeError, match="staging has shape"):
        pool.scatter(pages, torch.zeros(spec.staging_shape(1), dtype=torch.float16))
    with pytest.raises(PageStateError, match="do not fit"):
        pool.slots(pages, 9)
    assert torch.count_nonzero(pool.kv) == 0  # none of the failed calls wrote anything
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
    pool.store(pool.slots(pages, 4), kv)
    k_layer1 = pool.kv[0, 1]
    assert k_layer1.data_ptr() == pool.kv[0, 1].data_ptr() and k_layer1.shape == (5, 4, 2, 8)
    assert torch.equal(k_layer1[pages[0]], kv[1, 0])
