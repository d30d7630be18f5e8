import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from service_helpers import large_items, make_items

from tiered_cache.client.store_client import StoreClient
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.breaker import BreakerPolicy
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.tiers.remote_servers import owner


def test_rendezvous_spreads_keys_and_moves_few_when_a_server_joins():
    keys = [os.urandom(32) for _ in range(3000)]
    three = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]
    counts = [0, 0, 0]
    for key in keys:
        counts[owner(key, three)] += 1
    assert all(800 < c < 1200 for c in counts)
    four = [*three, "10.0.0.4:1"]
    moved = sum(owner(k, three) != owner(k, four) for k in keys)
    assert 0.15 < moved / len(keys) < 0.35  # about a quarter, all of them to the new server
    assert all(owner(k, four) == 3 for k in keys if owner(k, three) != owner(k, four))


def test_two_servers_share_the_keys_and_serve_them_all(tmp_path):
    items = make_items(40)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk"]) as a, StoreProcess(["--no-disk"]) as b:
        tier = RemoteTier([a.address, b.address])
        assert tier.put(items) == 40
        assert tier.contains_prefix(keys) == 40 and tier.contains(keys) == [True] * 40
        assert tier.get(keys) == [blob for _, blob in items]
        held = [StoreClient(p.address).lookup(keys).tiers for p in (a, b)]
        per_server = [sum(1 for t in tiers if t) for tiers in held]
        assert sum(per_server) == 40 and min(per_server) > 5
        tier.close()


def test_a_dead_server_means_fast_misses_not_errors_raised():
    items = make_items(3)
    tier = RemoteTier(["127.0.0.1:1"], timeout_s=1.0, breaker=BreakerPolicy(max_cooldown_s=0.5))
    start = time.monotonic()
    assert tier.put(items) == 0
    assert tier.get([k for k, _ in items]) == [None] * 3
    assert tier.contains_prefix([k for k, _ in items]) == 0
    assert time.monotonic() - start < 3
    assert tier.stats().errors >= 1


def test_a_server_back_after_a_long_outage_is_used_again_within_two_seconds(tmp_path):
    """gRPC's default reconnect backoff (1 s, x1.6 per attempt, up to 120 s) left a server that
    was down 5.5 s unused for 2-4 s after it was back; the client's channel reconnects at most
    1 s apart (client.RECONNECT_BACKOFF_MS)."""
    items = make_items(4)
    keys = [k for k, _ in items]
    args = ["--disk", str(tmp_path / "store"), "--write-through"]
    with StoreProcess(args) as store:
        tier = RemoteTier([store.address], timeout_s=1.0, breaker=BreakerPolicy(cooldown_s=0.05, max_cooldown_s=0.3))
        assert tier.put(items) == 4
        address = store.address
    killed = time.monotonic()
    while time.monotonic() - killed < 5.5:  # calls all through the outage: the channel backs off
        assert tier.get(keys) == [None] * 4
        time.sleep(0.05)
    with StoreProcess([*args, "--port", address.rsplit(":", 1)[1]]):
        back = time.monotonic()
        while tier.get(keys) != [blob for _, blob in items]:
            assert time.monotonic() - back < 2.0, "the restarted server was not used within 2 s"
            time.sleep(0.02)
    tier.close()


def test_server_killed_mid_stream_gives_verified_blobs_then_misses():
    items = large_items(200)
    keys = [k for k, _ in items]
    proc = StoreProcess(["--no-disk", "--ram", "256MiB"])
    proc.start()
    try:
        StoreClient(proc.address, timeout_s=60).put(items)

        class KillOnFirstBlob(RemoteTier):
            def _verified(self, key: bytes, blob: bytes, lease: object = None) -> bytes | None:
                if proc.proc is not None and proc.proc.poll() is None:
                    proc.proc.send_signal(signal.SIGKILL)  # the server dies with the stream half sent
                    proc.proc.wait()
                return super()._verified(key, blob, lease)

        tier = KillOnFirstBlob([proc.address], timeout_s=10)
        start = time.monotonic()
        got = tier.get(keys)
        assert time.monotonic() - start < 10, "the client must not hang on a dead server"
        received = [i for i, b in enumerate(got) if b is not None]
        assert 0 < len(received) < len(keys), "the stream should have broken part-way"
        assert all(got[i] == items[i][1] for i in received)  # nothing corrupt, nothing out of place
        assert received == list(range(len(received)))  # a prefix of the stream, in order
        assert tier.stats().errors == 1
    finally:
        proc.stop(signal.SIGKILL)


