"""A `TieredCache` with `kv_events_endpoint` tells subscribers where every page is: after puts
that overflow a small device pool into host RAM and host RAM into a disk tier, an index built from
its events (ours, and vLLM's own decoder in .venv-vllm) holds exactly the pages each tier holds;
closing the cache clears it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("zmq")

from vllm_events import vllm_index

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.events.block_index import BlockIndex
from tiered_cache.events.schema import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE
from tiered_cache.events.subscriber import EventSubscriber
from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec

SPEC = KVSpec("events-test", 2, 1, 8, page_size=4)
PROMPTS = [[seed * 1000 + i for i in range(24)] for seed in range(6)]  # 6 pages each


def _cache(tmp_path: Path) -> TieredCache:
    config = CacheConfig(pool_capacity=16 * SPEC.bytes_per_page, host_capacity=10 * SPEC.bytes_per_page,
                         lower_tiers=["disk"], disk_path=str(tmp_path), kv_events_endpoint="tcp://127.0.0.1:0")
    return TieredCache(SPEC, config)


def _fill(cache: TieredCache) -> None:
    for tokens in PROMPTS:
        cache.put(tokens, torch.randn(SPEC.kv_shape(len(tokens))).half())
    cache.get(PROMPTS[0])  # back up from wherever it went
    assert cache.flush(30)


def _truth(cache: TieredCache) -> dict[str, set[bytes]]:
    """Which page keys each medium holds, read from the cache itself."""
    keys = [k for tokens in PROMPTS for k in PageKeyer(SPEC).keys(tokens)]
    device: set[bytes] = set()
    stack = cache.tree.branches("")
    while stack:
        node = stack.pop()
        device.update(node.keys)
        stack.extend(node.children.values())
    below = cache.chain.known_anywhere(keys)
    return {MEDIUM_GPU: device, MEDIUM_CPU: set(cache.host.index),
            MEDIUM_STORAGE: {k for k, held in zip(keys, below, strict=True) if held}}


def _learned(index: BlockIndex, keys: list[bytes]) -> dict[str, set[bytes]]:
    return {m: {k for k in keys if m in index.mediums(k)} for m in (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)}


def _caught_up(cache: TieredCache, sub: EventSubscriber) -> None:
    deadline = time.monotonic() + 10
    publisher = cache.events.publisher
    while sub.next_seq < publisher.first_seq + publisher.published or not publisher._queue.empty():
        assert time.monotonic() < deadline, f"read up to {sub.next_seq} of {publisher.published} batches"
        time.sleep(0.02)


def test_an_index_of_the_events_holds_what_every_tier_holds_and_a_closed_cache_clears_it(tmp_path):
    index = BlockIndex()
    cache = _cache(tmp_path)
    publisher = cache.events.publisher
    sub = EventSubscriber(publisher.endpoint, publisher.replay_endpoint, index.apply, index.clear).start()
    try:
        _fill(cache)
        _caught_up(cache, sub)
        truth = _truth(cache)
        keys = [k for tokens in PROMPTS for k in PageKeyer(SPEC).keys(tokens)]
        assert _learned(index, keys) == truth
        # Pages moved down and some left each tier, so every medium's events were really checked.
        assert all(truth.values()) and len(truth[MEDIUM_GPU]) < len(keys) and len(truth[MEDIUM_CPU]) < len(keys)
        assert truth[MEDIUM_STORAGE] - truth[MEDIUM_CPU] and publisher.dropped == 0
        cache.close()
        deadline = time.monotonic() + 10
        while len(index):
            assert time.monotonic() < deadline, f"{len(index)} pages still indexed after the cache closed"
            time.sleep(0.02)
    finally:
        sub.close()
        cache.close()


def test_device_events_chain_from_their_parent_and_carry_their_tokens(tmp_path):
    seen: list[dict] = []
    with _cache(tmp_path) as cache:
        publisher = cache.events.publisher
        sub = EventSubscriber(publisher.endpoint, publisher.replay_endpoint, seen.extend).start()
        try:
            cache.put(PROMPTS[0][:16], torch.randn(SPEC.kv_shape(16)).half())
            cache.put(PROMPTS[0], torch.randn(SPEC.kv_shape(24)).half())  # 2 more pages after the first 4
            _caught_up(cache, sub)
        finally:
            sub.close()
    keys = PageKeyer(SPEC).keys(PROMPTS[0])
    gpu = [e for e in seen if e["type"] == "BlockStored" and e["medium"] == MEDIUM_GPU]
    assert seen[0]["type"] == "AllBlocksCleared"  # a new cache says so first
    assert [e["block_hashes"] for e in gpu] == [keys[:4], keys[4:]]
    assert gpu[0]["parent_block_hash"] is None and gpu[1]["parent_block_hash"] == keys[3]
    assert gpu[1]["token_ids"] == PROMPTS[0][16:] and gpu[1]["block_size"] == SPEC.page_size


def test_a_subscriber_that_starts_late_learns_everything_from_the_replay(tmp_path):
    index = BlockIndex()
    with _cache(tmp_path) as cache:
        _fill(cache)
        publisher = cache.events.publisher
        sub = EventSubscriber(publisher.endpoint, publisher.replay_endpoint, index.apply, index.clear).start()
        try:
            _caught_up(cache, sub)
            keys = [k for tokens in PROMPTS for k in PageKeyer(SPEC).keys(tokens)]
            assert _learned(index, keys) == _truth(cache) and sub.replays >= 1
        finally:
            sub.close()


def test_events_are_off_by_default_and_a_bad_endpoint_is_named():
    with TieredCache(SPEC, CacheConfig(pool_capacity="64KiB")) as cache:
        assert cache.events is None and cache.tree.on_insert is None
    with pytest.raises(ValueError, match=r"beyond loopback.*set kv_events_beyond_loopback"):
        CacheConfig(kv_events_endpoint="tcp://0.0.0.0:5557")
    assert CacheConfig(kv_events_endpoint="tcp://0.0.0.0:5557", kv_events_beyond_loopback=True).kv_events_endpoint
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        CacheConfig(kv_events_endpoint="127.0.0.1:5557")


@pytest.mark.long  # a vLLM process (make test-long); test_store_events.py runs vLLM's decoder in make test
def test_vllm_s_own_subscriber_learns_what_the_cache_holds(tmp_path):
    index = BlockIndex()
    with _cache(tmp_path) as cache:
        _fill(cache)
        publisher = cache.events.publisher
        sub = EventSubscriber(publisher.endpoint, publisher.replay_endpoint, index.apply).start()
        try:
            _caught_up(cache, sub)
        finally:
            sub.close()
        held = vllm_index(publisher.replay_endpoint)
        truth = _truth(cache)
    for medium, keys in truth.items():
        assert {h for h, mediums in held.items() if medium in mediums} == {k.hex() for k in keys}, medium
