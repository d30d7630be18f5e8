"""`CacheEvents`: one cache's page moves as KV events (schema.py), handed to a publisher.

The cache calls it where a medium gains or loses pages: the radix tree (device pages stored when a
prefix is inserted, removed when a leaf is evicted), host RAM (stored when a page is written into
it, removed when it is evicted or deleted) and the tier chain (STORAGE: a lower tier known to hold
a page, or known no longer to). Every call is one batch queued without blocking (the publisher
drops and counts when nobody drains it), so the request path pays for a few small dicts.

Block hashes are our page keys (32 bytes of the SHA-256 chain, DESIGN.md §4): a device insert
names its parent key so an index can rebuild the chain; token ids go with a block when the cache
still remembers them (`tokens_of`), so a subscriber that hashes tokens itself can too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tiered_cache.events.endpoints import replay_endpoint_for
from tiered_cache.events.publisher import EventPublisher
from tiered_cache.events.schema import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    all_blocks_cleared,
    block_removed,
    block_stored,
)

HEARTBEAT_S = 1.0  # a quiet cache still publishes (an empty batch) this often: routers tell it from a dead one
TokensOf = Callable[[bytes], Any]  # a page key -> its token ids, or None when forgotten


class CacheEvents:
    def __init__(self, publisher: EventPublisher, page_size: int, tokens_of: TokensOf | None = None) -> None:
        self.publisher = publisher
        self.page_size = page_size
        self.tokens_of = tokens_of
        publisher.publish([all_blocks_cleared()])  # a fresh cache: nothing an earlier one held is here

    @classmethod
    def open(cls, endpoint: str, page_size: int, replay_endpoint: str | None = None, topic: str = "",
             beyond_loopback: bool = False, tokens_of: TokensOf | None = None) -> CacheEvents:
        """A publisher bound on `endpoint` (replay on the next port unless given)."""
        publisher = EventPublisher(endpoint, replay_endpoint or replay_endpoint_for(endpoint), topic=topic,
                                   beyond_loopback=beyond_loopback, heartbeat_s=HEARTBEAT_S)
        return cls(publisher, page_size, tokens_of)

    def watch(self, tree: Any, host: Any, chain: Any) -> None:
        """Hook a cache's radix tree (the device pool: GPU, as vLLM names the engine's KV pool, on
        whatever device it lies), host RAM (CPU) and tier chain (STORAGE)."""
        tree.on_insert = lambda _ns, keys, parent: self.stored(keys, MEDIUM_GPU, parent)
        tree.on_remove = lambda keys: self.removed(keys, MEDIUM_GPU)
        host.on_change = lambda keys, held: self.stored(keys, MEDIUM_CPU) if held else self.removed(keys, MEDIUM_CPU)
        chain.on_change = self.chain_changed

    def stored(self, keys: Sequence[bytes], medium: str, parent: bytes | None = None,
               block_size: int | None = None) -> None:
        """`keys` now held in `medium`; `parent`: the key before the first one when they chain;
        `block_size`: tokens per page when not the cache's (a store holds any model's pages)."""
        if keys:
            size = self.page_size if block_size is None else block_size
            self.publisher.publish([block_stored(list(keys), parent, self._tokens(keys), size, medium)])

    def removed(self, keys: Sequence[bytes], medium: str) -> None:
        if keys:
            self.publisher.publish([block_removed(list(keys), medium)])

    def chain_changed(self, keys: Sequence[bytes], held: bool) -> None:
        """A lower tier is known to hold `keys` now (or known not to)."""
        if held:
            self.stored(keys, MEDIUM_STORAGE)
        else:
            self.removed(keys, MEDIUM_STORAGE)

    def cleared(self) -> None:
        self.publisher.publish([all_blocks_cleared()])

    def _tokens(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks' token ids, all of them or none (a subscriber checks the length)."""
        if self.tokens_of is None:
            return []
        tokens: list[int] = []
        for key in keys:
            page = self.tokens_of(key)
            if page is None:
                return []
            tokens.extend(page.tolist() if hasattr(page, "tolist") else page)  # numpy: one call, not one a token
        return tokens

    def close(self) -> None:
        """Everything this cache held is gone: say so, send what is queued, close the sockets."""
        self.cleared()
        self.publisher.close()


def open_events(config: Any, page_size: int, tokens_of: TokensOf | None = None) -> CacheEvents | None:
    """A `CacheConfig`'s KV events (`kv_events_*`), or None when `kv_events_endpoint` is unset."""
    if config.kv_events_endpoint is None:
        return None
    return CacheEvents.open(config.kv_events_endpoint, page_size, config.kv_events_replay_endpoint,
                            config.kv_events_topic, config.kv_events_beyond_loopback, tokens_of)
