"""Offload and layer-by-layer load-back: the CPU path here (synchronous, same API); the CUDA
stream and event path in test_kernels_gpu.py."""

import pytest
import torch

from tiered_cache.device.pool import PagePool
from tiered_cache.device.transfers import NoFreeBufferError, PinnedBuffers, Transfers
from tiered_cache.errors import PageStateError, PoolExhaustedError
from tiered_cache.model.spec import KVSpec, Layout


@pytest.mark.parametrize("layout", list(Layout))
def test_offload_then_load_back_round_trips(layout):
    spec = KVSpec("offload", 3, 2, 16, page_size=4, layout=layout)
    pool = PagePool(spec, 12)
    pages = pool.allocate(5)
    kv = torch.randn(spec.kv_shape(20)).half()
    pool.write(pool.slots(pages, 20), kv)
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
    pool.write(pool.slots(pages, 4), torch.randn(spec.kv_shape(4)).half())
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


def test_offloaded_pages_are_not_reused_until_the_ticket_is_released():
    spec = KVSpec("offload", 2, 1, 8, page_size=2)
    pool = PagePool(spec, 6)
    pages = pool.allocate(3)
    kv = torch.randn(spec.kv_shape(6)).half()
    pool.write(pool.slots(pages, 6), kv)
    expected = pool.gather(pages)
    transfers = Transfers(pool, PinnedBuffers(pool, pages_per_buffer=4, num_buffers=1))
    ticket = transfers.offload(pages)
    pool.free(pages)  # the caller is done with them; the copy may not be
    assert pool.num_free == 3 and pool.allocator.num_pending == 3
    new = pool.allocate(3)  # everything allocatable: none of the offloaded pages
    assert not set(new.tolist()) & set(pages.tolist())
    with pytest.raises(PoolExhaustedError):
        pool.allocate(1)
    pool.write(pool.slots(new, 6), torch.full(spec.kv_shape(6), 7.0).half())  # a new request writes
    pool.check_integrity()
    assert torch.equal(ticket.wait(), expected)  # the bytes the pages had at offload()
    assert pool.num_free == 3 and pool.allocator.num_pending == 0
    assert sorted(pool.allocate(3).tolist()) == sorted(pages.tolist())
    ticket.release()
    pool.check_integrity()


def test_release_without_wait_unpins_and_a_failed_offload_pins_nothing():
    spec = KVSpec("offload", 1, 1, 8, page_size=2)
    pool = PagePool(spec, 4)
    pages = pool.allocate(2)
    transfers = Transfers(pool, PinnedBuffers(pool, pages_per_buffer=2, num_buffers=1))
    ticket = transfers.offload(pages)
    pool.free(pages[:1])
    assert pool.num_free == 2
    with pytest.raises(NoFreeBufferError):
        transfers.offload(pages[1:])  # the one buffer is held; page 1 must not stay pinned
    ticket.release()
    with pytest.raises(PageStateError, match="appears twice"):
        transfers.offload([pages[1], pages[1]])  # gather refuses repeats after pinning
    assert pool.num_free == 3 and pool.allocator.num_pending == 0
    pool.free(pages[1:])  # no pin left on page 1: it is free at once
    assert pool.num_free == 4 and transfers.buffers.free == [0]
    pool.check_integrity()


def test_loaded_pages_stay_pinned_until_synchronize():
    spec = KVSpec("offload", 2, 1, 8, page_size=2)
    pool = PagePool(spec, 4)
    transfers = Transfers(pool, PinnedBuffers(pool, 2, 1))
    host = torch.randn(spec.staging_shape(2)).half()
    targets = pool.allocate(2)
    load = transfers.load(host, targets)
    pool.free(targets)
    assert pool.num_free == 2 and pool.allocator.num_pending == 2
    load.synchronize()
    assert pool.num_free == 4 and pool.allocator.num_pending == 0
    load.synchronize()  # a second call unpins nothing twice
    pool.check_integrity()
    with pytest.raises(PageStateError, match="are free"):
        transfers.load(host, targets)
