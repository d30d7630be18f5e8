"""`get_into`: tiers write verified pages straight into their destinations (a staging row, or a
page's strided blocks inside a CPU pool), byte for byte, and a bad blob is a miss, counted and
deleted where the tier can, never bytes in a page (DESIGN.md §5)."""

from __future__ import annotations

import numpy as np
import pytest
import redis as redis_py
import torch
from tier_helpers import SPEC, keys_for, pages_for

import tiered_cache.tiers.disk as disk_module
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.chain import TierChain
from tiered_cache.tiers.disk import DiskTier
from tiered_cache.tiers.ram import RamTier
from tiered_cache.tiers.redis import RedisTier
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.wire.codec import (
    BlobError,
    Codec,
    check_raw_pieces,
    decode_into,
    decode_page,
    encode_page,
    page_bytes_view,
    raw_blob_size,
    raw_header_size,
)

N = 6
OTHER = SPEC.with_options(model_id="another-model")  # same shape, another fingerprint


def expected(n: int = N) -> list[np.ndarray]:
    """Each page's bytes, page-first: what a destination must hold after `get_into`."""
    return [page_bytes_view(page).copy() for page in pages_for(n)]


def items(n: int = N, codec: Codec = Codec.RAW) -> list[tuple[bytes, bytes]]:
    # min_saving < 0: the codec is kept even where it does not shrink the page (random KV).
    return [(k, encode_page(p, SPEC, k, codec, min_saving=-1.0)) for k, p in zip(keys_for(n), pages_for(n),
                                                                                 strict=True)]


def destinations(kind: str, n: int = N) -> tuple[list[np.ndarray], np.ndarray]:
    """`n` destinations, poisoned: rows of a contiguous staging buffer, or pages of a layer-first
    pool seen page-first (each page's (layers, 2, bytes) blocks, strided). Also the whole buffer."""
    block = SPEC.bytes_per_page // (2 * SPEC.num_layers)
    if kind == "staging":
        whole = np.full((n, SPEC.bytes_per_page), 0xAB, dtype=np.uint8)
        return [whole[i] for i in range(n)], whole
    whole = np.full((2, SPEC.num_layers, max(n, 6) + 3, block), 0xAB, dtype=np.uint8)  # a pool with spare pages
    pages = [5, 0, 3, 1, 4, 2, *range(6, n)][:n]  # out of order, as an allocator hands them out
    return [whole[:, :, p].transpose(1, 0, 2) for p in pages], whole


