"""`HostCopier`: host RAM rows <-> pool pages, byte for byte, in any order of rows and pages, across
chunk boundaries, touching no other page or row. The chunked path is the CUDA path's logic run on
the CPU (a chunk buffer in memory, no streams); tests/device/test_kernels_gpu.py runs it on a GPU."""

import numpy as np
import pytest
import torch

from tiered_cache.device.host_copy import HostCopier
from tiered_cache.device.pool import PagePool
from tiered_cache.model.spec import DType, KVSpec, Layout

SPECS = [KVSpec("nhd", 3, 2, 8, DType.FP16, 4), KVSpec("hnd", 2, 3, 8, DType.BF16, 4, Layout.HND)]


def setup(spec, chunk_pages, chunked):
    pool = PagePool(spec, 32)
    pool.kv.view(torch.uint8).fill_(0xAB)  # poison: a page the copy should not touch keeps it
    copier = HostCopier(pool, chunk_bytes=chunk_pages * spec.bytes_per_page, chunked=chunked)
    slab = torch.randn(spec.staging_shape(24)).to(spec.dtype.torch)
    return pool, copier, slab


# rows and pages with runs, breaks and reversals, more of them than one chunk holds
ROWS = np.array([3, 4, 5, 9, 10, 0, 1, 2, 20, 19, 18, 7], dtype=np.int64)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.model_id)
@pytest.mark.parametrize("chunked,chunk_pages", [(False, 64), (True, 64), (True, 5), (True, 1)])
def test_rows_into_pages_and_back_are_byte_exact_and_touch_nothing_else(spec, chunked, chunk_pages):
    pool, copier, slab = setup(spec, chunk_pages, chunked)
    pages = pool.allocate(len(ROWS) + 4)[2:2 + len(ROWS)][::-1].copy()  # some pages left out, out of order
    before = pool.kv.clone()
    copier.to_pool(slab, ROWS, pages)
    for row, page in zip(ROWS, pages, strict=True):
        assert torch.equal(pool.gather([page])[0], slab[row])
    others = torch.ones(pool.num_pages, dtype=torch.bool)
    others[torch.from_numpy(pages)] = False
    assert torch.equal(pool.kv[:, :, others].view(torch.uint8), before[:, :, others].view(torch.uint8))

    back = torch.zeros_like(slab)
    dest_rows = (ROWS * 7) % 24  # other rows, still distinct
    assert len(set(dest_rows.tolist())) == len(ROWS)
    copier.from_pool(pages, back, dest_rows)
    for src, dst in zip(ROWS, dest_rows, strict=True):
        assert torch.equal(back[dst], slab[src])
    untouched = np.setdiff1d(np.arange(24), dest_rows)
    assert not back[torch.from_numpy(untouched)].any()


def test_nothing_to_copy_is_a_no_op():
    pool, copier, slab = setup(SPECS[0], 4, True)
    before = pool.kv.clone()
    copier.to_pool(slab, [], [])
    copier.from_pool([], slab, [])
    assert torch.equal(pool.kv.view(torch.uint8), before.view(torch.uint8))
