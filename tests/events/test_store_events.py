"""A store server started with `--kv-events` tells subscribers which pages it holds: what Puts
store, not what moves between its own RAM and disk, and what leaves it for good; a restarted
server tells what its disk still holds. vLLM's own decoder reads it too."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("zmq")

from service_helpers import FINGERPRINT, SPEC, make_items
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
