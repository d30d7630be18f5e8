"""The bulk Get (wire/bulk.py): pages as bytes over plain TCP beside gRPC, the path another host
uses. Against real store server processes: it serves the same verified bytes as gRPC's Get, keeps
tenants apart with the same tokens, refuses a wrong token or a malformed request with a message
(and keeps serving everyone else), ends a call within its deadline when the server stalls or
dies, and is not offered with TLS."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from concurrent.futures import Future

import numpy as np
import pytest
from service_helpers import FINGERPRINT, SPEC, make_items, self_signed_cert
from throttle_proxy import ThrottledProxy

from tiered_cache.client.bulk_client import BulkClient, BulkRefused
from tiered_cache.client.store_client import StoreClient
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.wire import bulk
from tiered_cache.wire.codec import raw_blob_size, verify_blob

TOKENS = "token-a team-a\ntoken-b team-b\n"


def received(client: BulkClient, keys: list[bytes], fingerprint: bytes = FINGERPRINT) -> dict[bytes, bytes]:
    """What a bulk Get hands over, copied out of its reused buffers."""
    got: dict[bytes, bytes] = {}

    def place(key: bytes, blob: memoryview) -> Future:
        got[key] = bytes(blob)
        done: Future = Future()
        done.set_result(None)
        return done

    client.get_into(keys, fingerprint, place)
    return got


def stored(store: StoreProcess, items: list[tuple[bytes, bytes]], token: str | None = None) -> int:
    """Put `items` into `store` over gRPC, as another instance would; how many it stored."""
    with StoreClient(store.address, token=token, shm=False) as client:
        return client.put(items, FINGERPRINT).stored


def page_dests(n: int) -> list[np.ndarray]:
    """`n` page destinations of SPEC (layers, 2, bytes), zeroed."""
    return [np.zeros((SPEC.num_layers, 2, SPEC.bytes_per_page // SPEC.num_layers // 2), np.uint8) for _ in range(n)]


def bulk_of(address: str, token: str | None = None, namespace: str | None = None) -> BulkClient:
    client = StoreClient(address, token=token, namespace=namespace, shm=False)
    endpoint = client.bulk()
    assert endpoint is not None
    endpoint.warm()  # the probe a cache's warm-up makes
    found = endpoint.client()
    assert found is not None, "the server offers a bulk Get"
    return found


def test_the_bulk_get_serves_the_bytes_grpc_serves_and_a_remote_tier_loads_through_it():
    items = make_items(40, seed=5)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk", "--shm", "off"]) as store:
        assert said(store, "bulk Get at 127.0.0.1:")
        with StoreClient(store.address, shm=False) as client:
            assert client.put(items, FINGERPRINT).stored == 40
            over_grpc = {bytes(b.key): bytes(b.blob) for b in client.get_whole(keys, FINGERPRINT).blobs}
        missing = b"\x07" * 32
        assert received(bulk_of(store.address), [*keys, missing]) == over_grpc == dict(items)
        for key, blob in received(bulk_of(store.address), keys[:3]).items():
            verify_blob(blob, key)
        # Another model's fingerprint: the server filters those pages out, as gRPC's Get does.
        assert received(bulk_of(store.address), keys, fingerprint=b"\x01" * 32) == {}

        tier = RemoteTier([store.address], fingerprint=FINGERPRINT, shm=False)
        try:
            tier.warm()
            dests = np.zeros((40, SPEC.num_layers, 2, SPEC.bytes_per_page // SPEC.num_layers // 2), dtype=np.uint8)
            sizes = tier.get_into(keys, list(dests), SPEC)
            assert sizes == [raw_blob_size(SPEC)] * 40 and tier.bulk_gets == 1
            for (_, blob), dest in zip(items, dests, strict=True):
                payload_at = len(blob) - 4 - SPEC.bytes_per_page
                assert dest.tobytes() == blob[payload_at:-4], "a page placed with other bytes than were stored"
            # `get` reads the same way: each blob copied out of the bulk Get's reused buffers.
            assert tier.get([*keys, keys[0]]) == [*(blob for _, blob in items), items[0][1]] and tier.bulk_gets == 2
        finally:
            tier.close()


def test_tenants_stay_apart_and_a_wrong_token_is_refused_by_name(tmp_path):
    (tmp_path / "tokens").write_text(TOKENS)
    items = make_items(3, seed=6)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk", "--token-file", str(tmp_path / "tokens")]) as store:
        assert stored(store, items, token="token-a") == 3
        assert received(bulk_of(store.address, "token-a"), keys) == dict(items)
        assert received(bulk_of(store.address, "token-b"), keys) == {}  # B knows A's keys: still nothing
        port = bulk_of(store.address, "token-a").address[1]
        with pytest.raises(BulkRefused, match="may not use namespace 'team-a'"):
            received(BulkClient("127.0.0.1", port, "Bearer token-b", "team-a", 5.0), keys)
        wrong = BulkClient("127.0.0.1", port, "Bearer nope", "", 5.0)
        with pytest.raises(BulkRefused, match="missing or wrong token"):
            received(wrong, keys)
        # A remote tier whose token is refused loads nothing and raises nothing.
        tier = RemoteTier([store.address], token="nope", fingerprint=FINGERPRINT, shm=False)
        try:
            dests = page_dests(3)
            assert tier.get_into(keys, dests, SPEC) == [0, 0, 0]
        finally:
            tier.close()


def test_a_malformed_request_gets_a_message_and_the_server_serves_the_next_client():
    items = make_items(2, seed=7)
    with StoreProcess(["--no-disk"]) as store:
        stored(store, items)
        port = bulk_of(store.address).address[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
            assert bulk.read_exact(sock, 1)[0] == bulk.REFUSED and "bad hello" in bulk.read_text(sock)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(bulk.hello("", "") + (0).to_bytes(4, "little"))
            assert bulk.read_exact(sock, 1)[0] == bulk.OK and bulk.read_text(sock) == ""
            assert bulk.read_length(sock) == bulk.FAILED and "0 keys in one request" in bulk.read_text(sock)
        assert received(bulk_of(store.address), [k for k, _ in items]) == dict(items)


def test_a_stalled_or_killed_server_ends_the_call_within_its_deadline():
    items = make_items(64, seed=8)  # 128 KiB: minutes through the proxy below
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk"]) as store:
        stored(store, items)
        port = bulk_of(store.address).address[1]
        with ThrottledProxy(f"127.0.0.1:{port}", bytes_per_s=20_000) as proxy:  # a link that all but stops
            host, slow_port = proxy.address.rsplit(":", 1)
            slow = BulkClient(host, int(slow_port), "", "", timeout_s=30.0)
            started = time.monotonic()
            with pytest.raises(bulk.BulkError, match="budget"):
                slow.get_into(keys, FINGERPRINT, lambda key, blob: _done(), budget_s=1.0)
            assert time.monotonic() - started < 10
        client = bulk_of(store.address)
        store.proc.kill()
        store.proc.wait()
        started = time.monotonic()
        with pytest.raises(OSError):
            received(client, keys)
        assert time.monotonic() - started < 10


def test_a_server_with_tls_offers_no_bulk_get(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    with StoreProcess(["--no-disk", "--tls-cert", str(cert), "--tls-key", str(key)]) as store:
        assert said(store, "no bulk Get with TLS")
        with StoreClient(store.address, tls_ca=str(cert), shm=False) as client:
            assert client.bulk() is None and client._attach_reply().bulk_port == 0


def said(store: StoreProcess, words: str) -> bool:
    """Whether the server printed `words` at start (its lines after "listening" arrive on a thread)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(words in line for line in store.output):
            return True
        time.sleep(0.05)
    return False


