"""The store server under many, slow, idle, hostile or dying clients, and very long prefixes.
Every server here is a real `tiered-cache serve` process, except where a test counts calls
into a tier (then a `StoreServer` runs in this process)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_helpers import large_items, make_items
from throttle_proxy import ThrottledProxy

from tiered_cache.client.store_client import StoreClient
from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.server.config import ServerConfig
from tiered_cache.server.process import StoreProcess
from tiered_cache.server.store import BlobStore
from tiered_cache.server.store_server import StoreServer
from tiered_cache.tiers.ram import ENTRY_OVERHEAD_BYTES, RamTier
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.v1 import cache_pb2 as pb
from tiered_cache.v1 import cache_pb2_grpc
from tiered_cache.wire.codec import encode_page
from tiered_cache.wire.deadline import StreamStalled

MIB_SPEC = KVSpec("mib-pages", 8, 8, 128, page_size=32)  # 1 MiB pages


def mib_items(n: int, start: int = 0) -> list[tuple[bytes, bytes]]:
    keys = PageKeyer(MIB_SPEC, "load").keys(list(range(start, start + n * MIB_SPEC.page_size)))
    page = torch.randn(MIB_SPEC.staging_shape(1)[1:], generator=torch.Generator().manual_seed(start)).half()
    return [(k, encode_page(page, MIB_SPEC, k)) for k in keys]


def _stats(address: str) -> pb.ServerStats:
    return StoreClient(address).stats().server


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _idle_put(client: StoreClient, release: threading.Event):
    """A Put stream that sends nothing until `release` is set."""
    def nothing():
        release.wait(60)
        return
        yield  # pragma: no cover - a generator that yields nothing
    return client.stub.Put.future(nothing(), metadata=client.metadata)


def test_idle_and_unread_streams_do_not_stall_others_and_are_ended():
    items = large_items(100)  # 25 MiB: more than a stream's flow-control window
    keys = [k for k, _ in items]
    release = threading.Event()
    with StoreProcess(["--no-disk", "--stream-idle", "2", "--workers", "2"]) as store:
        client = StoreClient(store.address, timeout_s=60)
        assert client.put(items).stored == 100
        idle_puts = [_idle_put(StoreClient(store.address), release) for _ in range(10)]
        # Readers that never read, on channels whose receive window stays at gRPC's 64 KiB (no
        # BDP probing: on a fast loopback it can grow the window past the 25 MiB and the Get
        # would finish instead of stalling).
        unread_channels = [grpc.insecure_channel(store.address, options=[("grpc.http2.bdp_probe", 0)])
                           for _ in range(10)]
        unread_gets = [cache_pb2_grpc.KVCacheStub(ch).Get(pb.GetRequest(keys=keys)) for ch in unread_channels]
        try:
            _wait_for(lambda: _stats(store.address).active_streams == 20, 10, "20 open streams")
            start = time.monotonic()
            assert StoreClient(store.address, timeout_s=2).lookup(keys).leading == 100
            health = health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert [item.blob for item in StoreClient(store.address, timeout_s=10).get(keys[:3])] == \
                [b for _, b in items[:3]]
            assert time.monotonic() - start < 2, "the idle streams held up other clients"
            # Past the idle deadline the server ends them all and counts them.
            _wait_for(lambda: _stats(store.address).active_streams == 0, 15, "stalled streams to be ended")
            assert _stats(store.address).stalled_streams == 20
            for call in idle_puts:
                with pytest.raises(grpc.RpcError) as err:
                    call.result(timeout=10)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "no page received" in err.value.details()
        finally:
            release.set()
            for call in unread_gets:
                call.cancel()
            for channel in unread_channels:
                channel.close()


def test_past_max_streams_calls_fail_fast_with_a_retry_hint():
    release = threading.Event()
    items = make_items(4)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk", "--max-streams", "2"]) as store:
        client = StoreClient(store.address, timeout_s=10)
        client.put(items)
        held = [_idle_put(StoreClient(store.address), release) for _ in range(2)]
        try:
            _wait_for(lambda: _stats(store.address).active_streams == 2, 10, "two open streams")
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(client.get(keys))
            assert time.monotonic() - start < 2
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_streams" in err.value.details()
            assert "grpc-retry-pushback-ms" in dict(err.value.trailing_metadata())
            assert client.lookup(keys).leading == 4  # unary calls are not capped
            assert _stats(store.address).refused_streams == 1
        finally:
            release.set()
            for call in held:
                call.result(timeout=10)
        assert [i.blob for i in client.get(keys)] == [b for _, b in items]  # slots are given back


def test_put_ack_accounts_for_every_blob_and_repeated_keys_are_served_at_every_position():
    (a, blob_a), (b, blob_b) = make_items(2, start=40)
    with StoreProcess(["--no-disk"]) as store:
        ack = StoreClient(store.address).put([(a, blob_a)] * 3 + [(b, blob_b)] * 2)
        assert (ack.stored, ack.already_held, len(ack.refused)) == (2, 3, 0)
        ack = StoreClient(store.address).put([(a, blob_a), (a, b"not a blob")])
        assert (ack.stored, ack.already_held, len(ack.refused)) == (0, 1, 1)
        tier = RemoteTier([store.address])
        assert tier.get([a, b, a, a]) == [blob_a, blob_b, blob_a, blob_a]
        tier.close()


def test_a_lookup_answers_within_100_ms_while_a_512_mib_get_streams():
    items = mib_items(512)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk", "--ram", "600MiB"]) as store:
        assert StoreClient(store.address, timeout_s=30).put(items).stored == 512
        started, received = threading.Event(), []

        def stream() -> None:
            for item in StoreClient(store.address, timeout_s=30).get(keys):
                received.append(len(item.blob))
                started.set()
                time.sleep(0.002)  # a client that reads steadily, not instantly

        getter = threading.Thread(target=stream)
        getter.start()
        assert started.wait(30)
        looker = StoreClient(store.address, timeout_s=5)
        latencies = []
        for _ in range(5):
            start = time.monotonic()
            assert looker.lookup(keys[:64]).leading == 64
            latencies.append(time.monotonic() - start)
        mid_stream = len(received) < len(keys)
        getter.join(120)
        assert mid_stream, "the Get finished before the lookups: the test measured nothing"
        assert sum(received) >= 512 * MIB_SPEC.bytes_per_page
        assert max(latencies) < 0.1, f"lookups took {[round(x * 1e3) for x in latencies]} ms during the stream"


def test_sixteen_concurrent_clients_get_exactly_the_bytes_they_put():
    shared = make_items(8, start=100_000, seed=1)  # keys no client makes on its own
    with StoreProcess(["--no-disk"]) as store:
        errors: list[str] = []

        def client(n: int) -> None:
            own = make_items(12, start=n * 1000, seed=n + 2)
            tier = RemoteTier([store.address], timeout_s=30)
            for _ in range(3):
                tier.put(own + shared)
                got = tier.get([k for k, _ in own + shared])
                if got != [b for _, b in own + shared]:
                    errors.append(f"client {n} got other bytes")
            tier.close()

        threads = [threading.Thread(target=client, args=(n,)) for n in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and not any(t.is_alive() for t in threads)
        assert StoreClient(store.address).stats().tiers[0].pages == 16 * 12 + 8


def test_a_prefix_that_takes_several_progress_deadlines_arrives_whole():
    """The progress deadline bounds silence, not the stream: a prefix that takes several deadlines
    to arrive, moving all the while, arrives whole and byte-exact (a deadline over the whole stream
    could never deliver it). Through a slow link (48 MiB at 16 MiB/s: 3 s against a 1 s deadline;
    the 5 s default against a 2 GiB prefix at ~0.9 GiB/s is the same race, 3.5x slower to run), and
    without shared memory, so every byte crosses the stream the deadline watches."""
    items = mib_items(48)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk", "--shm", "off"]) as store, ThrottledProxy(store.address, 16 * 2**20) as link:
        direct = RemoteTier([store.address], timeout_s=30.0)
        assert direct.put(items) == 48
        direct.close()
        tier = RemoteTier([link.address], timeout_s=1.0, shm=False)
        start = time.monotonic()
        got = tier.get(keys)
        elapsed = time.monotonic() - start
        assert got == [b for _, b in items], "a long prefix must arrive whole and byte-exact"
        assert tier.stats().errors == 0
        assert elapsed > 2.0, f"the prefix arrived in {elapsed:.1f} s: the test measured nothing"
        tier.close()


def test_a_server_that_accepts_and_never_answers_fails_on_the_progress_deadline():
    # A black hole: a TCP listener that accepts and never speaks HTTP/2.
    import socket

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    try:
        client = StoreClient(f"127.0.0.1:{hole.getsockname()[1]}", timeout_s=1.0)
        start = time.monotonic()
        with pytest.raises(StreamStalled):
            list(client.get([k for k, _ in make_items(1)]))
        with pytest.raises(StreamStalled):
            client.put(make_items(2))
        assert time.monotonic() - start < 6
        tier = RemoteTier([f"127.0.0.1:{hole.getsockname()[1]}"], timeout_s=1.0)
        assert tier.get([k for k, _ in make_items(2)]) == [None, None]  # a miss, not an error
    finally:
        hole.close()


_KILLED_CLIENT = """
import sys
from tiered_cache.client.store_client import StoreClient
from service_helpers import large_items
keys = [k for k, _ in large_items(100)]
stream = StoreClient(sys.argv[1], timeout_s=60).get(keys)
next(stream)
print("reading", flush=True)
import time; time.sleep(60)
"""


def test_a_client_killed_mid_stream_frees_its_server_resources():
    items = large_items(100)
    with StoreProcess(["--no-disk"]) as store:
        StoreClient(store.address, timeout_s=30).put(items)
        proc = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENT, store.address], stdout=subprocess.PIPE,
                                text=True, cwd="tests")
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "reading"
            assert _stats(store.address).active_streams == 1
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            _wait_for(lambda: _stats(store.address).active_streams == 0, 10, "the dead client's stream to end")
        finally:
            proc.kill()
        keys = [k for k, _ in items]
        assert [i.blob for i in StoreClient(store.address, timeout_s=30).get(keys)] == [b for _, b in items]


def test_the_ram_tier_counts_what_entries_cost_not_only_payloads():
    tier = RamTier(1 << 20)
    blobs = [(i.to_bytes(32, "little"), bytes(64)) for i in range(20_000)]
    tier.put(blobs)
    assert tier.stats().used_bytes <= 1 << 20
    assert len(tier.index) == (1 << 20) // (64 + ENTRY_OVERHEAD_BYTES)


def test_stats_never_waits_for_a_data_call_and_reports_fresh_figures():
    server = StoreServer(ServerConfig(port=0, disk_path=None), BlobStore(RamTier(1 << 20)))
    port = server.start()
    try:
        client = StoreClient(f"127.0.0.1:{port}")
        client.put(make_items(3))
        with server.store.chain._tier_locks[0]:  # a data call in progress on the RAM tier
            replies = [client.stats(timeout_s=2) for _ in range(5)]
        assert all(r.tiers[0].name == "ram" and r.tiers[0].pages == 3 for r in replies)
        client.put(make_items(2, start=100))
        assert client.stats(timeout_s=2).tiers[0].pages == 5  # not a cached figure
    finally:
        server.stop()


def test_a_get_its_client_cancels_is_counted_and_logs_no_error():
    """A client that has what it needs stops reading a Get: routine, so the server counts it in
    its stats and logs nothing above debug level (tracebacks for it would bury real errors)."""
    items = large_items(64)  # 16 MiB: still streaming when the client walks away
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk", "--ram", "64MiB"]) as store:
        with StoreClient(store.address, shm=False, timeout_s=10) as client:
            client.put(items)
            for _ in range(3):
                stream = client.get(keys)
                next(stream)
                stream.close()  # cancels the call mid-stream
            _wait_for(lambda: _stats(store.address).cancelled_streams >= 3, 15, "cancelled Gets to be counted")
            assert _stats(store.address).stalled_streams == 0
        log = "\n".join(store.output)
    assert "Traceback" not in log and "ERROR" not in log, log
