"""`BlockEvents`: the connector's blocks as vLLM KV events, handed to vLLM's own publisher.

vLLM's scheduler asks its connector for events each step (`take_events`) and publishes them with
its own GPU blocks on its `KVEventsConfig` endpoint, so a subscriber to vLLM (Dynamo's KV router,
llm-d's scorer) sees where else a block lies. Our blocks carry vLLM's own block hashes (the
request's `block_hashes`, as vLLM converts them for its events), its token ids and parent, with
medium "CPU": in tiered-cache's tiers (host RAM or below). A block is told as stored when the
scheduler hands its save to the worker (every token computed), and as removed when no tier holds
any page of it any more (the tier chain's `on_change`). Scheduler side only; thread-safe (the
chain tells removals from its writer thread).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

MEDIUM = "CPU"
_MAX_KNOWN = 1 << 17  # page keys whose vLLM block hash is remembered, for removals


class BlockEvents:
    def __init__(self, page_keys: Callable[[Sequence[bytes]], list[bytes]]) -> None:
        """`page_keys`: a block key -> the keys of its pages (its layer groups) in the tiers."""
        self._page_keys = page_keys
        self._pending: list[Any] = []
        self._hash_of: OrderedDict[bytes, Any] = OrderedDict()  # page key -> vLLM's block hash
        self._lock = threading.Lock()

    def saved(self, request: Any, first: int, keys: Sequence[bytes], block_size: int) -> None:
        """Blocks `first`, `first + 1`, ... of `request` (keys `keys`) go to our tiers."""
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        hashes = list(getattr(request, "block_hashes", None) or [])
        if len(hashes) < first + len(keys):
            return  # vLLM hashed fewer blocks (no prefix caching): no hash to tell them by
        external = [maybe_convert_block_hash(h) for h in hashes[first:first + len(keys)]]
        parent = maybe_convert_block_hash(hashes[first - 1]) if first else None
        tokens = list(request.all_token_ids[first * block_size:(first + len(keys)) * block_size])
        lora = getattr(request, "lora_request", None)
        extra: dict[str, Any] = {}
        salt = getattr(request, "cache_salt", None)
        if salt and not first and "extra_keys" in BlockStored.__struct_fields__:
            # The salt, as vLLM tells it on a chain's first block: a reader keys the chain under it.
            extra["extra_keys"] = [(*((lora.name,) if lora else ()), salt), *[None] * (len(keys) - 1)]
        event = BlockStored(block_hashes=external, parent_block_hash=parent, token_ids=tokens, block_size=block_size,
                            lora_id=lora.adapter_id if lora else None, medium=MEDIUM,
                            lora_name=lora.name if lora else None, **extra)
        with self._lock:
            for key, block_hash in zip(keys, external, strict=True):
                for page in self._page_keys([key]):
                    self._hash_of[page] = block_hash
                    self._hash_of.move_to_end(page)
            while len(self._hash_of) > _MAX_KNOWN:
                self._hash_of.popitem(last=False)
            self._pending.append(event)

    def chain_changed(self, page_keys: Sequence[bytes], held: bool) -> None:
        """The tier chain's `on_change`: pages no tier holds any more end their blocks."""
        if held:
            return
        from vllm.distributed.kv_events import BlockRemoved

        with self._lock:
            gone = list(dict.fromkeys(h for k in page_keys if (h := self._hash_of.pop(k, None)) is not None))
            if gone:
                self._pending.append(BlockRemoved(block_hashes=gone, medium=MEDIUM))

    def take(self) -> list[Any]:
        with self._lock:
            events, self._pending = self._pending, []
        return events
