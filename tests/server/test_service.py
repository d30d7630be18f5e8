"""The store server in its own process, driven through the client and raw gRPC."""

import signal
import threading

import grpc
import pytest
from service_helpers import FINGERPRINT, SPEC, large_items, make_items, self_signed_cert, with_codec_byte
from tier_helpers import HeldDisk

from tiered_cache.client.store_client import StoreClient
from tiered_cache.server.process import StoreProcess
from tiered_cache.server.store import BlobStore
from tiered_cache.tiers.disk import DiskTier
from tiered_cache.tiers.ram import RamTier, entry_cost
from tiered_cache.v1 import cache_pb2 as pb


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with StoreProcess(["--disk", str(tmp_path_factory.mktemp("store")), "--max-page", "64KiB"]) as proc:
        yield proc


def test_put_lookup_get_round_trip(store):
    items = make_items(6)
    keys = [k for k, _ in items]
    with StoreClient(store.address) as client:
        assert client.health() == "SERVING"
        ack = client.put(items[:4], FINGERPRINT)
        assert (ack.stored, ack.already_held, len(ack.refused)) == (4, 0, 0)
        assert client.put(items[:2]).already_held == 2
        reply = client.lookup(keys)
        assert reply.leading == 4 and list(reply.tiers) == [pb.TIER_RAM] * 4 + [pb.TIER_NONE] * 2
        got = list(client.get(keys))
        assert [(g.key, g.blob) for g in got] == items[:4]
        other = bytes(32)  # a fingerprint no blob has: nothing is sent
        assert list(client.get(keys, fingerprint=other)) == []


def _degenerate(key: bytes, shape: tuple[int, ...]) -> bytes:
    from service_helpers import checksummed

    from tiered_cache.wire import codec

    return checksummed(SPEC, codec.Codec.RAW.wire_id, codec._DTYPES.index(SPEC.dtype), shape, 0, b"", key)


def test_bad_blobs_are_refused_with_reasons_and_counted(store):
    good = make_items(3, start=1000)
    (k0, b0), (_, b1), (k2, _) = good
    foreign = make_items(1, start=1000, spec=SPEC.with_options(model_id="other"))[0]
    flipped = bytearray(b0)
    flipped[100] ^= 1
    cases = [
        ((k0[:10], b0), pb.BAD_KEY, "key is 10 bytes"),
        ((k0, bytes(flipped)), pb.CORRUPT_BLOB, "checksum"),
        ((k0, b"not a blob at all, just some garbage bytes" * 3), pb.CORRUPT_BLOB, "not a page blob"),
        ((k2, b1), pb.KEY_MISMATCH, "asked for"),
        ((k0, with_codec_byte(b0, 77)), pb.UNKNOWN_CODEC, "unknown codec id 77"),
        ((k0, b"x" * (65 * 1024)), pb.TOO_LARGE, "at most 65,536"),
        # Pages of nothing (no layers, a dimension of 0): the smallest blobs a flood could send,
        # checksummed and well formed, yet no KV to reuse.
        ((k0, _degenerate(k0, (0, 2, 2, 4, 32))), pb.CORRUPT_BLOB, "holds no KV: not a page"),
        ((k0, _degenerate(k0, (1, 2, 2, 4, 0))), pb.CORRUPT_BLOB, "holds no KV: not a page"),
    ]
    with StoreClient(store.address) as client:
        before = client.stats().server.refused_blobs
        ack = client.put([item for item, _, _ in cases])
        assert ack.stored == 0
        assert [r.reason for r in ack.refused] == [reason for _, reason, _ in cases]
        for refusal, (_, _, text) in zip(ack.refused, cases, strict=True):
            assert text in refusal.message
        ack = client.put([foreign], FINGERPRINT)  # a valid blob of another model
        assert [r.reason for r in ack.refused] == [pb.FINGERPRINT_MISMATCH]
        assert client.stats().server.refused_blobs == before + len(cases) + 1
        assert client.put(good[:1]).stored == 1  # the server keeps serving


