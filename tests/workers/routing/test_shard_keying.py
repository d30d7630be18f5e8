"""A router reading a real store shard's events finds a prompt's blocks there when it keys the
prompt with the connector's chain (`BlockTiers.keying` -> `connector_chain`), whether the
connector stores a block as one page or one page per layer group; keyed by its own chain it finds
none. This is what lets the Serve router count pages no live replica told (a restarted replica,
an earlier deployment)."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("zmq")

from tiered_cache.config import CacheConfig
from tiered_cache.events.publisher import EventPublisher
from tiered_cache.events.schema import MEDIUM_CPU, MEDIUM_STORAGE
from tiered_cache.index.keys import chain_keys, root_key
from tiered_cache.integrations.vllm.block_tiers import BlockTiers
from tiered_cache.model.spec import DType, KVSpec, Layout
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.wire.codec import encode_page
from tiered_cache.workers.routing.event_index import ClusterEvents
from tiered_cache.workers.routing.token_chain import TokenChainIndex, connector_chain

BLOCK = 4
TOKENS = list(range(300, 324))  # six blocks
SAVED = 4  # blocks a connector saved to the store


def _saved(tiers: BlockTiers) -> list[tuple[bytes, bytes]]:
    """The store pages of the first SAVED blocks, keyed as the connector keys them."""
    keys = tiers.all_page_keys(tiers.keys(TOKENS, "")[:SAVED])
    pages = torch.randn(tiers.spec.staging_shape(len(keys)), generator=torch.Generator().manual_seed(0)).half()
    return [(k, encode_page(p, tiers.spec, k)) for k, p in zip(keys, pages, strict=True)]


def _stored(events: ClusterEvents, keys: list[bytes], want: int) -> int:
    deadline = time.monotonic() + 10  # the shard's batches arrive on the subscriber's thread
    while events.holdings("replica", keys).store < want and time.monotonic() < deadline:
        time.sleep(0.05)
    return events.holdings("replica", keys).store


@pytest.mark.parametrize("groups", [1, 2])
def test_the_shards_pages_count_for_a_prompt_keyed_by_the_connectors_chain(groups):
    spec = KVSpec(model_id="shard-keying", num_layers=4, num_kv_heads=2, head_dim=8, dtype=DType.parse("float16"),
                  page_size=BLOCK, layout=Layout.HND)
    tiers = BlockTiers(spec, CacheConfig(host_capacity=1 << 20), layers_per_page=spec.num_layers // groups)
    keying = tiers.keying("")
    assert keying["groups"] == groups
    root, shard_keys = connector_chain(keying)
    replica = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")  # a replica that holds nothing
    events = ClusterEvents(index=lambda: TokenChainIndex(root), host_mediums=(),
                           store_mediums=(MEDIUM_STORAGE, MEDIUM_CPU))
    events.shard_keys = shard_keys
    with StoreProcess(["--no-disk", "--shm", "off", "--kv-events", "tcp://127.0.0.1:0"]) as store:
        try:
            tier = RemoteTier([store.address], fingerprint=bytes.fromhex(tiers.spec.fingerprint), shm=False)
            assert tier.put(_saved(tiers)) == SAVED * groups  # pages stored
            events.watch("replica", replica.endpoint, replica.replay_endpoint)
            events.watch("shard-0", store.events_endpoint, store.replay_endpoint, shard=True)
            # The router keys a prompt from the chain's root over blocks of the connector's size.
            keys = chain_keys(TOKENS, int(keying["page_size"]), root)
            assert keys[:SAVED] == tiers.keys(TOKENS, "")[:SAVED]
            held = _stored(events, keys, SAVED)
            assert (events.holdings("replica", keys).device, held) == (0, SAVED)
            # Keyed by another chain (the router's own, no connector said one) the store holds none of it.
            other = chain_keys(TOKENS, BLOCK, root_key("", "cd" * 32))
            assert events.holdings("replica", other).store == 0
        finally:
            events.close()
            replica.close()
