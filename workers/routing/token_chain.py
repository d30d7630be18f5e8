"""`TokenChainIndex`: a `BlockIndex` over vLLM engines' KV events, keyed by what the tokens are.

A vLLM engine tells its blocks by its own block hashes, which depend on its hash function and
seed; a router keys a prompt itself. Every `BlockStored` event also carries the blocks' token ids
and their parent's hash, so this index re-keys each block as our page-key chain over its tokens
(index/keys.py, from `root`, or from its cache salt's root: the salt is the connector's namespace)
and remembers which chain key each engine hash stands for: removals and children find it there.
A block whose parent it never saw (its `BlockStored` dropped, or told before the subscription
started and not replayed) cannot be keyed, is skipped and counted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tiered_cache.events.block_index import BlockIndex
from tiered_cache.index.keys import chain_keys, root_key
from tiered_cache.integrations.vllm.layer_groups import group_keys

MAX_KNOWN = 1 << 18  # engine hashes remembered (about 20 MiB): older ones are forgotten first


def connector_chain(keying: Mapping[str, Any]) -> tuple[bytes, Callable[[Sequence[bytes]], Sequence[bytes]]]:
    """For a reader of store shards' events under our vLLM connector: the chain's root its blocks
    are keyed from, and the keys a shard tells for a prompt's block keys (each block's first layer
    group's page stands for it). `keying` is what the connector says (`BlockTiers.keying`)."""
    root = root_key(str(keying["namespace"]), str(keying["fingerprint"]))
    groups = int(keying.get("groups") or 1)
    if groups == 1:
        return root, list
    return root, lambda keys: group_keys(keys, groups, 0)


def salt_of(event: Mapping[str, Any]) -> str | None:
    """The cache salt a vLLM `BlockStored` event's first block was hashed with (its `extra_keys`:
    the LoRA name first when one is set, `(mm id, offset)` pairs, then the salt), else None."""
    extra = event.get("extra_keys") or ()
    first = extra[0] if extra else None
    strings = [k for k in first or () if isinstance(k, str)]
    if event.get("lora_name"):
        strings = strings[1:]
    return strings[0] if strings else None


class TokenChainIndex(BlockIndex):
    def __init__(self, root: bytes, max_known: int = MAX_KNOWN,
                 salted: Callable[[str], bytes] | None = None) -> None:
        """`root`: where a chain of unsalted blocks starts; `salted`: where a chain under a cache
        salt starts (the connector keys a salted request's pages in the salt's namespace); None:
        salted chains are not keyed (skipped, counted)."""
        super().__init__()
        self.root = root
        self.salted = salted
        self.max_known = max_known
        self.unkeyed = 0  # blocks skipped: their parent's chain key was unknown
        self._key_of: OrderedDict[Any, bytes] = OrderedDict()  # engine block hash -> chain key

    def apply(self, events: Iterable[dict[str, Any]]) -> None:
        super().apply([e for event in events if (e := self._rekeyed(event)) is not None])

    def clear(self) -> None:
        super().clear()
        self._key_of.clear()

    def _rekeyed(self, event: dict[str, Any]) -> dict[str, Any] | None:
        kind = event.get("type")
        hashes = list(event.get("block_hashes") or ())
        if kind == "BlockStored":
            return self._stored(event, hashes)
        if kind == "BlockRemoved":
            keys = [self._key_of[h] for h in hashes if h in self._key_of]
            return {**event, "block_hashes": keys}
        if kind == "AllBlocksCleared":
            self._key_of.clear()
        return event

    def _stored(self, event: dict[str, Any], hashes: list[Any]) -> dict[str, Any] | None:
        parent_hash = event.get("parent_block_hash")
        if parent_hash is None:
            salt = salt_of(event)
            parent = self.root if salt is None else self.salted(salt) if self.salted else None
        else:
            parent = self._key_of.get(parent_hash)
        size = int(event.get("block_size") or 0)
        tokens = list(event.get("token_ids") or ())
        if parent is None or size <= 0 or len(tokens) < size * len(hashes):
            self.unkeyed += len(hashes)
            return None
        keys = chain_keys(tokens[:size * len(hashes)], size, parent)
        for block_hash, key in zip(hashes, keys, strict=True):
            self._key_of[block_hash] = key
            self._key_of.move_to_end(block_hash)
        while len(self._key_of) > self.max_known:
            self._key_of.popitem(last=False)
        return {**event, "block_hashes": keys}
