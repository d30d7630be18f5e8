"""Offload and layer-by-layer load-back: the CPU path here (synchronous, same API); the CUDA
stream and event path in test_kernels_gpu.py."""

import pytest
import torch

from tiered_cache.device.pool import PagePool
from tiered_cache.device.transfers import NoFreeBufferError, PinnedBuffers, Transfers
from tiered_cache.model.spec import KVSpec, Layout


@pytest.mark.parametrize("layout", list(Layout))
def test_offload_then_load_back_round_trips(layout):
    spec = KVSpec("offload", 3, 2, 16, page_size=4, layout=layout)
    pool = PagePool(spec, 12)
    pages = pool.allocate(5)
    kv = torch.randn(spec.kv_shape(20)).half()
    pool.store(pool.slots(pages, 20), kv)
    transfers = Transfers(pool, PinnedBuffers(pool, pages_per_buffer=8, num_buffers=2))
    ticket = transfers.offload(pages)
    host = ticket.wait()
    assert ticket.done() and torch.equal(host, pool.gather(pages))
    targets = pool.allocate(5)
    load = transfers.load(host, targets)
    assert len(load.events) == spec.num_layers
    for layer in range(spec.num_layers):
        load.wait_layer(layer)
    load.synchronize()
    assert torch.equal(pool.read_tokens(targets, 20), kv)
    ticket.release()


def test_buffers_are_not_reused_while_held():
    spec = KVSpec("offload", 1, 1, 8, page_size=2)
    pool = PagePool(spec, 8)
    pages = pool.allocate(2)
    pool.store(pool.slots(pages, 4), torch.randn(spec.kv_shape(4)).half())
    transfers = Transfers(pool, PinnedBuffers(pool, pages_per_buffer=2, num_buffers=2))
    first, second = transfers.offload(pages), transfers.offload(pages[:1])
    assert first.buffer != second.buffer
    with pytest.raises(NoFreeBufferError, match="all 2 pinned buffers are in use"):
        transfers.offload(pages)
    snapshot = first.wait().clone()
    second.release()
    third = transfers.offload(pages[1:])  # reuses the second buffer, never the first
    assert third.buffer == second.buffer and torch.equal(first.wait(), snapshot)
    with pytest.raises(ValueError, match="released twice"):
        second.release()
    with pytest.raises(ValueError, match="do not fit a pinned buffer"):
        first.release() or transfers.offload(pool.allocate(3))


def test_load_rejects_wrong_shapes_and_free_pages():
    spec = KVSpec("offload", 2, 1, 8, page_size=2)
    pool = PagePool(spec, 4)
    transfers = Transfers(pool, PinnedBuffers(pool, 2, 1))
    pages = pool.allocate(2)
    with pytest.raises(ValueError, match="host pages must be"):
        transfers.load(torch.zeros(spec.staging_shape(1), dtype=torch.float16), pages)
    with pytest.raises(Exception, match="are free"):
        transfers.load(torch.zeros(spec.staging_shape(1), dtype=torch.float16), [3])
