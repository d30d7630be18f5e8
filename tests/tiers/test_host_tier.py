import threading

import pytest
import torch
from tier_helpers import SPEC, keys_for, pages_for

from tiered_cache.errors import KVShapeError
from tiered_cache.tiers.host import HostTier


def test_round_trip_and_leading_run():
    host = HostTier(SPEC, 8 * SPEC.bytes_per_page)
    keys, pages = keys_for(5), pages_for(5)
    assert host.put(keys[:3], pages[:3]) == 3
    assert host.contains_prefix(keys) == 3
    n, got = host.get(keys)
    assert n == 3 and torch.equal(got, pages[:3])
    assert host.put(keys, pages) == 2  # the first three were already held
    out = torch.empty(SPEC.staging_shape(6), dtype=SPEC.dtype.torch)
    n, got = host.get(keys, out=out)
    assert n == 5 and got.data_ptr() == out.data_ptr() and torch.equal(got, pages)
    s = host.stats()
    assert (s.pages, s.used_bytes, s.hits, s.misses) == (5, 5 * SPEC.bytes_per_page, 8, 2)


def test_lru_eviction_hands_the_right_pages_to_the_callback():
    evicted = {}
    host = HostTier(SPEC, 4 * SPEC.bytes_per_page,
                    on_evict=lambda ks, ps: evicted.update(zip(ks, ps.clone(), strict=True)))
    keys, pages = keys_for(6), pages_for(6)
    host.put(keys[:4], pages[:4])
    host.get(keys[:1])  # key 0 is now the most recent: 1 and 2 go first
    host.put(keys[4:6], pages[4:6])
    assert set(evicted) == {keys[1], keys[2]}
    assert torch.equal(evicted[keys[1]], pages[1]) and torch.equal(evicted[keys[2]], pages[2])
    assert host.contains_prefix([keys[0]]) == 1 and host.stats().evictions == 2
    n, got = host.get(keys[4:6])
    assert n == 2 and torch.equal(got, pages[4:6])


def test_a_batch_larger_than_the_slab_keeps_its_head_and_demotes_the_rest():
    evicted = []
    host = HostTier(SPEC, 3 * SPEC.bytes_per_page, on_evict=lambda ks, ps: evicted.extend(ks))
    keys, pages = keys_for(5), pages_for(5)
    assert host.put(keys, pages) == 3
    assert host.contains_prefix(keys) == 3 and evicted == keys[3:]


def test_delete_and_bad_input():
    host = HostTier(SPEC, 4 * SPEC.bytes_per_page)
    keys, pages = keys_for(2), pages_for(2)
    host.put(keys, pages)
    host.delete([*keys[:1], b"x" * 32])
    assert host.contains_prefix(keys) == 0 and host.contains_prefix(keys[1:]) == 1
    with pytest.raises(KVShapeError, match="pages must be"):
        host.put(keys, pages.float())
    with pytest.raises(KVShapeError, match="pages must be"):
        host.put(keys, pages[:1])
    with pytest.raises(ValueError, match="holds no page"):
        HostTier(SPEC, 100)


def test_a_large_unpinned_slab_is_pretouched_in_the_background():
    spec = SPEC.with_options(page_size=64)  # 16 KiB pages
    host = HostTier(spec, "64MiB", pin=False)
    assert isinstance(host.pretouch, threading.Thread) and host.pretouch.daemon  # not zero-filled
    keys, pages = keys_for(40, spec), pages_for(40, spec)
    assert host.put(keys, pages) == 40  # most likely while the thread still runs
    host.pretouch.join()
    n, got = host.get(keys)
    assert n == 40 and torch.equal(got, pages)
    assert HostTier(SPEC, 8 * SPEC.bytes_per_page, pin=False).pretouch is None  # small: zero-filled at once


def test_where_the_pretouch_writes_zeros_put_waits_for_it(monkeypatch):
    from tiered_cache.device import memory

    monkeypatch.setattr(memory, "_populate", lambda address, length: False)  # e.g. not Linux
    spec = SPEC.with_options(page_size=64)
    host = HostTier(spec, "32MiB", pin=False)
    assert not host.pretouch.preserves_bytes
    keys, pages = keys_for(3, spec), pages_for(3, spec)
    host.put(keys, pages)
    assert not host.pretouch.is_alive()
    assert torch.equal(host.get(keys)[1], pages)


class _GatedCopy:
    """A real copy out of slab rows, run by a thread that starts only when `gate` opens: what a
    device copy still queued behind other work looks like to the host tier (`reading`)."""

    def __init__(self, host, slots, gate):
        self.out = torch.empty(SPEC.staging_shape(len(slots)), dtype=SPEC.dtype.torch)

        def copy():
            gate.wait()
            self.out.copy_(host.slab[torch.tensor(slots)])

        self._thread = threading.Thread(target=copy, daemon=True)
        self._thread.start()

    def finished(self):
        return not self._thread.is_alive()

    def wait(self):
        self._thread.join()


def test_a_write_into_the_slab_waits_for_a_copy_out_of_it_still_in_flight():
    """A load's copy out of host RAM may still run when its slots are evicted and reused (on CUDA
    the load returns once the DMA is queued): the write must wait for it, or the copy reads the
    new page's bytes as the old one's KV."""
    host = HostTier(SPEC, 2 * SPEC.bytes_per_page)
    keys, pages = keys_for(4), pages_for(4)
    host.put(keys[:2], pages[:2])
    gate = threading.Event()
    copy = _GatedCopy(host, host.leading_rows(keys[:2]), gate)
    host.reading(copy)
    writer = threading.Thread(target=host.put, args=(keys[2:], pages[2:]), daemon=True)
    writer.start()  # evicts both pages and reuses their slots
    writer.join(timeout=0.5)
    assert writer.is_alive(), "the write did not wait for the copy out of the slab"
    gate.set()
    writer.join(timeout=30)
    assert not writer.is_alive()
    assert torch.equal(copy.out, pages[:2])
    assert host.get(keys[2:])[0] == 2 and host.contains_prefix(keys[:2]) == 0
    host.reading(copy)  # a finished copy costs a later write nothing
    host.put(keys[:1], pages[:1])
