"""Same-host Get through the store server's shared-memory ring (service/shm_ring.py), against real
server processes: the same bytes as over gRPC, a ring wrapped over a page costs a second ask (never
wrong bytes), a restarted server is attached again, and clients elsewhere or with the ring off
move bytes."""

from __future__ import annotations

import os

import pytest

from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.service import client as client_module
from tiered_cache.service.client import StoreClient
from tiered_cache.service.config import ServerConfig
from tiered_cache.service.process import StoreProcess
from tiered_cache.service.shm_ring import HEADER, MAX_REMEMBERED, ShmLease, ShmReader, ShmRing
from tiered_cache.tiers.codec import encode_page
from tiered_cache.tiers.remote import RemoteTier

SPEC = KVSpec("shm-test", 4, 2, 64, page_size=64, dtype="fp32")  # 256 KiB pages


def pages(n: int, seed: int = 0) -> list[tuple[bytes, bytes]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    keys = PageKeyer(SPEC, f"shm-{seed}").keys(list(range(SPEC.page_size * n)))
    shape = SPEC.staging_shape(1)[1:]
    return [(k, encode_page(torch.randn(shape, generator=generator), SPEC, k, "raw")) for k in keys]


def shm_pages(address: str) -> int:
    return StoreClient(address).stats().server.shm_pages


def shm_reused(address: str) -> int:
    return StoreClient(address).stats().server.shm_pages_reused


def test_a_same_host_get_comes_through_the_ring_with_the_bytes_put():
    items = pages(12)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk"]) as store:
        tier = RemoteTier([store.address])
        try:
            assert tier.put(items) == len(items)
            for _ in range(3):
                assert tier.get(keys) == [b for _, b in items]
            assert tier.servers[0].client.uses_shm
            assert shm_pages(store.address) == 3 * len(items)
        finally:
            tier.close()


def test_with_the_ring_off_the_same_get_moves_bytes():
    items = pages(4, seed=1)
    with StoreProcess(["--no-disk", "--shm", "0"]) as store:
        tier = RemoteTier([store.address])
        try:
            tier.put(items)
            assert tier.get([k for k, _ in items]) == [b for _, b in items]
            assert not tier.servers[0].client.uses_shm and shm_pages(store.address) == 0
        finally:
            tier.close()


def test_a_ring_wrapped_over_pages_before_they_are_read_costs_a_second_ask_not_wrong_bytes():
    """A 2 MiB ring and one Get of 12 pages of 256 KiB, 11 placed in one batch: the ring wraps over
    the first ones before the client reads them. Those are asked again as bytes."""
    items = pages(12, seed=2)
    with StoreProcess(["--no-disk", "--shm", "2MiB"]) as store:
        client = StoreClient(store.address)
        try:
            client.put(items)
            result = client.get_all([k for k, _ in items])
            assert result.error is None
            got = {r.key: bytes(r.blob) for r in result.blobs}
            assert got == dict(items)
            assert client.uses_shm and client.shm_overruns > 0
        finally:
            client.close()


def test_a_restarted_server_is_attached_again_and_never_read_through_the_old_ring(tmp_path):
    items = pages(6, seed=3)
    keys = [k for k, _ in items]
    store = StoreProcess(["--disk", str(tmp_path)])
    store.start()
    port = store.address.rsplit(":", 1)[1]
    client = StoreClient(store.address)
    try:
        client.put(items)
        assert {r.key: bytes(r.blob) for r in client.get_all(keys).blobs} == dict(items)
        old_segment = client._fetcher.reader.segment
        store.stop()  # flushes RAM to disk: the restarted server has every page
        store = StoreProcess(["--disk", str(tmp_path), "--port", port])
        store.start()
        for _ in range(2):  # the first answer comes as bytes (old segment), then the new ring is used
            result = client.get_all(keys)
            assert result.error is None and {r.key: bytes(r.blob) for r in result.blobs} == dict(items)
        assert client.uses_shm and client._fetcher.reader.segment != old_segment
        assert shm_pages(store.address) == len(items)
    finally:
        client.close()
        store.stop()


def test_a_client_on_another_host_moves_bytes(monkeypatch):
    """Another host cannot be had here: the client is told its host differs (a mock, for that only)."""
    items = pages(3, seed=4)
    monkeypatch.setattr(client_module, "host_identity", lambda: "another-boot/another-host")
    with StoreProcess(["--no-disk"]) as store:
        client = StoreClient(store.address)
        try:
            client.put(items)
            assert {r.key: bytes(r.blob) for r in client.get_all([k for k, _ in items]).blobs} == dict(items)
            assert not client.uses_shm and shm_pages(store.address) == 0
        finally:
            client.close()


def test_the_ring_refuses_what_it_cannot_hold_and_readers_see_only_intact_pages():
    ring = ShmRing(2**20)
    try:
        assert ring.place(b"") is None and ring.place(bytes(ring.max_page + 1)) is None
        reader = ShmReader(ring.path, ring.size, ring.segment)
        first = ring.place(b"a" * ring.max_page)
        assert first is not None and reader.read(*first) == b"a" * ring.max_page
        later = [ring.place(bytes([i]) * ring.max_page) for i in range(4)]  # a lap: over `first`
        assert reader.read(*first) is None
        assert reader.read(*later[-1]) == bytes([3]) * ring.max_page
        assert reader.read(later[-1][0] + ring.capacity, 10) is None  # a position not written yet
        with pytest.raises(ValueError, match="not the segment"):
            ShmReader(ring.path, ring.size, os.urandom(16))
        reader.close()
    finally:
        ring.close()
    assert HEADER == 64


def test_a_ring_below_its_minimum_is_refused_by_name():
    with pytest.raises(ValueError, match="shm_bytes"):
        ServerConfig(shm_bytes="64KiB", disk_path="")
    assert ServerConfig(shm_bytes=0, disk_path="").shm_bytes == 0


def test_a_page_already_in_the_ring_is_sent_again_by_position_until_half_a_lap_passes():
    ring = ShmRing(2**20)
    try:
        reader = ShmReader(ring.path, ring.size, ring.segment)
        page = bytes(range(256)) * 800  # 200 KiB: about a fifth of the ring
        first = ring.place(page, b"k" * 32, sent=False)  # as at Put time: not counted as sent
        assert first is not None and ring.pages == 0
        assert ring.place(page, b"k" * 32) == first and (ring.pages, ring.reused) == (1, 1)
        assert ring.place(page[:-1], b"k" * 32) != first  # another length: never taken for it
        assert ring.place(page, b"j" * 32) != first  # another key: copied
        later = ring.place(page, b"k" * 32)  # `first` is now more than half a lap back: copied again
        assert later is not None and later[0] > first[0] and ring.reused == 1
        assert reader.read(*later) == page
        reader.close()
    finally:
        ring.close()


def test_pages_put_are_in_the_ring_and_a_get_sends_them_without_a_copy():
    items = pages(8, seed=5)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk"]) as store:
        client = StoreClient(store.address)
        try:
            client.put(items)
            assert {r.key: bytes(r.blob) for r in client.get_all(keys).blobs} == dict(items)
            assert shm_pages(store.address) == shm_reused(store.address) == len(items)
        finally:
            client.close()


def test_lent_pages_are_views_of_the_bytes_put_and_the_lease_names_those_written_over():
    """A 2 MiB ring: 4 pages lent, then a Get of 8 others comes round over them. The lease names
    exactly the pages whose views no longer hold their bytes; a copy taken before is intact."""
    items, others = pages(4, seed=6), pages(8, seed=7)
    with StoreProcess(["--no-disk", "--shm", "2MiB"]) as store:
        client = StoreClient(store.address)
        try:
            client.put(items)
            lease = ShmLease()
            result = client.get_all([k for k, _ in items], lease=lease)
            assert result.error is None and len(lease) == len(items)
            assert all(isinstance(r.blob, memoryview) for r in result.blobs)
            copies = {r.key: bytes(r.blob) for r in result.blobs}
            assert copies == dict(items) and lease.lost() == set()
            client.put(others)  # placed at Put time: over the lent pages
            client.get_all([k for k, _ in others])
            lost = lease.lost()
            assert lost and lost <= set(copies)
            for r in result.blobs:
                assert (bytes(r.blob) == copies[r.key]) or r.key in lost  # only lost views changed
            assert any(bytes(r.blob) != copies[r.key] for r in result.blobs)
            assert copies == dict(items)  # copies taken while the lease held are intact
        finally:
            client.close()


def test_a_remote_tier_lends_pages_only_when_asked_and_counts_no_corruption_for_lost_ones():
    items = pages(4, seed=8)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk"]) as store:
        tier = RemoteTier([store.address])
        try:
            tier.put(items)
            assert all(isinstance(b, bytes) for b in tier.get(keys))  # copies by default
            lease = ShmLease()
            lent = tier.get(keys, lease=lease)
            assert all(isinstance(b, memoryview) for b in lent) and len(lease) == len(keys)
            assert [bytes(b) for b in lent] == [b for _, b in items] and not lease.lost()
            assert tier.stats().corrupt == 0
        finally:
            tier.close()


def test_the_ring_remembers_a_bounded_number_of_keys_however_small_the_pages():
    ring = ShmRing(64 << 20)
    try:
        for i in range(MAX_REMEMBERED + 100):
            ring.place(b"x" * 64, i.to_bytes(32, "little"), sent=False)
        assert len(ring._where) == MAX_REMEMBERED
        assert ring.place(b"x" * 64, (MAX_REMEMBERED + 99).to_bytes(32, "little")) is not None
        assert ring.reused == 1  # the newest are the ones kept
    finally:
        ring.close()


def test_a_same_host_lookup_says_where_held_pages_lie_and_the_get_after_it_needs_no_stream():
    items = pages(6, seed=9)
    keys = [k for k, _ in items]
    unknown = pages(1, seed=10)[0][0]
    with StoreProcess(["--no-disk"]) as store:
        tier = RemoteTier([store.address])
        try:
            tier.put(items)
            tier.warm()  # maps the ring, as the vLLM block store does at start
            assert tier.contains([*keys, unknown]) == [True] * len(keys) + [False]
            sent_before = shm_pages(store.address)
            assert tier.get(keys) == [b for _, b in items]  # read where the Lookup said: no Get
            assert tier.pages_from_lookup == len(keys) and shm_pages(store.address) == sent_before
            assert tier.contains_prefix(keys) == len(keys)  # the one-server path remembers them too
            lease = ShmLease()
            lent = tier.get(keys, lease=lease)
            assert all(isinstance(b, memoryview) for b in lent) and len(lease) == len(keys)
            assert [bytes(b) for b in lent] == [b for _, b in items] and not lease.lost()
            assert tier.pages_from_lookup == 2 * len(keys)
            # Taken once: a second get of the same keys streams them (by position, through the ring).
            assert tier.get(keys) == [b for _, b in items]
            assert tier.pages_from_lookup == 2 * len(keys) and shm_pages(store.address) == sent_before + len(keys)
            assert tier.stats().corrupt == 0
        finally:
            tier.close()


def test_a_lookup_ref_the_ring_came_round_over_is_fetched_again_never_read_as_wrong_bytes():
    """A 2 MiB ring: the Lookup names 4 pages' positions, then 8 other pages are put over them.
    The get finds the refs stale and streams the pages instead: the bytes put, no corruption."""
    items, others = pages(4, seed=11), pages(8, seed=12)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk", "--shm", "2MiB"]) as store:
        tier = RemoteTier([store.address])
        try:
            tier.put(items)
            tier.warm()
            assert all(tier.contains(keys))
            tier.put(others)  # placed in the ring at Put time: a lap over the looked-up pages
            assert tier.get(keys) == [b for _, b in items]
            assert tier.pages_from_lookup == 0  # every ref was stale: all streamed
            lease = ShmLease()
            assert all(tier.contains(keys))
            tier.put(others[::-1])
            lent = tier.get(keys, lease=lease)
            assert all(b is None or bytes(b) == blob or key in lease.lost()
                       for key, b, (_, blob) in zip(keys, lent, items, strict=True))
            assert tier.stats().corrupt == 0
        finally:
            tier.close()


def test_a_lookup_gets_ring_positions_only_for_held_pages_and_the_segment_it_names():
    items = pages(3, seed=13)
    keys = [k for k, _ in items]
    unknown = pages(1, seed=14)[0][0]
    with StoreProcess(["--no-disk"]) as store:
        client = StoreClient(store.address)
        try:
            client.put(items)
            assert client.ring_reader is None  # not mapped before a bulk Get
            client.get_all([])
            reader = client.ring_reader
            assert reader is not None
            reply = client.lookup([keys[0], unknown, *keys[1:]], ring=reader)
            assert list(reply.tiers) != [] and reply.leading == 1
            lengths = list(reply.shm_lengths)
            assert lengths[1] == 0 and all(lengths[i] == len(items[j][1]) for i, j in ((0, 0), (2, 1), (3, 2)))
            assert reader.read(reply.shm_positions[0], lengths[0]) == items[0][1]
            assert not client.lookup(keys).shm_lengths  # no ring named: no positions
            other = ShmRing(2**20)  # another segment (as after the server restarted): none either
            try:
                elsewhere = ShmReader(other.path, other.size, other.segment)
                assert not client.lookup(keys, ring=elsewhere).shm_lengths
                elsewhere.close()
            finally:
                other.close()
        finally:
            client.close()


def test_lookup_refs_are_bounded_taken_once_and_skip_pages_not_in_the_ring():
    from tiered_cache.service.shm_ring import LookupRefs

    ring = ShmRing(2**20)
    try:
        reader = ShmReader(ring.path, ring.size, ring.segment)
        refs = LookupRefs(capacity=3)
        keys = [bytes([i]) * 32 for i in range(5)]
        refs.remember(reader, keys, [10, 20, 30, 40, 50], [1, 0, 1, 1, 1])  # keys[1] not in the ring
        assert len(refs) == 3  # keys 2, 3, 4: the oldest went
        assert refs.take(keys) == {keys[i]: (reader, 10 * (i + 1), 1) for i in (2, 3, 4)}
        assert refs.take(keys) == {} and len(refs) == 0
        reader.close()
    finally:
        ring.close()
