"""Same-host Get from the store server's arena (shm/arena.py), against real server processes: the
same bytes as over gRPC with no copy by the server, a page written over before it was read costs a
second ask (never wrong bytes), a restarted server is attached again, and clients elsewhere or with
shared memory off move bytes."""

from __future__ import annotations

from tiered_cache.client import store_client as client_module
from tiered_cache.client.store_client import StoreClient
from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.server.process import StoreProcess
from tiered_cache.shm.arena import Arena
from tiered_cache.shm.arena_map import ArenaMap, ArenaViews, LookupRefs
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.wire.codec import encode_page

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


def test_a_same_host_get_reads_the_arena_in_place_with_the_bytes_put_and_no_server_copy():
    items = pages(12)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk"]) as store:
        tier = RemoteTier([store.address])
        try:
            assert tier.put(items) == len(items)
            for _ in range(3):
                got = tier.get(keys)
                # On a miss, say what the tier counted: a call that failed, a breaker opened.
                assert got == [b for _, b in items], (
                    f"{sum(g is None for g in got)} misses; call errors {tier.stores.errors}, "
                    f"breaker trips {tier.stores.breaker_trips}, arena lookups {tier.servers[0].client.arena_lookups}")
            assert tier.servers[0].client.uses_shm
            # The first get's Get stream handed refs (no copy); the next two found every page in the
            # arena's published index: no RPC on the request path (the server is told in the
            # background which pages were read, for its eviction; it hands refs, copies nothing).
            assert tier.servers[0].client.arena_lookups == 2
            assert shm_pages(store.address) == shm_reused(store.address) >= len(items)
        finally:
            tier.close()


def test_with_shared_memory_off_the_same_get_moves_bytes():
    items = pages(4, seed=1)
    with StoreProcess(["--no-disk", "--shm", "off"]) as store:
        tier = RemoteTier([store.address])
        try:
            tier.put(items)
            assert tier.get([k for k, _ in items]) == [b for _, b in items]
            assert not tier.servers[0].client.uses_shm and shm_pages(store.address) == 0
        finally:
            tier.close()


def test_pages_written_over_before_they_are_read_cost_a_second_ask_not_wrong_bytes():
    """A 2 MiB arena with no lease, 4 pages handed out by ref in one Get; before the client reads
    them, other pages are put over them (by another client). Those are asked again."""
    items, others = pages(4, seed=2), pages(8, seed=22)
    with StoreProcess(["--no-disk", "--ram", "2MiB", "--arena-lease", "0"]) as store:
        client, other = StoreClient(store.address), StoreClient(store.address)
        try:
            client.put(items)
            client.get_whole([])  # maps the arena
            reply = client.lookup([k for k, _ in items], arena=client.arena_map)
            assert all(reply.shm_lengths)
            other.put(others)  # over the refs just handed out
            arena = client.arena_map
            assert not any(arena.intact(p, n) for p, n in zip(reply.shm_positions, reply.shm_lengths, strict=True))
            result = client.get_whole([k for k, _ in items])  # those still held, read again by ref
            assert result.error is None and result.blobs
            assert all(bytes(r.blob) == dict(items)[r.key] for r in result.blobs)
            assert client.uses_shm
        finally:
            client.close()
            other.close()


def test_a_restarted_server_is_attached_again_and_never_read_through_the_old_arena(tmp_path):
    items = pages(6, seed=3)
    keys = [k for k, _ in items]
    store = StoreProcess(["--disk", str(tmp_path)])
    store.start()
    port = store.address.rsplit(":", 1)[1]
    client = StoreClient(store.address)
    try:
        client.put(items)
        assert {r.key: bytes(r.blob) for r in client.get_whole(keys).blobs} == dict(items)
        old_segment = client._streams.reader.segment
        store.stop()  # flushes RAM to disk: the restarted server has every page
        store = StoreProcess(["--disk", str(tmp_path), "--port", port])
        store.start()
        for _ in range(2):  # the first answer comes as bytes (old arena), then the new one is used
            result = client.get_whole(keys)
            assert result.error is None and {r.key: bytes(r.blob) for r in result.blobs} == dict(items)
        assert client.uses_shm and client._streams.reader.segment != old_segment
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
            assert {r.key: bytes(r.blob) for r in client.get_whole([k for k, _ in items]).blobs} == dict(items)
            assert not client.uses_shm and shm_pages(store.address) == 0
        finally:
            client.close()


