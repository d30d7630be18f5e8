"""`BlockIndex`: what one publisher's KV events say it holds, by block hash and medium.

Applying batches in order leaves the index as the publisher's tiers are (up to what its bounded
queue dropped: a hint, never a promise; whoever reads a page checks it). `leading` answers a
router's question: how many leading pages of a prompt does this source hold in a medium?
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any


class BlockIndex:
    def __init__(self) -> None:
        self._held: dict[Any, set[str]] = {}  # block hash -> mediums that hold it
        self._lock = threading.Lock()
        self.events = 0

    def apply(self, events: Iterable[dict[str, Any]]) -> None:
        """One batch's events (schema.py's maps), in order."""
        with self._lock:
            for event in events:
                self.events += 1
                kind = event.get("type")
                medium = event.get("medium") or ""
                if kind == "BlockStored":
                    for block in event.get("block_hashes", ()):
                        self._held.setdefault(block, set()).add(medium)
                elif kind == "BlockRemoved":
                    for block in event.get("block_hashes", ()):
                        mediums = self._held.get(block)
                        if mediums is not None:
                            mediums.discard(medium)
                            if not mediums:
                                del self._held[block]
                elif kind == "AllBlocksCleared":
                    self._held.clear()

    def clear(self) -> None:
        with self._lock:
            self._held.clear()

    def leading(self, blocks: Sequence[Any], mediums: Iterable[str]) -> int:
        """How many of `blocks`, from the first, are held in any of `mediums`."""
        wanted = set(mediums)
        with self._lock:
            for i, block in enumerate(blocks):
                if wanted.isdisjoint(self._held.get(block, ())):
                    return i
        return len(blocks)

    def mediums(self, block: Any) -> set[str]:
        with self._lock:
            return set(self._held.get(block, ()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)
