"""A store server started with `--kv-events` tells subscribers which pages it holds: what Puts
store, not what moves between its own RAM and disk, and what leaves it for good; a restarted
server tells what its disk still holds. vLLM's own decoder reads it too."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("zmq")

from service_helpers import FINGERPRINT, SPEC, make_items
from test_publisher import replay
from vllm_events import vllm_index

from tiered_cache.events.block_index import BlockIndex
from tiered_cache.events.schema import MEDIUM_STORAGE
from tiered_cache.events.subscriber import EventSubscriber
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.remote import RemoteTier

PAGES = 1400  # 2 KiB pages: past a 1 MiB RAM tier and a 1 MiB disk tier together


def _store(folder) -> StoreProcess:
    return StoreProcess(["--ram", "1MiB", "--disk", str(folder), "--disk-capacity", "1MiB", "--shm", "off",
                         "--kv-events", "tcp://127.0.0.1:0"])


def _settled(index: BlockIndex, keys: list[bytes], held: list[bool]) -> set[bytes]:
    """The keys the index says are stored, once it agrees with `held` (or after 10 s)."""
    want = {k for k, h in zip(keys, held, strict=True) if h}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        learned = {k for k in keys if MEDIUM_STORAGE in index.mediums(k)}
        if learned == want:
            break
        time.sleep(0.05)
    return learned


def test_the_index_of_a_store_s_events_holds_what_the_store_holds(tmp_path):
    items = make_items(PAGES)
    keys = [k for k, _ in items]
    index = BlockIndex()
    with _store(tmp_path) as store:
        sub = EventSubscriber(store.events_endpoint, store.replay_endpoint, index.apply, index.clear).start()
        tier = RemoteTier([store.address], fingerprint=FINGERPRINT, shm=False)
        try:
            for start in range(0, PAGES, 100):
                tier.put(items[start:start + 100])
            held = tier.contains(keys)
            assert 0 < sum(held) < PAGES  # some pages left the store for good, some stayed
            learned = _settled(index, keys, held)
            assert learned == {k for k, h in zip(keys, held, strict=True) if h}
            assert len(vllm_index(store.replay_endpoint)) == sum(held)  # vLLM's decoder agrees
        finally:
            tier.close()
            sub.close()
    assert "KV events at tcp://127.0.0.1:" in "\n".join(store.output)

    # A restarted server tells subscribers what its disk still holds, with each page's size in tokens.
    index = BlockIndex()
    told: list[dict] = []

    def apply(events: list[dict]) -> None:
        told.extend(events)
        index.apply(events)

    with _store(tmp_path) as store:
        sub = EventSubscriber(store.events_endpoint, store.replay_endpoint, apply, index.clear).start()
        tier = RemoteTier([store.address], fingerprint=FINGERPRINT, shm=False)
        try:
            held = tier.contains(keys)
            assert any(held)
            assert _settled(index, keys, held) == {k for k, h in zip(keys, held, strict=True) if h}
            sizes = {e["block_size"] for e in told if e["type"] == "BlockStored"}
            assert sizes == {SPEC.page_size}
        finally:
            tier.close()
            sub.close()


def test_an_events_endpoint_beyond_loopback_needs_a_server_beyond_loopback():
    from tiered_cache.server.config import ServerConfig

    with pytest.raises(ValueError, match=r"beyond loopback.*--host with --token"):  # the way `serve` has
        ServerConfig(kv_events="tcp://0.0.0.0:5558", disk_path="")
    assert ServerConfig(host="0.0.0.0", token="t" * 16, kv_events="tcp://0.0.0.0:5558", disk_path="").kv_events


def _follow_as_vllm_example(endpoint: str, replay_endpoint: str, index: BlockIndex, stop: threading.Event) -> None:
    """A subscriber as vLLM's example writes it: live batches, the replay asked only when a number
    skips ahead of the last one read (no replay at start, none when numbers go back)."""
    import zmq

    from tiered_cache.events.schema import decode_batch

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RECONNECT_IVL, 2000)  # a slow reconnect: a restarted server's first batches go unseen
    sub.connect(endpoint)  # ZMQ reconnects by itself when the server comes back
    last = -1
    try:
        while not stop.is_set():
            if not sub.poll(100):
                continue
            _, number, payload = sub.recv_multipart()
            seq = int.from_bytes(number, "big")
            if last >= 0 and seq > last + 1:
                for kept, batch in replay(replay_endpoint, last + 1):
                    index.apply(decode_batch(batch)[1])
                    last = kept
                if seq <= last:
                    continue
            index.apply(decode_batch(payload)[1])
            last = seq
    finally:
        sub.close()


def test_a_subscriber_that_replays_only_on_a_gap_learns_what_a_restarted_server_holds(tmp_path):
    from tiered_cache.bench.redis_process import free_ports

    items = make_items(40)
    keys = [k for k, _ in items]
    events_port, replay_port = free_ports(2)
    args = ["--ram", "1MiB", "--disk", str(tmp_path), "--shm", "off", "--write-through",
            "--kv-events", f"tcp://127.0.0.1:{events_port}", "--kv-events-replay", f"tcp://127.0.0.1:{replay_port}"]
    index, stop = BlockIndex(), threading.Event()
    store = StoreProcess(args)
    store.start()
    follower = threading.Thread(target=_follow_as_vllm_example, daemon=True,
                                args=(store.events_endpoint, store.replay_endpoint, index, stop))
    follower.start()
    try:
        tier = RemoteTier([store.address], fingerprint=FINGERPRINT, shm=False)
        deadline = time.monotonic() + 10  # until the subscriber has joined: puts it sees live
        while not index.leading(keys, [MEDIUM_STORAGE]) and time.monotonic() < deadline:
            tier.put(items)
            time.sleep(0.2)
        tier.close()
        assert index.leading(keys, [MEDIUM_STORAGE]) == len(keys)
        before = index.events
        store.kill()  # gone without a word; back on the same endpoints with what its disk holds
        store = StoreProcess(args)
        store.start()
        # The restarted server's first batches (AllBlocksCleared, its disk's pages) go out before the
        # subscriber has reconnected (it retries every 2 s); its next batch (a heartbeat) numbers past
        # the old server's, so the subscriber asks the replay and reads them.
        deadline = time.monotonic() + 30
        while index.events < before + 2:  # AllBlocksCleared and the disk's pages, at least
            assert time.monotonic() < deadline, "the subscriber learned nothing from the restarted server"
            time.sleep(0.1)
        assert index.leading(keys, [MEDIUM_STORAGE]) == len(keys)
    finally:
        stop.set()
        follower.join(timeout=5)
        store.stop()
