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
from tiered_cache.service.shm_ring import HEADER, ShmReader, ShmRing
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
