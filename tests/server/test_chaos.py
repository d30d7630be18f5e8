"""Chaos: clients keep running while the store server, Redis, the disk or the network fails
under them. Each test is bounded in time; every page returned is compared byte for byte with
what was put (chaos_helpers.py); no client may hang, crash or receive wrong bytes."""

from __future__ import annotations

import signal
import socket
import time

import pytest
from chaos_helpers import CHAOS_SPEC, Clients, chaos_pages

from tiered_cache.bench.redis_process import RedisServer, free_port
from tiered_cache.cache import TieredCache
from tiered_cache.client.store_client import StoreClient
from tiered_cache.config import CacheConfig
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.breaker import BreakerPolicy
from tiered_cache.tiers.redis import RedisTier
from tiered_cache.tiers.remote import RemoteTier

QUICK = BreakerPolicy(cooldown_s=0.05, max_cooldown_s=0.3)  # probe a dead server again soon
TIMEOUT_S = 1.0  # the clients' progress deadline
RECOVERY_S = TIMEOUT_S + QUICK.max_cooldown_s + 2.0  # a timeout, a cooldown, and room for a loaded CI


def _run(clients: Clients, seconds: float) -> None:
    time.sleep(seconds)
    assert not any(log.crashed for log in clients.logs)


def _recovered_within(clients: Clients, since: float, op: str, full: bool = False) -> float:
    """Seconds from `since` until every client got an answer to `op` again (the slowest one);
    `full`: an answer for every page of its batch."""
    firsts = [log.first_answer_after(op, since, full) for log in clients.logs]
    assert all(f is not None for f in firsts), f"a client never got a {op} answered after the fault ended"
    return max(firsts) - since


def test_store_sigkilled_mid_put_and_get_then_restarted_serves_only_intact_pages(tmp_path):
    port = free_port()
    args = ["--disk", str(tmp_path / "store"), "--ram", "64MiB", "--write-through", "--port", str(port)]
    pages = chaos_pages(96)  # 12 MiB
    store = StoreProcess(args)
    store.start()
    clients = Clients(4, lambda: RemoteTier([store.address], timeout_s=TIMEOUT_S, breaker=QUICK), pages).start()
    try:
        _run(clients, 1.5)
        assert clients.answered_after("get", 0) > 0, "the clients never got going"
        store.kill()  # SIGKILL with Put and Get streams in flight (4 clients, 2 MiB batches)
        killed = time.monotonic()
        _run(clients, 1.0)
        assert clients.answered_after("get", killed + TIMEOUT_S) == 0  # nothing answers: misses
        store = StoreProcess(args)
        store.start()
        restarted = time.monotonic()
        _run(clients, 2.5)
        assert _recovered_within(clients, restarted, "put") < RECOVERY_S
        assert _recovered_within(clients, restarted, "get") < RECOVERY_S
    finally:
        hung = clients.stop()
    assert not hung, f"clients hung after the server died: {hung}"
    compared = clients.check()
    assert compared > 0 and clients.errors() > 0  # the kill was felt, as misses
    slowest = max(log.slowest_s for log in clients.logs)
    assert slowest < 3 * TIMEOUT_S + 2, f"one call took {slowest:.1f} s"
    # A fresh client after one more SIGKILL and restart: what survived on disk is intact.
    store.kill()
    with StoreProcess(args) as again, StoreClient(again.address) as client:
        got = list(client.get([k for k, _ in pages]))
        assert got, "write-through pages must survive a SIGKILL"
        assert all(bytes(g.blob) == clients.expected[g.key] for g in got)
        assert client.stats().server.refused_blobs == 0


def _redis_tier(url: str) -> RedisTier:
    return RedisTier(url, prefix="chaos", timeout_s=0.5, breaker=QUICK)