def page_of(dest: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(dest).reshape(-1)


def assert_pages(dests: list[np.ndarray], arrived: list, want: list[bool]) -> None:
    """`arrived` (what a tier's or the chain's `get_into` returned) says `want`, and those pages are exact."""
    if arrived and not isinstance(arrived[0], bool):  # a tier's get_into: each arrived blob's size, or 0
        assert all((n > 0) == ok for n, ok in zip(arrived, want, strict=True)), arrived
        arrived = [n > 0 for n in arrived]
    assert arrived == want
    for dest, page, ok in zip(dests, expected(len(dests)), want, strict=True):
        if ok:
            assert np.array_equal(page_of(dest), page)


# --- codec ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["staging", "pool"])
@pytest.mark.parametrize("codec", [Codec.RAW, Codec.LZ4, Codec.INT8])
def test_decode_into_any_destination_gives_decode_pages_bytes(kind, codec):
    dests, _ = destinations(kind, 3)
    for (key, blob), dest in zip(items(3, codec), dests, strict=True):
        decode_into(blob, SPEC, key, dest)
        assert np.array_equal(page_of(dest), decode_page(blob, SPEC, key))


def test_a_blob_read_in_pieces_is_checked_where_it_lies():
    (key, blob), (other_key, _) = items(2)
    h = raw_header_size(SPEC)
    header, payload, trailer = bytearray(blob[:h]), bytearray(blob[h:-4]), bytearray(blob[-4:])
    check_raw_pieces(header, payload, trailer, SPEC, key)
    assert len(blob) == raw_blob_size(SPEC)
    with pytest.raises(BlobError, match="checksum"):
        payload[100] ^= 1
        check_raw_pieces(header, payload, trailer, SPEC, key)
    payload[100] ^= 1
    with pytest.raises(BlobError, match="asked for"):
        check_raw_pieces(header, payload, trailer, SPEC, other_key)
    with pytest.raises(BlobError, match="fingerprint"):
        check_raw_pieces(header, payload, trailer, OTHER, key)
    with pytest.raises(BlobError, match="truncated"):
        check_raw_pieces(header, payload[:-1], trailer, SPEC, key)
    lz4_key, lz4_blob = items(1, Codec.LZ4)[0]
    with pytest.raises(BlobError):  # a compressed blob is never taken for a raw payload
        check_raw_pieces(lz4_blob[:h], bytearray(SPEC.bytes_per_page), lz4_blob[-4:], SPEC, lz4_key)


# --- the tiers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["staging", "pool"])
@pytest.mark.parametrize("threaded", [False, True])
def test_disk_get_into_is_byte_exact_and_refuses_bad_files(tmp_path, monkeypatch, kind, threaded):
    if threaded:  # every call on the reader threads, as a large one is
        monkeypatch.setattr(disk_module, "_THREADED_BYTES", 0)
    disk = DiskTier(tmp_path, "1MiB")
    good = items()
    lz4 = items(N, Codec.LZ4)
    disk.put([good[0], lz4[1], *good[2:N - 1]])  # the last page is missing
    keys = [k for k, _ in good]
    paths = [disk.file_of(k) for k in keys]
    dests, _ = destinations(kind)
    sizes = disk.get_into(keys, dests, SPEC)
    assert sizes == [len(b) for _, b in [good[0], lz4[1], *good[2:N - 1]]] + [0]  # each blob's stored size
    assert_pages(dests, sizes, [True] * (N - 1) + [False])
    assert disk.stats().corrupt == 0 and disk.stats().hits == N - 1 and disk.stats().misses == 1

    flipped = bytearray(paths[0].read_bytes())
    flipped[-100] ^= 0x10  # in the payload: only the checksum can tell
    paths[0].write_bytes(bytes(flipped))
    paths[2].write_bytes(paths[2].read_bytes() + b"\0")  # padded
    paths[3].write_bytes(encode_page(pages_for(4)[3], OTHER, keys[3]))  # another model's page, this key
    dests, _ = destinations(kind)
    assert_pages(dests, disk.get_into(keys, dests, SPEC), [False, True, False, False, True, False])
    assert disk.stats().corrupt == 3
    assert [p.exists() for p in paths] == [False, True, False, False, True, False]  # the bad ones deleted
    assert disk.contains(keys) == [False, True, False, False, True, False]
    disk.close()


@pytest.mark.parametrize("threaded", [False, True])
def test_a_warm_disk_tier_reads_into_a_pool_through_buffers_it_made_before(tmp_path, monkeypatch, threaded):
    # A page read into a CPU pool goes through a page-sized buffer: made on the first read, it
    # costs a page of fresh memory on the request's path. A reopened folder's warm-up makes them
    # (one per reader thread and one for a caller reading itself), whichever thread reads then.
    if threaded:
        monkeypatch.setattr(disk_module, "_THREADED_BYTES", 0)
    writer = DiskTier(tmp_path, "1MiB")
    writer.put(items())
    writer.close()
    disk = DiskTier(tmp_path, "1MiB")
    try:
        assert disk.files.buffers.made == 0
        disk.warm()
        made = disk.files.buffers.made
        assert made >= 2
        for _ in range(3):  # from this thread (a small call) or the reader threads, again and again
            dests, _ = destinations("pool")
            assert_pages(dests, disk.get_into(keys_for(N), dests, SPEC), [True] * N)
        assert disk.files.buffers.made == made  # none made on a read
    finally:
        disk.close()


def test_read_buffers_hand_back_the_last_one_given_and_keep_at_most_their_bound():
    from tiered_cache.tiers.read_buffers import ReadBuffers

    buffers = ReadBuffers(keep=2)
    buffers.make(3, 100)
    assert buffers.made == 2  # never more than kept
    a, b = buffers.take(100), buffers.take(50)
    c = buffers.take(100)  # none left: made
    assert buffers.made == 3 and len({id(a), id(b), id(c)}) == 3
    for buffer in (a, b, c):
        buffers.give_back(buffer)  # the third is not kept
    assert buffers.take(100) is b
    assert len(buffers.take(200)) == 200 and buffers.made == 4  # too small ones are passed over
    assert buffers.take(10) is a


@pytest.mark.parametrize("kind", ["staging", "pool"])
def test_redis_get_into_is_byte_exact_and_refuses_bad_blobs(redis_server, redis_prefix, kind):
    tier = RedisTier(redis_server.url, prefix=redis_prefix)
    good = items()
    tier.put([good[0], items(N, Codec.LZ4)[1], *good[2:N - 1]])
    keys = [k for k, _ in good]
    dests, _ = destinations(kind)
    assert_pages(dests, tier.get_into(keys, dests, SPEC), [True] * (N - 1) + [False])

    raw = redis_py.Redis.from_url(redis_server.url)
    flipped = bytearray(good[0][1])
    flipped[-100] ^= 0x10
    raw.set(tier.name_of(keys[0]), bytes(flipped))
    raw.set(tier.name_of(keys[2]), b"not a blob")
    raw.set(tier.name_of(keys[3]), encode_page(pages_for(4)[3], OTHER, keys[3]))
    dests, _ = destinations(kind)
    assert_pages(dests, tier.get_into(keys, dests, SPEC), [False, True, False, False, True, False])
    assert tier.stats().corrupt == 3 and tier.stats().errors == 0
    assert [raw.exists(tier.name_of(k)) for k in keys] == [0, 1, 0, 0, 1, 0]  # the bad ones deleted
    # The connections were left clean: the next calls on them read their own replies.
    assert tier.get([keys[4]]) == [good[4][1]]
    dests, _ = destinations(kind)
    sizes = tier.get_into(keys * 2, dests * 2, SPEC)
    assert [n > 0 for n in sizes] == [False, True, False, False, True, False] * 2
    assert sizes[4] == len(good[4][1]) and sizes[1] == len(items(N, Codec.LZ4)[1][1])  # each blob's own size
    tier.close()


def test_redis_get_into_over_several_mgets_keeps_pages_in_order(redis_server, redis_prefix, monkeypatch):
    import tiered_cache.tiers.redis as redis_module

    monkeypatch.setattr(redis_module, "MGET_INTO_BYTES", 2 * raw_blob_size(SPEC))  # 2 keys an MGET, one ahead
    tier = RedisTier(redis_server.url, prefix=redis_prefix)
    good = items()
    tier.put(good[:2] + good[3:])
    dests, _ = destinations("pool")
    assert_pages(dests, tier.get_into([k for k, _ in good], dests, SPEC), [True, True, False, True, True, True])
    tier.close()


def test_redis_get_into_from_a_dead_server_is_misses_and_an_error(tmp_path):
    from tiered_cache.bench.redis_process import RedisServer

    server = RedisServer(tmp_path)
    server.start()
    tier = RedisTier(server.url, prefix="dead", timeout_s=0.5)
    tier.put(items(2))
    server.stop()
    dests, _ = destinations("pool", 2)
    assert tier.get_into(keys_for(2), dests, SPEC) == [0, 0]
    assert tier.stats().errors == 1
    tier.close()


@pytest.mark.parametrize("shm", [True, False])
@pytest.mark.parametrize("kind", ["staging", "pool"])
def test_remote_get_into_is_byte_exact_and_refuses_foreign_pages(shm, kind):
    good = items()
    keys = [k for k, _ in good]
    args = ["--no-disk", "--ram", "64MiB"] + ([] if shm else ["--shm", "off"])
    with StoreProcess(args) as store:
        tier = RemoteTier([store.address])  # no fingerprint: the server passes any model's pages on
        tier.warm()  # maps the server's ring, where it offers one
        tier.put(good[:N - 1])
        tier.contains(keys)  # a Lookup, as match makes: same-host pages are then read with no Get
        dests, _ = destinations(kind)
        assert_pages(dests, tier.get_into(keys, dests, SPEC), [True] * (N - 1) + [False])
        assert tier.pages_from_lookup == (N - 1 if shm else 0)
        other = encode_page(pages_for(1)[0], OTHER, keys[N - 1])  # valid blob, key right, model wrong
        tier.put([(keys[N - 1], other)])
        dests, _ = destinations(kind)
        assert_pages(dests, tier.get_into(keys, dests, SPEC), [True] * (N - 1) + [False])
        assert tier.stats().corrupt == 1
        tier.close()


class _Overwritten:
    """A same-host arena whose pages are written over right after they are read (as a server that
    wrote over them while the client copied would): `intact` says no once a view was taken."""

    def __init__(self, blobs: dict[int, bytes]) -> None:
        self.blobs, self.taken = blobs, set()

    def view(self, position: int, length: int) -> memoryview:
        self.taken.add(position)
        return memoryview(self.blobs[position])

    def intact(self, position: int, length: int) -> bool:
        return position not in self.taken


def test_remote_get_into_asks_again_for_pages_the_arena_lost_while_they_were_copied():
    good = items()
    keys = [k for k, _ in good]
    with StoreProcess(["--no-disk", "--ram", "64MiB", "--shm", "off"]) as store:
        tier = RemoteTier([store.address])
        tier.put(good)
        ring = _Overwritten({i: blob for i, (_, blob) in enumerate(good)})
        tier.arena_reads.refs.remember(ring, keys, list(range(N)), [len(b) for _, b in good])
        dests, _ = destinations("pool")
        assert_pages(dests, tier.get_into(keys, dests, SPEC), [True] * N)  # each read again, as bytes
        assert ring.taken == set(range(N)) and tier.stats().corrupt == 0
        tier.close()


def test_a_tier_without_get_into_is_decoded_by_the_chain_and_a_foreign_blob_refused():
    good = items(3)
    keys = [k for k, _ in good]
    ram = RamTier(1 << 20)
    ram.put([good[0], (keys[1], encode_page(pages_for(2)[1], OTHER, keys[1])), good[2]])
    chain = TierChain([ram])
    dests, _ = destinations("pool", 3)
    assert_pages(dests, chain.get_into(keys, [0, 0, 0], dests, SPEC), [True, False, True])
    assert chain.stats()[0].corrupt == 1 and ram.contains(keys) == [True, False, True]
    assert chain.stats()[0].loads == 2


def test_chain_get_into_asks_each_tier_for_its_own_keys(tmp_path):
    good = items(4)
    keys = [k for k, _ in good]
    ram, disk = RamTier(1 << 20), DiskTier(tmp_path, "1MiB")
    ram.put(good[:2])
    disk.put(good[2:])
    chain = TierChain([ram, disk])
    dests, whole = destinations("staging", 4)
    assert_pages(dests, chain.get_into(keys, [0, 0, 1, 1], dests, SPEC), [True] * 4)
    assert torch.equal(torch.from_numpy(whole).view(SPEC.dtype.torch).reshape(SPEC.staging_shape(4)), pages_for(4))
    disk.close()


@pytest.mark.parametrize("into_pool", [True, False])
def test_a_cache_loads_from_disk_into_its_pool_and_a_corrupt_page_ends_the_prefix(tmp_path, into_pool):
    from kv_oracle import token_kv

    from tiered_cache.cache import TieredCache
    from tiered_cache.config import CacheConfig

    page = SPEC.bytes_per_page
    cache = TieredCache(SPEC, CacheConfig(pool_capacity=16 * page, host_capacity=16 * page, malloc_tuning=False),
                        lower=[DiskTier(tmp_path, "1MiB")])
    cache.loader.tier_loads.fills_pool = into_pool  # False: the staged path a CUDA pool takes (read, then one copy)
    tokens = list(range(6 * SPEC.page_size))
    cache.put(tokens, token_kv(SPEC, tokens))
    cache.evict()
    cache.flush()
    disk = cache.chain.tiers[0]
    keys = cache.core.keys("", tokens)
    _, pages = cache.host.copy_out(keys)
    disk.put([(k, encode_page(p, SPEC, k)) for k, p in zip(keys, pages, strict=True)])
    cache.host.delete(keys)  # only the disk holds the prefix now
    staged = []
    real = cache.loader.tier_loads.staged_to_pool
    cache.loader.tier_loads.staged_to_pool = lambda *a: (staged.append(1), real(*a))[1]
    n, kv = loaded(cache, tokens)
    assert n == len(tokens) and torch.equal(kv, token_kv(SPEC, tokens))
    assert staged == ([] if into_pool else [1])  # straight into the pool, or one copy from staging
    cache.evict()
    cache.host.delete(keys)
    flipped = bytearray(disk.file_of(keys[4]).read_bytes())
    flipped[-50] ^= 1
    disk.file_of(keys[4]).write_bytes(bytes(flipped))
    n, kv = loaded(cache, tokens)
    assert n == 4 * SPEC.page_size and torch.equal(kv, token_kv(SPEC, tokens[:n]))  # the prefix ends there
    assert cache.stats().tier("disk").corrupt == 1 and not disk.file_of(keys[4]).exists()
    cache.check_integrity()
    cache.close()


def test_redis_get_into_without_a_socket_to_read_decodes_blobs_instead(redis_server, redis_prefix, monkeypatch):
    # A redis-py whose connections keep no socket in `_sock` (a future version): get_into falls
    # back to `get` and decodes its blobs, with no error and the connection given back.
    import types

    import tiered_cache.tiers.redis as redis_module

    tier = RedisTier(redis_server.url, prefix=redis_prefix)
    tier.put(items())
    monkeypatch.setattr(redis_module, "socket", types.SimpleNamespace(socket=type("NotASocket", (), {})))
    dests, _ = destinations("pool")
    assert_pages(dests, tier.get_into(keys_for(N), dests, SPEC), [True] * N)
    assert tier.stats().errors == 0 and tier.get(keys_for(1)) == [items(1)[0][1]]
    tier.close()


@pytest.mark.parametrize("reply", [b"*x\r\n", b"*-5\r\n", b"+OK\r\n"])
def test_a_garbled_mget_reply_is_a_connection_error_never_a_value_error(reply):
    # A ValueError would escape the tier's error handling into `load`; a ReplyError is a
    # ConnectionError, which the tier counts and turns into misses.
    import socket

    from tiered_cache.tiers.resp_reader import ReplyError, ReplyReader

    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(reply)
        with pytest.raises(ReplyError):
            ReplyReader(ours).array_len()


def loaded(cache, tokens):
    """The paged API's load into the pool (`get` reads past the pool), read back: (tokens, KV)."""
    handle = cache.match(tokens)
    try:
        pages = cache.load(handle)
        n = len(pages) * SPEC.page_size
        return n, cache.pool.read_tokens(pages, n)
    finally:
        cache.release(handle)