def test_malformed_requests_get_invalid_argument(store):
    channel = grpc.insecure_channel(store.address)
    raw = channel.unary_unary("/tiered_cache.v1.KVCache/Lookup")  # bytes in, bytes out
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xff\xff garbage that is not protobuf", timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid tiered_cache.v1.LookupRequest" in info.value.details()
    with StoreClient(store.address) as client:
        rejected = client.stats().server.rejected_requests
        with pytest.raises(grpc.RpcError) as info:
            client.lookup([b"short"])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "page keys are 32 bytes" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            list(client.get([bytes(32)], fingerprint=b"abc"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client.stats().server.rejected_requests == rejected + 2
        # A long prefix's keys in one Lookup are no page: a server taking 64 KiB pages answers them.
        assert len(client.lookup([bytes(32)] * 4000).tiers) == 4000
    big = channel.unary_unary("/tiered_cache.v1.KVCache/Lookup")
    with pytest.raises(grpc.RpcError) as info:
        big(pb.LookupRequest(keys=[bytes(32)] * 40000).SerializeToString(), timeout=5)  # > 64 KiB + 1 MiB
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    channel.close()
    with StoreClient(store.address) as client:
        assert client.health() == "SERVING"


def test_token_is_required_when_set(tmp_path):
    with StoreProcess(["--no-disk", "--token", "s3cret"]) as proc:
        items = make_items(1)
        for token in (None, "wrong"):
            with StoreClient(proc.address, token=token) as client:
                with pytest.raises(grpc.RpcError) as info:
                    client.lookup([items[0][0]])
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as info:
                    client.put(items)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert client.health() == "SERVING"  # health stays open for load balancers
        with StoreClient(proc.address, token="s3cret") as client:
            assert client.put(items).stored == 1
            # Each stranger: the Lookup, the Attach its first Put asks (shared memory?), the Put.
            assert client.stats().server.unauthenticated == 6


def test_restart_on_the_same_folder_serves_pages_again(tmp_path):
    items = make_items(5, start=7)
    proc = StoreProcess(["--disk", str(tmp_path)])
    proc.start()
    with StoreClient(proc.address) as client:
        assert client.put(items).stored == 5  # in RAM only until shutdown flushes them
    assert proc.stop(signal.SIGTERM) == 0
    assert any("flushed 5 pages" in line for line in proc.output)
    with StoreProcess(["--disk", str(tmp_path)]) as again, StoreClient(again.address) as client:
        assert client.lookup([k for k, _ in items]).leading == 5
        assert [(g.key, g.blob) for g in client.get([k for k, _ in items])] == items
        assert [t.name for t in client.stats().tiers] == ["ram", "disk"]


def test_tls(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    with StoreProcess(["--no-disk", "--tls-cert", str(cert), "--tls-key", str(key)]) as proc:
        assert "(TLS" in proc.output[0]
        with StoreClient(proc.address, tls_ca=str(cert)) as client:
            assert client.put(make_items(1)).stored == 1
        with StoreClient(proc.address, timeout_s=2) as plain, pytest.raises(grpc.RpcError):
            plain.lookup([bytes(32)])
        # A TLS mismatch is said as one, naming the option, not as a server that is down.
        from conftest import run_cli_here as run_cli

        mismatch = run_cli("stats", "--address", proc.address, "--timeout", "2", check=False)
        assert mismatch.returncode == 1 and "TLS mismatch" in mismatch.stdout and "--tls-ca" in mismatch.stdout
        assert "unreachable" not in mismatch.stdout
        from tiered_cache.tiers.remote import RemoteTier

        tier = RemoteTier([proc.address], timeout_s=2)
        try:
            assert tier.contains([bytes(32)]) == [False]  # a miss, and the reason the operator reads:
            assert "remote_tls_ca" in tier.servers[0].breaker.why
        finally:
            tier.close()
    with StoreProcess(["--no-disk"]) as plain_server:  # the other way round: TLS client, plaintext server
        other = run_cli("stats", "--address", plain_server.address, "--tls-ca", str(cert), "--timeout", "2",
                        check=False)
        assert other.returncode == 1 and "TLS mismatch" in other.stdout


def test_stats_cli_table_and_json(store):
    """`tiered-cache stats` on this module's store (its figures, through main() in-process). The
    `--watch` refreshes, into a pipe and on a terminal, are test_stats_cli's (this test ran the
    pipe case a second time)."""
    import json

    from conftest import run_cli_here as run_cli

    with StoreClient(store.address) as client:
        client.put(make_items(1, start=9000))  # a page to show, whichever tests ran before
    table = run_cli("stats", "--address", store.address).stdout
    assert "ram" in table and "disk" in table and "hit rate" in table and "tiered-cache 0.1.0" in table
    assert "refused (max_streams)" in table and "ended stalled" in table
    data = json.loads(run_cli("stats", "--address", store.address, "--json").stdout)
    assert [t["name"] for t in data["tiers"]] == ["ram", "disk"] and data["tiers"][0]["pages"] >= 1
    both_run = run_cli("stats", "--address", store.address, "--address", "127.0.0.1:1", "--json", check=False)
    assert both_run.returncode == 1  # a server down fails the command, the other is still reported
    both = json.loads(both_run.stdout)
    assert "error" in both[1] and both[0]["address"] == store.address
    down = run_cli("stats", "--address", "127.0.0.1:1", "--timeout", "1", check=False)
    assert down.returncode == 1 and "unreachable" in down.stdout


def test_sigterm_lets_an_in_flight_stream_finish():
    items = large_items(120)
    keys = [k for k, _ in items]
    proc = StoreProcess(["--no-disk", "--ram", "256MiB"])
    proc.start()
    with StoreClient(proc.address, timeout_s=60) as client:
        client.put(items)
        stream = client.get(keys)
        first = next(stream)
        proc.proc.send_signal(signal.SIGTERM)  # shutdown starts with most of the stream unsent
        rest = list(stream)
    assert [first.key, *[r.key for r in rest]] == keys
    assert [r.blob for r in rest] == [blob for _, blob in items[1:]]
    assert proc.stop() == 0
    assert any("shutting down" in line for line in proc.output)


# --- BlobStore in-process (what the server's handlers call) ------------------------------------------
def _blob_size() -> int:
    """What one page costs the RAM tier (its blob and the entry around it)."""
    return entry_cost(make_items(1)[0][1])


def test_blob_store_demotes_loads_and_counts(tmp_path):
    size = _blob_size()
    store = BlobStore(RamTier(3 * size), [DiskTier(tmp_path, 100 * size, fsync=False)])
    items = make_items(5, start=300)
    keys = [k for k, _ in items]
    assert store.put(items) == (5, 0)
    assert store.put(items) == (2, 3)  # the 3 in RAM are held; the 2 on disk come back into RAM (their
    # disk copies dropped: the newest Put of a page is the one kept, written down again from RAM)
    assert store.locate(keys) == ["ram", "ram", "disk", "disk", "ram"]
    assert store.get(keys[2:4]) == [b for _, b in items[2:4]]  # found on disk, loaded into RAM
    assert store.locate(keys) == ["disk", "ram", "ram", "ram", "disk"]
    assert store.locate([bytes(32)]) == [None] and store.get([bytes(32)]) == [None]
    ram, disk = store.stats()
    assert (ram.name, disk.name) == ("ram", "disk") and store.tiers == [store.ram, *store.lower]
    assert ram.loads == 0 and disk.loads == 2
    assert disk.demotions == 6 and disk.pages == 4 and ram.evictions == 6  # k1 is in RAM only
    assert store.get(keys) == [b for _, b in items]


def test_blob_store_write_through_and_flush(tmp_path):
    size = _blob_size()
    items = make_items(4, start=400)
    keys = [k for k, _ in items]
    through = BlobStore(RamTier(100 * size), [DiskTier(tmp_path / "a", 100 * size, fsync=False)], write_through=True)
    assert through.put(items) == (4, 0)
    assert through.lower[0].contains(keys) == [True] * 4 and through.flush() == 0
    lazy = BlobStore(RamTier(100 * size), [DiskTier(tmp_path / "b", 100 * size, fsync=False)])
    assert lazy.put(items[:3]) == (3, 0)
    assert lazy.lower[0].contains(keys) == [False] * 4
    lazy.lower[0].put(items[:1])  # already below: not copied again
    assert lazy.flush() == 2 and lazy.flush() == 0
    assert lazy.lower[0].get(keys[:3]) == [b for _, b in items[:3]]
    assert BlobStore(RamTier(size)).flush() == 0


def test_a_lookup_from_ram_does_not_wait_behind_a_get_from_disk(tmp_path):
    size = _blob_size()
    disk = HeldDisk(tmp_path, 100 * size)
    on_disk, in_ram = make_items(3, start=500), make_items(3, start=600)
    disk.put(on_disk)
    store = BlobStore(RamTier(100 * size), [disk])
    store.put(in_ram)
    slow: list = []
    getter = threading.Thread(target=lambda: slow.append(store.get([k for k, _ in on_disk])))
    getter.start()
    try:
        assert disk.entered.wait(30)
        done: list = []

        def lookup_and_get() -> None:
            keys = [k for k, _ in in_ram]
            done.append(store.locate(keys))
            done.append(store.get(keys))
            done.append(store.put(make_items(2, start=700)))

        other = threading.Thread(target=lookup_and_get)
        other.start()
        other.join(30)
        assert not other.is_alive(), "a RAM lookup waited behind another client's disk get"
        assert done == [["ram"] * 3, [b for _, b in in_ram], (2, 0)]
        assert getter.is_alive()  # the disk get was held the whole time
    finally:
        disk.release.set()
        getter.join(30)
    assert slow == [[b for _, b in on_disk]]
    assert store.locate([k for k, _ in on_disk]) == ["ram"] * 3


def test_a_bad_blob_put_first_is_refused_or_replaced_by_the_real_page(store):
    """A buggy or hostile writer gets to a key first. What the server can check without knowing
    the model (the header's geometry holds together, the payload decodes) it refuses at Put; what
    it cannot (a consistent page of another shape or model under this key) it stores, readers
    refuse, and the real page's Put replaces it: the real page is then what every reader gets."""
    from service_helpers import checksummed

    from tiered_cache.wire import codec
    from tiered_cache.wire.codec import Codec

    (key, real), = make_items(1, start=7000)
    header = codec.read_header(real)
    raw = real[header.payload_offset:header.payload_offset + header.payload_len]
    fp16 = codec._DTYPES.index(SPEC.dtype)
    shape = SPEC.staging_shape(1)[1:]
    size = SPEC.bytes_per_page

    def forged(codec_id, dtype_id, page_shape, raw_len, payload, spec=SPEC):
        return checksummed(spec, codec_id, dtype_id, page_shape, raw_len, payload, key)

    refused_at_put = [
        (forged(Codec.RAW.wire_id, fp16, shape, size + 2, raw + b"xy"), "raw length"),  # not shape x 2 bytes
        (forged(Codec.RAW.wire_id, codec._DTYPES.index(codec.DType.FP32), shape, size, raw), "raw length"),
        (forged(Codec.RAW.wire_id, fp16, (shape[0], 3, *shape[2:]), size // 2 * 3, raw + raw[:size // 2]),
         "not (layers, 2"),
        (forged(Codec.LZ4.wire_id, fp16, shape, size, b"\xff" * 64), "lz4 payload"),
        (forged(Codec.INT8.wire_id, fp16, shape, size, bytes(10)), "int8 payload"),
    ]
    wrong_but_consistent = [  # readers of SPEC refuse these; only a reader can tell
        forged(Codec.RAW.wire_id, fp16, (*shape[:-1], shape[-1] // 2), size // 2, raw[:size // 2]),
        forged(Codec.RAW.wire_id, fp16, shape, size, raw, spec=SPEC.with_options(model_id="another model")),
    ]
    with StoreClient(store.address) as client:
        for bad, reason in refused_at_put:
            ack = client.put([(key, bad)])
            assert ack.stored == 0 and [r.reason for r in ack.refused] == [pb.CORRUPT_BLOB], reason
            assert reason in ack.refused[0].message
            assert client.lookup([key]).leading == 0  # nothing stored under the key
        for planted in wrong_but_consistent:
            assert client.put([(key, planted)]).stored == 1
            with pytest.raises(codec.BlobError):  # what a reader of SPEC makes of it
                codec.decode_page(next(iter(client.get([key]))).blob, SPEC, key)
            ack = client.put([(key, real)], FINGERPRINT)  # the reader recomputed the page and puts it
            assert (ack.stored, ack.already_held, len(ack.refused)) == (1, 0, 0)
            assert [g.blob for g in client.get([key], fingerprint=FINGERPRINT)] == [real]
        assert client.put([(key, real)]).already_held == 1  # the same page again replaces nothing


def test_a_failure_inside_a_store_process_block_shows_what_the_server_said(capsys):
    """A test that fails talking to a store server started for it (`with StoreProcess(...)`) gets
    the server's own output on stderr, and whether it had exited before it was stopped: a server
    that died under a client reads differently from one that was refused nothing."""
    with pytest.raises(RuntimeError, match="boom"), StoreProcess(["--no-disk"]) as store:
        store.proc.kill()
        store.proc.wait()
        raise RuntimeError("boom")
    err = capsys.readouterr().err
    assert "store server (--no-disk) had exited with -9; its output:" in err and "listening on" in err
    with StoreProcess(["--no-disk"]):
        pass
    assert capsys.readouterr().err == ""  # nothing said when nothing failed