@pytest.mark.slow
def test_two_instances_reuse_a_prefix_through_the_store(tmp_path):
    worker = Path(__file__).resolve().parents[1] / "instance_worker.py"
    env = {**os.environ, "PYTHONPATH": str(worker.parent)}
    with StoreProcess(["--disk", str(tmp_path / "store")]) as store:
        run = lambda role: subprocess.run([sys.executable, str(worker), role, store.address, str(tmp_path)],  # noqa: E731
                                          capture_output=True, text=True, env=env, timeout=300)
        a = run("put")
        assert a.returncode == 0, a.stderr
        assert json.loads(a.stdout.splitlines()[-1]) == {"stored": 992}
        b = run("get")
        assert b.returncode == 0, b.stderr
        result = json.loads(b.stdout.splitlines()[-1])
        assert result["lookup"] == result["got"] == 992
        assert result["identical"] is True
        assert result["remote_loads"] == 62 and result["remote_hits"] == 62 and result["device_hits"] == 0
        stats = StoreClient(store.address).stats()
        assert stats.tiers[0].pages == 62 and stats.tiers[0].hits >= 62


def test_the_ring_follows_servers_that_join_and_leave():
    items = make_items(60)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk"]) as a, StoreProcess(["--no-disk"]) as b:
        tier = RemoteTier([], allow_empty=True)
        assert tier.put(items) == 0 and tier.get(keys) == [None] * 60  # no server yet: misses
        assert tier.set_addresses([a.address]) and not tier.set_addresses([a.address])
        assert tier.put(items) == 60
        first = tier.servers[0]
        assert tier.set_addresses([b.address, a.address, a.address])  # b joins (order and repeats ignored)
        assert tier.addresses == sorted([a.address, b.address]) and first in tier.servers  # a kept its channel
        got = tier.get(keys)
        moved = [i for i, k in enumerate(keys) if tier.addresses[owner(k, tier.addresses)] == b.address]
        assert 0 < len(moved) < 60
        # Keys now owned by b are misses until put again; the rest are served by a, byte for byte.
        assert all(got[i] is None for i in moved)
        assert all(got[i] == items[i][1] for i in range(60) if i not in moved)
        assert tier.put(items) == 60 and tier.get(keys) == [blob for _, blob in items]
        b.kill()  # b dies: until it leaves the ring its keys read as misses, never errors
        got = tier.get(keys)
        assert all(got[i] is None for i in moved) and all(got[i] == items[i][1] for i in range(60) if i not in moved)
        assert tier.set_addresses([a.address])  # b left: its keys belong to a again, which still holds them
        assert tier.get(keys) == [blob for _, blob in items]
        tier.close()
        assert tier.get(keys) == [None] * 60


def test_a_ring_change_makes_the_chain_put_pages_to_their_new_owners():
    """What a chain knew the old ring held must not stop it writing pages to their new owners."""
    from tiered_cache.tiers.chain import TierChain

    items = make_items(40)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk"]) as a, StoreProcess(["--no-disk"]) as b:
        chain = TierChain([RemoteTier([a.address])])
        assert chain.put(items) == 40 and all(chain.known_in(k, 0) for k in keys)
        chain.put(items)
        assert chain.skipped_puts == 40  # known held: not sent again
        chain.tiers[0].set_addresses([b.address])
        chain.forget(0)
        assert not any(chain.known_in(k, 0) for k in keys)
        chain.put(items)
        assert StoreClient(b.address).lookup(keys).leading == 40
        chain.close()