def test_pages_put_are_in_the_arena_and_a_get_hands_them_out_without_a_copy():
    items = pages(8, seed=5)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk"]) as store:
        client = StoreClient(store.address)
        try:
            client.put(items)
            assert {r.key: bytes(r.blob) for r in client.get_whole(keys).blobs} == dict(items)
            assert shm_pages(store.address) == shm_reused(store.address) == len(items)
        finally:
            client.close()


def test_lent_pages_are_views_of_the_bytes_put_and_the_views_name_those_written_over():
    """A 2 MiB arena with no lease: 4 pages lent, then 8 others are put over them. The views name
    exactly the pages that no longer hold their bytes; a copy taken before is intact."""
    items, others = pages(4, seed=6), pages(8, seed=7)
    with StoreProcess(["--no-disk", "--ram", "2MiB", "--arena-lease", "0"]) as store:
        client = StoreClient(store.address)
        try:
            client.put(items)
            lease = ArenaViews()
            result = client.get_whole([k for k, _ in items], lease=lease)
            assert result.error is None and len(lease) == len(items)
            assert all(isinstance(r.blob, memoryview) for r in result.blobs)
            copies = {r.key: bytes(r.blob) for r in result.blobs}
            assert copies == dict(items) and lease.lost() == set()
            client.put(others)  # placed at Put time: over the lent pages
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
            lease = ArenaViews()
            lent = tier.get(keys, lease=lease)
            assert all(isinstance(b, memoryview) for b in lent) and len(lease) == len(keys)
            assert [bytes(b) for b in lent] == [b for _, b in items] and not lease.lost()
            assert tier.stats().corrupt == 0
        finally:
            tier.close()


def test_a_same_host_lookup_says_where_held_pages_lie_and_the_get_after_it_needs_no_stream():
    items = pages(6, seed=9)
    keys = [k for k, _ in items]
    unknown = pages(1, seed=10)[0][0]
    with StoreProcess(["--no-disk"]) as store:
        tier = RemoteTier([store.address])
        client = tier.servers[0].client
        try:
            tier.put(items)
            tier.warm()  # maps the arena, as the vLLM block store does at start
            # A key the arena's index lacks: the server is asked, and says where the others lie.
            assert tier.contains([*keys, unknown]) == [True] * len(keys) + [False]
            assert client.arena_lookups == 0
            assert tier.get(keys) == [b for _, b in items]  # read where the Lookup said: no Get
            assert tier.pages_from_lookup == len(keys)
            assert tier.contains_prefix(keys) == len(keys)  # every key in the index: no RPC
            assert client.arena_lookups == 1
            lease = ArenaViews()
            lent = tier.get(keys, lease=lease)
            assert all(isinstance(b, memoryview) for b in lent) and len(lease) == len(keys)
            assert [bytes(b) for b in lent] == [b for _, b in items] and not lease.lost()
            assert tier.pages_from_lookup == 2 * len(keys)
            # Refs are taken once: a second get of the same keys finds them in the index again.
            assert tier.get(keys) == [b for _, b in items]
            assert tier.pages_from_lookup == 3 * len(keys) and client.arena_lookups == 2
            assert tier.stats().corrupt == 0
            with StoreClient(store.address) as other:
                figures = other.stats().server
            assert figures.shm_pages == figures.shm_pages_reused  # whatever the server handed out: no copy
        finally:
            tier.close()