def test_redis_killed_and_restarted_under_load(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    pages = chaos_pages(64)
    clients = Clients(4, lambda: _redis_tier(server.url), pages).start()
    try:
        _run(clients, 1.0)
        server.kill()
        killed = time.monotonic()
        _run(clients, 1.0)
        assert clients.answered_after("put", killed + 0.5) == 0
        server.start()  # same port, empty: nothing was persisted
        restarted = time.monotonic()
        _run(clients, 2.0)
        assert _recovered_within(clients, restarted, "put") < RECOVERY_S
        assert _recovered_within(clients, restarted, "get") < RECOVERY_S
    finally:
        hung = clients.stop()
        server.stop()
    assert not hung
    compared = clients.check()
    assert compared > 0 and clients.errors() > 0


def test_one_cluster_master_killed_and_restarted_under_load(redis_cluster):
    pages = chaos_pages(96)
    clients = Clients(4, lambda: _redis_tier(redis_cluster.url), pages).start()
    try:
        _run(clients, 1.0)
        redis_cluster.kill(1)
        killed = time.monotonic()
        _run(clients, 1.5)
        # The other masters keep serving their share while one is down.
        assert clients.answered_after("get", killed + 0.5) > 0
        redis_cluster.restart(1)
        restarted = time.monotonic()
        _run(clients, 1.5)
        # Every page of a batch is stored again: the restarted master's slots included.
        assert _recovered_within(clients, restarted, "put", full=True) < RECOVERY_S
    finally:
        hung = clients.stop()
    assert not hung
    compared = clients.check()
    assert compared > 0 and clients.errors() > 0


def test_a_full_disk_under_the_store_never_reaches_its_clients(small_fs):
    """The store's disk (4 MiB) is far smaller than what clients write through it (12 MiB) and
    than its configured capacity: it evicts and keeps admitting; no client sees an error."""
    args = ["--disk", str(small_fs / "store"), "--disk-capacity", "1GiB", "--ram", "1MiB", "--write-through"]
    pages = chaos_pages(96)
    with StoreProcess(args) as store:
        clients = Clients(3, lambda: RemoteTier([store.address], timeout_s=5.0), pages).start()
        try:
            _run(clients, 3.0)
        finally:
            hung = clients.stop()
        assert not hung
        assert clients.check() > 0
        assert clients.errors() == 0, "a full disk must not fail a client's call"
        puts = [c for log in clients.logs for c in log.calls if c[1] == "put"]
        assert puts and all(got == asked for _, _, asked, got, _ in puts), "every Put acked in full"
        with StoreClient(store.address) as client:
            disk = next(t for t in client.stats().tiers if t.name == "disk")
            assert disk.evictions > 0 and disk.used_bytes <= 4 * 2**20
            assert store.proc.poll() is None and client.health() == "SERVING"


def test_a_full_disk_below_the_engine_never_raises_into_it(small_fs):
    cfg = CacheConfig(pool_capacity=8 * CHAOS_SPEC.bytes_per_page, host_capacity=8 * CHAOS_SPEC.bytes_per_page,
                      lower_tiers=["disk"], disk_path=str(small_fs / "engine"), disk_capacity="1GiB",
                      write_policy="write_through")
    cache = TieredCache(CHAOS_SPEC, cfg)
    try:
        import torch

        gen = torch.Generator().manual_seed(3)
        prompts = []
        for i in range(12):  # 12 prompts of 4 pages (512 KiB each): 6 MiB through a 4 MiB disk
            tokens = list(range(i * 1000, i * 1000 + 4 * CHAOS_SPEC.page_size))
            kv = torch.randn(CHAOS_SPEC.kv_shape(len(tokens)), generator=gen).half()
            assert cache.put(tokens, kv) == len(tokens)
            prompts.append((tokens, kv))
        assert cache.flush(timeout=30)
        cache.evict()
        for tokens, kv in prompts:  # from wherever they still are: exact, or a shorter hit
            n, got = cache.get(tokens)
            assert n % CHAOS_SPEC.page_size == 0
            if n:
                assert torch.equal(got[:, :, :n], kv[:, :, :n])
        assert cache.stats().tier("disk").evictions > 0
        cache.check_integrity()
    finally:
        cache.close()


@pytest.fixture
def black_hole():
    """A TCP port that accepts connections (the kernel's backlog) and never says a word."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _engine_over(address: str, shm: bool = True) -> TieredCache:
    """An engine's cache over the store at `address`. `shm=False`: every page by RPC, even from a
    server on this host (a same-host client may read a paused server's arena in place, intact,
    with no RPC at all: what arrives then depends on timing, not on the deadlines tested here)."""
    cfg = CacheConfig(pool_capacity=8 * CHAOS_SPEC.bytes_per_page, host_capacity=8 * CHAOS_SPEC.bytes_per_page,
                      write_policy="write_through")
    return TieredCache(CHAOS_SPEC, cfg, lower=[RemoteTier([address], timeout_s=0.5, shm=shm)])


@pytest.mark.parametrize("server", ["black-holed", "paused"])
def test_a_silent_server_costs_the_engine_one_deadline_then_recompute(black_hole, server, tmp_path):
    """`black-holed`: accepts, never answers. `paused`: a real store server that held the pages,
    SIGSTOPped (connections open, nothing moves). The engine's lookup falls back to a miss
    (recompute) within its deadline, and later requests do not wait on the dead server again."""
    store = None
    tokens = list(range(4 * CHAOS_SPEC.page_size))
    if server == "black-holed":
        address = black_hole
    else:
        store = StoreProcess(["--no-disk"])
        address = store.start()
        import torch

        writer = _engine_over(address)
        writer.put(tokens, torch.randn(CHAOS_SPEC.kv_shape(len(tokens))).half())
        writer.flush(timeout=30)
        writer.close()
    cache = _engine_over(address, shm=False)
    try:
        if store is not None:
            assert cache.lookup(tokens) == len(tokens)  # the channel is up, and the pages are there
            store.proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        n, _ = cache.get(tokens)  # what an engine's load does: load what is below
        first = time.monotonic() - started
        assert n == 0  # nothing arrived: the engine computes the prefix itself
        started = time.monotonic()
        for _ in range(20):
            assert cache.get(tokens)[0] == 0
        later = (time.monotonic() - started) / 20
        assert first < 0.5 * 2 + 1.0, f"the first load took {first:.2f} s against a 0.5 s deadline"
        assert later < 0.1, f"later loads waited {later:.2f} s each on a server known to be silent"
        remote = cache.stats().tier("remote")
        assert remote.errors >= 1 and remote.open_breakers == 1
        cache.check_integrity()
    finally:
        cache.close()
        if store is not None:
            store.proc.send_signal(signal.SIGCONT)
            store.stop()