def test_a_cache_republishes_its_pages_to_owners_that_joined_the_ring():
    """A shard that joins owns ~1/n of the keys; pages every instance holds locally (a shared
    system prompt) would never be written again, so the cache puts its moved pages there."""
    import torch

    from tiered_cache.cache import TieredCache
    from tiered_cache.config import CacheConfig
    from tiered_cache.index.keys import PageKeyer
    from tiered_cache.model.spec import KVSpec
    from tiered_cache.tiers.remote_servers import owner_address

    spec = KVSpec(model_id="ring-test", num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)
    with StoreProcess(["--no-disk"]) as a, StoreProcess(["--no-disk"]) as b:
        config = CacheConfig(pool_capacity=64 * spec.bytes_per_page, host_capacity=64 * spec.bytes_per_page,
                             lower_tiers=["remote"], remote_addresses=[a.address], write_policy="write_through")
        tokens = list(range(160))
        keys = PageKeyer(spec).keys(tokens)
        kv = torch.randn(2, 2, 160, 2, 8).to(spec.dtype.torch)
        with TieredCache(spec, config) as cache:
            assert cache.put(tokens, kv) == 160
            cache.flush()
            assert StoreClient(a.address).lookup(keys).leading == 40
            assert cache.set_remote_addresses([a.address, b.address])
            assert not cache.set_remote_addresses([b.address, a.address])  # same ring: nothing to do
            cache.flush()
            ring = sorted([a.address, b.address])
            moved = [owner_address(k, ring) == b.address for k in keys]
            assert 0 < sum(moved) < 40
            assert list(StoreClient(b.address).lookup(keys).tiers) == [1 if m else 0 for m in moved]
            # b leaves: its keys go back to a, which still holds them.
            assert cache.set_remote_addresses([a.address])
            cache.flush()
            assert StoreClient(a.address).lookup(keys).leading == 40
        with TieredCache(spec, config.replace(remote_addresses=(a.address, b.address))) as other:
            assert other.lookup(tokens) == 160  # a fresh instance finds every page on the new ring
    with pytest.raises(ValueError, match="no remote tier"):
        TieredCache(spec, CacheConfig(pool_capacity=4 * spec.bytes_per_page)).set_remote_addresses(["x:1"])


def test_warm_opens_the_channels_before_the_first_get_and_backs_off_a_dead_server():
    items = make_items(24)  # some owned by each server, whatever their ports
    with StoreProcess(["--no-disk"]) as store:
        StoreClient(store.address).put(items)
        dead = StoreProcess(["--no-disk"])
        dead.start()
        dead_address = dead.address
        dead.kill()
        tier = RemoteTier([store.address, dead_address], timeout_s=2.0, breaker=BreakerPolicy(cooldown_s=5.0))
        live = next(s for s in tier.servers if s.client.address == store.address)
        gone = next(s for s in tier.servers if s.client.address == dead_address)
        assert live.client._streams is None
        tier.warm()  # never raises: the dead server's breaker opens, as on any call
        assert live.client._streams is not None and live.available
        assert not gone.available and tier.stats().errors == 1
        got = tier.get([k for k, _ in items])
        assert [b is None or bytes(b) == blob for b, (_, blob) in zip(got, items, strict=True)] == [True] * 24
        assert any(b is not None for b in got)  # the live server's share arrives
        tier.close()


def test_breaker_state_of_each_server_is_in_stats():
    live = StoreProcess(["--no-disk"])
    live.start()
    try:
        dead = "127.0.0.1:1"
        tier = RemoteTier([live.address, dead], timeout_s=1.0, breaker=BreakerPolicy(cooldown_s=0.2))
        items = make_items(40)
        tier.put(items)
        stats = tier.stats()
        assert stats.breakers == {live.address: "closed", dead: "open"}
        assert (stats.open_breakers, stats.breaker_trips) == (1, 1)
        errors = stats.errors
        tier.get([k for k, _ in items])  # the dead server's keys are misses, and it is not asked
        assert tier.stats().errors == errors
        time.sleep(0.25)
        assert tier.stats().breakers[dead] == "half-open"
        tier.get([k for k, _ in items])  # the probe fails: open again, for twice as long
        assert tier.stats().breakers[dead] == "open" and tier.stats().breaker_trips == 2
        tier.close()
    finally:
        live.stop()


def test_pages_read_in_a_same_host_arena_are_told_to_the_server_when_the_reader_closes_at_once():
    """A Lookup answered from the arena's index tells the server later, in a batch; a reader that
    closes before then tells it on close, so the pages count as read there (their second chance)."""
    items = make_items(24)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk"]) as store:
        writer = RemoteTier([store.address])
        assert writer.put(items) == len(items)
        writer.close()
        reader = RemoteTier([store.address])
        reader.warm()
        assert reader.contains_prefix(keys) == len(keys)  # may be asked of the server (it maps the arena)
        hits = StoreClient(store.address).stats().tiers[0].hits
        lookups = reader.servers[0].client.arena_lookups
        assert reader.contains_prefix(keys) == len(keys)
        assert reader.servers[0].client.arena_lookups == lookups + 1  # answered in the arena: no RPC
        assert reader.get(keys) == [blob for _, blob in items]
        reader.close()  # well within the touch delay
        assert StoreClient(store.address).stats().tiers[0].hits >= hits + len(keys)