def test_a_lookup_ref_written_over_is_asked_again_never_read_as_wrong_bytes():
    """A 2 MiB arena with no lease: the Lookup names 4 pages' refs, then 8 other pages are put
    over them. The get finds the refs stale and asks for the pages again: no wrong bytes, no
    corruption counted."""
    items, others = pages(4, seed=11), pages(8, seed=12)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk", "--ram", "2MiB", "--arena-lease", "0"]) as store:
        tier = RemoteTier([store.address])
        try:
            tier.put(items)
            tier.warm()
            assert all(tier.contains(keys))
            tier.put(others)  # a lap over the looked-up pages
            assert all(b is None or b == blob for b, (_, blob) in zip(tier.get(keys), items, strict=True))
            assert tier.pages_from_lookup == 0  # every ref was stale: all streamed
            tier.put(items)  # back in, at new places
            assert all(tier.contains(keys))  # refs again
            tier.put(pages(8, seed=15))  # fresh pages over them
            lease = ArenaViews()
            lent = tier.get(keys, lease=lease)
            assert all(b is None or bytes(b) == blob or key in lease.lost()
                       for key, b, (_, blob) in zip(keys, lent, items, strict=True))
            assert tier.stats().corrupt == 0
        finally:
            tier.close()


def test_a_lookup_gets_refs_only_for_held_pages_and_the_arena_it_names():
    items = pages(3, seed=13)
    keys = [k for k, _ in items]
    unknown = pages(1, seed=14)[0][0]
    with StoreProcess(["--no-disk"]) as store:
        client = StoreClient(store.address)
        try:
            client.put(items)
            assert client.arena_map is None  # not mapped before a bulk Get
            client.get_whole([])
            reader = client.arena_map
            assert reader is not None
            reply = client.lookup([keys[0], unknown, *keys[1:]], arena=reader)
            assert list(reply.tiers) != [] and reply.leading == 1
            lengths = list(reply.shm_lengths)
            assert lengths[1] == 0 and all(lengths[i] == len(items[j][1]) for i, j in ((0, 0), (2, 1), (3, 2)))
            assert reader.read(reply.shm_positions[0], lengths[0]) == items[0][1]
            assert not client.lookup(keys).shm_lengths  # no arena named: no refs
            other = Arena(2**20)  # another arena (as after the server restarted): none either
            try:
                elsewhere = ArenaMap(other.path, other.size, other.id)
                assert not client.lookup(keys, arena=elsewhere).shm_lengths
                elsewhere.close()
            finally:
                other.close()
        finally:
            client.close()


def test_lookup_refs_are_bounded_taken_once_and_skip_pages_not_in_the_arena():
    arena = Arena(2**20)
    try:
        reader = ArenaMap(arena.path, arena.size, arena.id)
        refs = LookupRefs(capacity=3)
        keys = [bytes([i]) * 32 for i in range(5)]
        refs.remember(reader, keys, [10, 20, 30, 40, 50], [1, 0, 1, 1, 1])  # keys[1] not in the arena
        assert len(refs) == 3  # keys 2, 3, 4: the oldest went
        assert refs.take(keys) == {keys[i]: (reader, 10 * (i + 1), 1) for i in (2, 3, 4)}
        assert refs.take(keys) == {} and len(refs) == 0
        reader.close()
    finally:
        arena.close()


def test_pages_read_through_the_index_are_told_to_the_server_and_get_a_second_chance():
    """A Lookup answered from the arena's index never reaches the server on the request path; the
    tier tells it in the background, so pages being read stay when the arena comes round."""
    import time

    from tiered_cache.v1 import cache_pb2 as pb

    items, filler = pages(3, seed=16), pages(6, seed=17)  # 256 KiB pages: a 2 MiB arena holds 7
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk", "--ram", "2MiB", "--arena-lease", "0"]) as store:
        tier = RemoteTier([store.address])
        try:
            tier.put(items)
            tier.warm()
            before = shm_pages(store.address)
            assert all(tier.contains(keys)) and tier.servers[0].client.arena_lookups == 1
            deadline = time.monotonic() + 30  # a bound on the wait, not a measurement
            while shm_pages(store.address) < before + len(keys) and time.monotonic() < deadline:
                time.sleep(0.05)
            tier.put(filler)  # the arena comes round: unread pages would go first
            with StoreClient(store.address) as client:
                assert list(client.lookup(keys).tiers) == [pb.TIER_RAM] * len(keys)
        finally:
            tier.close()
