"""A vLLM engine's KV events re-keyed by their tokens (routing/token_chain.py): engines that hash
blocks differently agree on what they hold, removals find their blocks, a block whose parent was
never told is skipped and counted; and through a real publisher, a replica's connector blocks
(medium CPU) count as the store for every replica (ClusterEvents' store mediums)."""

from __future__ import annotations

import random
import time

import pytest

from tiered_cache.events.schema import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, block_removed, block_stored
from tiered_cache.index.keys import chain_keys, root_key
from tiered_cache.workers.routing.token_chain import TokenChainIndex

ROOT = root_key("", "ab" * 32)
BLOCK = 4
TOKENS = list(range(100, 124))  # six blocks


def stored(hashes, parent, first_block, count, medium=MEDIUM_GPU):
    tokens = TOKENS[first_block * BLOCK:(first_block + count) * BLOCK]
    return block_stored(hashes[first_block:first_block + count], parent, tokens, BLOCK, medium)


def engine_events(seed: int) -> tuple[list[int], list[dict]]:
    """One engine's blocks for TOKENS, in two batches (the second chained to the first), told
    with hashes of its own (another seed: another engine)."""
    hashes = random.Random(seed).sample(range(1 << 62), 6)
    return hashes, [stored(hashes, None, 0, 2), stored(hashes, hashes[1], 2, 4)]


def test_engines_with_different_hashes_hold_the_same_chain_keys():
    keys = chain_keys(TOKENS, BLOCK, ROOT)
    for seed in (1, 2):
        index = TokenChainIndex(ROOT)
        _, events = engine_events(seed)
        index.apply(events)
        assert index.leading(keys, (MEDIUM_GPU,)) == 6
        assert index.leading(keys, (MEDIUM_CPU,)) == 0
    other = chain_keys([7, *TOKENS[1:]], BLOCK, ROOT)  # another first token: no block in common
    assert index.leading(other, (MEDIUM_GPU,)) == 0


def test_a_removal_ends_its_block_and_the_mediums_stay_apart():
    keys = chain_keys(TOKENS, BLOCK, ROOT)
    index = TokenChainIndex(ROOT)
    hashes, events = engine_events(3)
    index.apply(events)
    index.apply([stored(hashes, None, 0, 3, MEDIUM_CPU)])  # the connector saved the first three
    index.apply([block_removed([hashes[2]], MEDIUM_GPU)])
    assert index.leading(keys, (MEDIUM_GPU,)) == 2
    assert index.leading(keys, (MEDIUM_CPU,)) == 3
    assert index.leading(keys, (MEDIUM_GPU, MEDIUM_CPU)) == 6


def test_a_block_whose_parent_was_never_told_is_skipped_and_counted():
    keys = chain_keys(TOKENS, BLOCK, ROOT)
    index = TokenChainIndex(ROOT)
    _, events = engine_events(4)
    index.apply(events[1:])  # the first batch was dropped
    assert index.unkeyed == 4 and index.leading(keys, (MEDIUM_GPU,)) == 0
    index.apply(events)  # told again (a replay): every block keyed
    assert index.leading(keys, (MEDIUM_GPU,)) == 6
    index.apply([{"type": "AllBlocksCleared"}])
    assert index.leading(keys, (MEDIUM_GPU,)) == 0
    index.apply(events[1:])  # after a clear, the parents are unknown again
    assert index.leading(keys, (MEDIUM_GPU,)) == 0


def salted_root(salt: str) -> bytes:
    return root_key(salt, "ab" * 32)


@pytest.mark.parametrize("lora", [None, "adapter-1"])
def test_a_chain_under_a_cache_salt_is_keyed_under_the_salt_s_root(lora):
    """vLLM tells a salted chain's salt in its first block's extra keys (after the LoRA name):
    its blocks count for a prompt under that salt only, as the connector keys its pages."""
    hashes = random.Random(7).sample(range(1 << 62), 6)
    first = block_stored(hashes[:2], None, TOKENS[:2 * BLOCK], BLOCK, MEDIUM_GPU,
                         extra_keys=[(*([lora] if lora else []), "tenant-x"), None], lora_name=lora)
    index = TokenChainIndex(ROOT, salted=salted_root)
    index.apply([first, stored(hashes, hashes[1], 2, 4)])
    assert index.leading(chain_keys(TOKENS, BLOCK, salted_root("tenant-x")), (MEDIUM_GPU,)) == 6
    assert index.leading(chain_keys(TOKENS, BLOCK, salted_root("tenant-y")), (MEDIUM_GPU,)) == 0
    assert index.leading(chain_keys(TOKENS, BLOCK, ROOT), (MEDIUM_GPU,)) == 0
    unsalted = TokenChainIndex(ROOT)  # no root for salted chains: skipped and counted, never guessed
    unsalted.apply([first])
    assert unsalted.unkeyed == 2 and len(unsalted) == 0


def test_short_token_lists_and_the_remembered_hashes_stay_bounded():
    index = TokenChainIndex(ROOT, max_known=3)
    hashes, events = engine_events(5)
    index.apply([block_stored(hashes[:2], None, TOKENS[:BLOCK], BLOCK, MEDIUM_GPU)])  # tokens for one block
    assert index.unkeyed == 2 and len(index) == 0
    index.apply(events)
    assert len(index._key_of) == 3  # the oldest hashes forgotten first
    index.apply([block_removed(hashes[:3], MEDIUM_GPU)])  # forgotten: nothing to end
    assert index.leading(chain_keys(TOKENS, BLOCK, ROOT), (MEDIUM_GPU,)) == 6


def test_through_a_publisher_a_replicas_connector_blocks_are_the_stores():
    pytest.importorskip("zmq")
    from tiered_cache.events.publisher import EventPublisher
    from tiered_cache.workers.routing.event_index import ClusterEvents

    keys = chain_keys(TOKENS, BLOCK, ROOT)
    events = ClusterEvents(index=lambda: TokenChainIndex(ROOT), host_mediums=(),
                           store_mediums=(MEDIUM_STORAGE, MEDIUM_CPU))
    a = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    b = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    try:
        hashes, batches = engine_events(6)
        a.publish(batches[:1])  # on A's device: two blocks, before anyone subscribed (replayed)
        a.publish([stored(hashes, None, 0, 4, MEDIUM_CPU)])  # A's connector saved four
        events.watch("a", a.endpoint, a.replay_endpoint)
        events.watch("b", b.endpoint, b.replay_endpoint)
        deadline = time.monotonic() + 10  # the replay and the live batch arrive on their own threads
        while events.holdings("a", keys).store < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        held_a, held_b = events.holdings("a", keys), events.holdings("b", keys)
        assert (held_a.device, held_a.host, held_a.store) == (2, 0, 2)
        assert (held_b.device, held_b.host, held_b.store) == (0, 0, 4)  # B loads A's saves from the store
    finally:
        events.close()
        a.close()
        b.close()
