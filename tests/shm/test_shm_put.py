"""Same-host Put through the client's own shared-memory ring (shm/offers.py), against real
server processes: the bytes put are the bytes stored, the ack counts every page, pages the ring
came round over (or a restarted server that no longer maps it) are sent again as bytes, garbage
at a position is refused as corrupt, and the server maps nothing but a client's Put ring."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from tests.shm.test_arena_transport import pages
from tiered_cache.client.store_client import StoreClient
from tiered_cache.server.process import StoreProcess
from tiered_cache.shm.arena import Arena
from tiered_cache.shm.host import host_identity
from tiered_cache.shm.offers import OfferedSegments
from tiered_cache.shm.put_ring import MIN_BYTES, PUT_RING, PutRing
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.v1 import cache_pb2 as pb


def server_figures(address: str) -> pb.ServerStats:
    with StoreClient(address) as client:
        return client.stats().server


def stored(client: StoreClient, keys: list[bytes]) -> dict[bytes, bytes]:
    return {r.key: bytes(r.blob) for r in client.get(keys)}


def test_a_same_host_put_goes_through_the_clients_ring_and_stores_exactly_the_bytes():
    items = pages(10, seed=20)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk"]) as store:
        tier = RemoteTier([store.address])
        try:
            assert tier.put(items) == len(items)
            client = tier.servers[0].client
            assert client.uses_shm_put and client.shm_put_resent == 0
            figures = server_figures(store.address)
            assert figures.shm_put_pages == len(items) and figures.shm_offers == 1
            # The client's ring, mapped by the server, is shown apart (the client's memory).
            assert figures.shm_offered_bytes == client.put_ring_bytes > 0
            assert stored(client, keys) == dict(items)
            assert tier.get(keys) == [b for _, b in items]
        finally:
            tier.close()


def test_the_ack_accounts_for_every_page_sent_repeated_keys_included():
    a, b = pages(2, seed=21)
    with StoreProcess(["--no-disk"]) as store, StoreClient(store.address) as client:
        reply = client.put([a, a, a, b, b])
        assert client.uses_shm_put
        assert (reply.stored, reply.already_held, len(reply.refused)) == (2, 3, 0)
        assert stored(client, [a[0], b[0]]) == dict([a, b])


def test_a_put_larger_than_half_the_ring_is_split_and_a_page_too_large_for_it_goes_as_bytes():
    items = pages(12, seed=22)  # 3 MiB of 256 KiB pages through a 2 MiB ring: Puts of <= 1 MiB
    with StoreProcess(["--no-disk"]) as store, StoreClient(store.address, put_ring_bytes=2 * MIN_BYTES) as client:
        reply = client.put(items)
        assert (reply.stored, len(reply.refused)) == (len(items), 0) and client.uses_shm_put
        assert server_figures(store.address).shm_put_pages == len(items) and client.shm_put_resent == 0
        assert stored(client, [k for k, _ in items]) == dict(items)
    big = pages(1, seed=23)[0]
    with StoreProcess(["--no-disk"]) as store, StoreClient(store.address, put_ring_bytes=2 * MIN_BYTES) as client:
        client.put(pages(1, seed=24))  # offers the ring
        with_header = (big[0], big[1] + big[1])  # over 512 KiB: past a 2 MiB ring's largest page (a quarter)
        assert client.put([with_header]).refused[0].reason == pb.CORRUPT_BLOB  # sent as bytes, checked there
        assert server_figures(store.address).shm_put_pages == 1


def test_a_put_budget_bounds_the_whole_put_not_each_call_through_the_ring():
    """400 pages through a 2 MiB ring are 134 PutOffered calls, each well inside 20 ms: a 20 ms
    budget must end the put part-way (each call used to get the whole budget anew)."""
    items = pages(400, seed=25)
    with StoreProcess(["--no-disk", "--ram", "256MiB"]) as store, \
            StoreClient(store.address, put_ring_bytes=2 * MIN_BYTES) as client:
        client.put(items[:1])  # offers the ring
        assert client.uses_shm_put
        with pytest.raises(grpc.RpcError) as raised:
            client.put(items, budget_s=0.02)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0 < server_figures(store.address).shm_put_pages < len(items)  # stopped part-way
        reply = client.put(items)  # no budget: the rest is stored, what was stored is held
        assert reply.stored + reply.already_held == len(items) and not reply.refused
        assert stored(client, [k for k, _ in items]) == dict(items)


def test_a_page_the_clients_ring_came_round_over_is_refused_as_lost_never_stored():
    items = pages(12, seed=25)
    with StoreProcess(["--no-disk"]) as store, StoreClient(store.address, put_ring_bytes=2 * MIN_BYTES) as client:
        client.put(items[:1])
        ring = client._put_ring
        assert ring is not None and client.uses_shm_put
        first = ring.place(items[1][1])
        for _, blob in items[2:]:  # ten more pages of an eighth of the ring each: a lap over `first`
            ring.place(blob)
        request = pb.PutOfferedRequest(segment=ring.segment, pages=[
            pb.OfferedPage(key=items[1][0], position=first[0], length=first[1])])
        reply = client.stub.PutOffered(request, timeout=5)
        assert [r.reason for r in reply.refused] == [pb.SHM_LOST] and reply.stored == 0
        assert "came round" in reply.refused[0].message
        assert stored(client, [items[1][0]]) == {}
        # Through put() the same page is stored: placed afresh.
        assert client.put([items[1]]).stored == 1 and stored(client, [items[1][0]]) == dict([items[1]])


def test_garbage_at_a_position_is_refused_as_corrupt_and_an_unknown_segment_as_lost():
    items = pages(2, seed=26)
    with StoreProcess(["--no-disk"]) as store, StoreClient(store.address) as client:
        client.put(items[:1])
        ring = client._put_ring
        assert ring is not None
        where = ring.place(os.urandom(len(items[1][1])))
        garbage = pb.PutOfferedRequest(segment=ring.segment, pages=[
            pb.OfferedPage(key=items[1][0], position=where[0], length=where[1])])
        reply = client.stub.PutOffered(garbage, timeout=5)
        assert [r.reason for r in reply.refused] == [pb.CORRUPT_BLOB] and reply.stored == 0
        unknown = pb.PutOfferedRequest(segment=os.urandom(16), pages=garbage.pages)
        reply = client.stub.PutOffered(unknown, timeout=5)
        assert [r.reason for r in reply.refused] == [pb.SHM_LOST] and "not mapped" in reply.refused[0].message
        too_large = pb.PutOfferedRequest(segment=ring.segment, pages=[
            pb.OfferedPage(key=items[1][0], position=0, length=2**40)])
        assert client.stub.PutOffered(too_large, timeout=5).refused[0].reason == pb.TOO_LARGE
        assert stored(client, [items[1][0]]) == {}
        assert server_figures(store.address).refused_blobs == 3


def test_one_request_naming_the_same_page_many_times_is_stored_once_and_counted_each_time():
    items = pages(1, seed=27)
    with StoreProcess(["--no-disk"]) as store, StoreClient(store.address) as client:
        client.put(items)
        ring = client._put_ring
        where = ring.place(items[0][1])
        request = pb.PutOfferedRequest(segment=ring.segment, pages=[
            pb.OfferedPage(key=items[0][0], position=where[0], length=where[1])] * 2000)  # 500 MiB named
        reply = client.stub.PutOffered(request, timeout=30)
        assert (reply.stored, reply.already_held, len(reply.refused)) == (0, 2000, 0)


def test_a_restarted_server_gets_the_pages_as_bytes_then_the_ring_is_offered_again(tmp_path):
    first, second, third = pages(3, seed=28), pages(3, seed=29), pages(3, seed=30)
    store = StoreProcess(["--disk", str(tmp_path)])
    store.start()
    port = store.address.rsplit(":", 1)[1]
    client = StoreClient(store.address)
    try:
        assert client.put(first).stored == 3 and client.uses_shm_put
        store.stop()
        store = StoreProcess(["--disk", str(tmp_path), "--port", port])
        store.start()
        reply = client.put(second)  # the new server does not map the old ring: every page lost, resent
        assert (reply.stored, len(reply.refused)) == (3, 0) and client.shm_put_resent == 3
        assert server_figures(store.address).shm_put_pages == 0
        assert client.put(third).stored == 3  # offered again: through the ring
        assert server_figures(store.address).shm_put_pages == 3 and client.shm_put_resent == 3
        assert stored(client, [k for k, _ in first + second + third]) == dict(first + second + third)
    finally:
        client.close()
        store.stop()


def test_with_shared_memory_off_a_put_carries_bytes():
    items = pages(3, seed=31)
    with StoreProcess(["--no-disk", "--shm", "off"]) as store, StoreClient(store.address) as client:
        assert client.put(items).stored == 3 and not client.uses_shm_put
        assert client._put_ring is None  # not even made: the server said it shares no memory
        assert server_figures(store.address).shm_put_pages == 0
        reply = client.stub.Offer(pb.OfferRequest(path="/proc/1/fd/0", size=MIN_BYTES, segment=b"x" * 16,
                                                  host=host_identity()), timeout=5)
        assert not reply.accepted and "--shm off" in reply.reason


def test_the_server_maps_only_a_same_host_clients_put_ring(tmp_path):
    ring = PutRing(MIN_BYTES)
    get_ring = Arena(MIN_BYTES)  # a sealed memfd, but not a put ring
    plain = tmp_path / "plain"
    plain.write_bytes(bytes(MIN_BYTES))
    fd = os.open(plain, os.O_RDONLY)
    unsealed = os.memfd_create(PUT_RING, os.MFD_CLOEXEC)  # the right name, but it could shrink
    os.ftruncate(unsealed, MIN_BYTES)
    offers = OfferedSegments(capacity=2)
    here, local = host_identity(), "ipv4:127.0.0.1:5000"
    try:
        refusals = {
            "remote peer": offers.offer(ring.path, ring.size, ring.segment, here, "ipv4:10.1.2.3:5000"),
            "other host": offers.offer(ring.path, ring.size, ring.segment, "someone-else", local),
            "not /proc": offers.offer(str(plain), ring.size, ring.segment, here, local),
            "a file": offers.offer(f"/proc/{os.getpid()}/fd/{fd}", MIN_BYTES, ring.segment, here, local),
            "an arena": offers.offer(get_ring.path, get_ring.size, get_ring.id, here, local),
            "wrong id": offers.offer(ring.path, ring.size, os.urandom(16), here, local),
            "wrong size": offers.offer(ring.path, ring.size + 4096, ring.segment, here, local),
            "huge": offers.offer(ring.path, 2**41, ring.segment, here, local),
            "unsealed": offers.offer(f"/proc/{os.getpid()}/fd/{unsealed}", MIN_BYTES, ring.segment, here, local),
        }
        assert "not sealed" in refusals["unsealed"]
        assert all(refusals.values()), refusals
        assert len(offers) == 0
        assert offers.offer(ring.path, ring.size, ring.segment, here, local) == ""
        assert len(offers) == 1
        where = ring.place(b"page")
        data, reader, why = offers.view(ring.segment, *where)
        assert bytes(data) == b"page" and why == "" and reader.intact(*where)
        del data
    finally:
        os.close(fd)
        os.close(unsealed)
        offers.close()
        ring.close()
        get_ring.close()


def test_segments_of_closed_clients_are_unmapped_at_the_next_offer():
    with StoreProcess(["--no-disk"]) as store:
        first = StoreClient(store.address)
        assert first.put(pages(1, seed=36)).stored == 1 and first.uses_shm_put
        first.close()  # its ring's fd is gone; only the server's map keeps the memory alive
        assert server_figures(store.address).shm_offers == 1
        with StoreClient(store.address) as second:
            second.put(pages(1, seed=37))
            assert second.uses_shm_put and server_figures(store.address).shm_offers == 1


def test_a_server_that_does_not_take_put_offered_gets_bytes_from_then_on():
    """An older server behind the same address (it answers Offer's UNIMPLEMENTED too, so the
    client sends bytes at once); and one that took the offer, then stopped taking PutOffered."""
    items = pages(4, seed=38)
    with StoreProcess(["--no-disk"]) as store, StoreClient(store.address) as client:
        assert client.put(items[:1]).stored == 1 and client.uses_shm_put

        class Unimplemented(grpc.RpcError):
            def code(self) -> grpc.StatusCode:
                return grpc.StatusCode.UNIMPLEMENTED

        def refuse(*args: object, **kwargs: object) -> None:  # a fault a current server cannot give
            raise Unimplemented()

        client.stub.PutOffered = refuse
        reply = client.put(items[1:3])
        assert (reply.stored, len(reply.refused)) == (2, 0) and not client.uses_shm_put
        assert client.put(items[3:]).stored == 1 and not client.uses_shm_put
        assert server_figures(store.address).shm_put_pages == 1
        assert stored(client, [k for k, _ in items]) == dict(items)


def test_a_page_read_by_lookup_ref_must_be_of_the_tiers_model():
    """A blob of another model stored under one of our keys (a Put without a fingerprint): a Get
    would filter it on the server; read in place after a Lookup it is refused by the tier."""
    import torch

    from tests.shm.test_arena_transport import SPEC
    from tiered_cache.wire.codec import encode_page

    ours = pages(2, seed=39)
    other = SPEC.with_options(model_id="another-model")
    foreign = encode_page(torch.randn(other.staging_shape(1)[1:]), other, ours[1][0], "raw")
    with StoreProcess(["--no-disk"]) as store:
        with StoreClient(store.address) as client:
            assert client.put([ours[0], (ours[1][0], foreign)]).stored == 2
        tier = RemoteTier([store.address], fingerprint=bytes.fromhex(SPEC.fingerprint))
        try:
            tier.warm()
            assert tier.contains([k for k, _ in ours]) == [True, True]
            assert tier.get([k for k, _ in ours]) == [ours[0][1], None]
            assert tier.pages_from_lookup == 2 and tier.stats().corrupt == 1
        finally:
            tier.close()


def test_segments_of_exited_clients_are_unmapped_and_the_count_is_bounded():
    code = ("import sys; from tests.shm.test_arena_transport import pages; "
            "from tiered_cache.client.store_client import StoreClient; c = StoreClient(sys.argv[1]); "
            "assert c.put(pages(1, seed=32)).stored <= 1; assert c.uses_shm_put")
    with StoreProcess(["--no-disk"]) as store, StoreClient(store.address) as client:
        subprocess.run([sys.executable, "-c", code, store.address], check=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        assert server_figures(store.address).shm_offers == 1  # the exited client's, not unmapped yet
        client.put(pages(1, seed=33))  # a new offer unmaps segments of exited processes
        assert server_figures(store.address).shm_offers == 1 and client.uses_shm_put


@pytest.mark.parametrize("token", [None, "wrong"])
def test_offer_and_put_offered_need_the_token(tmp_path, token):
    items = pages(1, seed=34)
    with StoreProcess(["--no-disk", "--token", "s3cret"]) as store:
        with StoreClient(store.address, token=token) as stranger:
            with pytest.raises(grpc.RpcError) as info:
                stranger.put(items)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert not stranger.uses_shm_put
        with StoreClient(store.address, token="s3cret") as owner:
            assert owner.put(items).stored == 1 and owner.uses_shm_put



def test_a_page_the_clients_ring_comes_round_over_during_the_servers_copy_is_dropped_and_refused(monkeypatch):
    """The server copies an offered page straight from the client's ring into its arena; if the
    ring came round over it meanwhile (a race that cannot be timed for real: `intact` is made to
    say so after the copy, a mock of that only), the copy is dropped from the store and refused as lost, and the
    ack still counts each page once."""
    from tiered_cache.server.config import ServerConfig
    from tiered_cache.server.store_server import StoreServer
    from tiered_cache.shm.put_ring_reader import PutRingReader
    from tiered_cache.v1 import cache_pb2 as pb

    items = pages(3, seed=60)
    server = StoreServer(ServerConfig(disk_path="", ram_capacity="64MiB"))
    ring = PutRing(4 * MIN_BYTES)
    try:
        service = server.service
        assert service.offers.offer(ring.path, ring.size, ring.segment, host_identity(), "ipv4:127.0.0.1:1") == ""
        request = pb.PutOfferedRequest(segment=ring.segment, pages=[
            pb.OfferedPage(key=key, position=p, length=n) for key, blob in items for p, n in [ring.place(blob)]])
        checks: dict[int, int] = {}

        def intact_until_copied(self, position: int, length: int) -> bool:  # before the copy yes, after no
            checks[position] = checks.get(position, 0) + 1
            return checks[position] == 1

        monkeypatch.setattr(PutRingReader, "intact", intact_until_copied)
        response = pb.PutResponse()
        assert service.puts._store_offered(request, response) == len(items)
        assert [r.reason for r in response.refused] == [pb.SHM_LOST] * len(items)
        assert response.stored + response.already_held + len(response.refused) == len(items)
        assert server.store.locate([k for k, _ in items]) == [None] * len(items)
        monkeypatch.undo()
        response = pb.PutResponse()
        service.puts._store_offered(request, response)
        assert response.stored == len(items) and not response.refused
        assert server.store.get([k for k, _ in items]) == [b for _, b in items]
    finally:
        ring.close()
        server.stop()
        server.store.close()