def _done() -> Future:
    done: Future = Future()
    done.set_result(None)
    return done


def test_an_unreachable_bulk_port_falls_back_to_grpc_without_counting_against_the_server():
    items = make_items(6, seed=9)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk", "--shm", "off"]) as store:
        stored(store, items)
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()  # a port nobody listens on: connections are refused, for real
        tier = RemoteTier([store.address], fingerprint=FINGERPRINT, shm=False)
        try:
            server = tier.servers[0]
            server.client._bulk._ask_port = lambda: port  # as a firewall that passes gRPC's port only would leave it
            tier.warm()
            dests = page_dests(len(keys))
            assert tier.get_into(keys, dests, SPEC) == [raw_blob_size(SPEC)] * 6  # over gRPC
            assert tier.bulk_gets == 0 and tier.stats().errors == 0 and server.closed
            assert server.client.bulk().client() is None  # dropped for a while, not probed on every call
        finally:
            tier.close()


def test_a_kept_connection_the_server_closed_while_idle_is_replaced_once():
    items = make_items(3, seed=10)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk", "--stream-idle", "1"]) as store:
        stored(store, items)
        bulk_client = bulk_of(store.address)
        assert received(bulk_client, keys) == dict(items)
        time.sleep(2.0)  # past the server's stream_idle_s: it closes the kept connection
        assert received(bulk_client, keys) == dict(items)
        assert bulk_client.reconnects == 1


def test_a_cache_that_never_warmed_up_uses_grpc_until_a_probe_has_connected_off_the_request_path():
    items = make_items(4, seed=11)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk", "--shm", "off"]) as store:
        stored(store, items)
        tier = RemoteTier([store.address], fingerprint=FINGERPRINT, shm=False)
        try:
            dests = page_dests(len(keys))
            assert tier.get_into(keys, dests, SPEC) == [raw_blob_size(SPEC)] * 4 and tier.bulk_gets == 0
            endpoint = tier.servers[0].client.bulk()
            deadline = time.monotonic() + 10
            while endpoint.client() is None and time.monotonic() < deadline:  # the probe the first call started
                time.sleep(0.05)
            assert tier.get_into(keys, dests, SPEC) == [raw_blob_size(SPEC)] * 4 and tier.bulk_gets == 1
        finally:
            tier.close()


def test_a_bulk_port_in_use_is_refused_at_start_in_one_line():
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "tiered_cache.cli.main", "serve", "--port", "0", "--no-disk",
                               "--bulk-port", str(port)], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        assert f"cannot listen for the bulk Get on 127.0.0.1:{port}" in done.stderr and "--bulk-port" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    finally:
        taken.close()
