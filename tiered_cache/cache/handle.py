"""`CacheHandle`: one request's hold on a `TieredCache`, from `match` to `release`."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiered_cache.cache.arguments import as_count
from tiered_cache.index.radix_node import RadixNode

HOST = -1  # in a handle's plan: the page is in host RAM (chain tier indices are >= 0)


@dataclass
class Prefetch:
    """Pages on their way up for a handle: `future` gives a `Loaded`; `cancel` stops it early.
    `pages`: the device pages it fills (a CPU pool: no staging), allocated for it and owned by
    it until `load` adopts them or its end frees them; None: it fills staging."""

    future: Future[Any]
    cancel: threading.Event
    pages: np.ndarray | None = None


@dataclass(eq=False)
class CacheHandle:
    """A request's hold on the cache. Use one handle from one thread at a time.

    Who owns which device pages (the cache checks every call against this):
    - `device_pages`: the matched prefix, owned by the tree, kept alive by the lock on `node`;
    - `own_pages`: allocated for this request's suffix; they belong to the handle until `commit`
      hands the fully written ones to the tree, and `release` frees what is left.
    Only `own_written` tokens of the `own_tokens` allocated hold KV the engine wrote (`write`,
    `mark_written`); `commit` never inserts a page past them.
    """

    owner: Any = field(repr=False)  # the TieredCache that issued it (checked by identity)
    namespace: str
    page_size: int
    keys: list[bytes]
    node: RadixNode
    device_pages: np.ndarray
    available_pages: int  # pages found in any tier when matched (device ones included)
    plan: list[int] = field(default_factory=list)  # per page past the device prefix: HOST or a chain tier
    own_pages: list[int] = field(default_factory=list)
    own_tokens: int = 0  # tokens the suffix pages were allocated for
    own_written: int = 0  # of those, tokens whose KV was written
    released: bool = False
    sources: Counter[str] = field(default_factory=Counter)  # tier name -> prefix pages it supplied
    loaded_from: list[str] = field(default_factory=list)  # per page `load` loaded, in order: its tier
    prefetch: Prefetch | None = field(default=None, repr=False)
    tokens: Any = field(default=None, repr=False)  # the matched token ids: pages it loads get their tokens shown
    # Retention (compaction.py): own-token indices dropped but still inside a live page, and
    # whether anything was ever dropped (then the sequence is not a reusable prefix: no commit).
    dropped: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64), repr=False)
    compacted: bool = False
    swapped: Any = field(default=None, repr=False)  # a `SwappedPages` while swapped out (swaps.py)

    @property
    def num_device_pages(self) -> int:
        return len(self.device_pages)

    @property
    def prefix_tokens(self) -> int:
        """Tokens of the matched prefix now in device pages."""
        return len(self.device_pages) * self.page_size

    @property
    def written_tokens(self) -> int:
        """Tokens whose KV is in device pages: the prefix plus what the engine wrote after it."""
        return self.prefix_tokens + self.own_written

    def committable(self, num_tokens: int, num_written: int | None) -> int:
        """How many leading tokens of the `num_tokens` given to `commit` to insert: `num_written`,
        or all of them; ValueError for tokens whose KV was not written, or for a sequence a
        retention policy compacted (its KV is no longer the KV of its tokens)."""
        if self.compacted:
            raise ValueError("commit() of a sequence a retention policy compacted: its KV is no longer the KV "
                             "of its tokens, so it is never cached as a prefix; release it")
        written = self.written_tokens
        if num_written is None:
            if num_tokens > written:
                raise ValueError(f"commit() got {num_tokens} tokens but only {written} were written "
                                 f"(write()/mark_written()); pass num_written={written} to commit the "
                                 f"written part")
            num_written = num_tokens
        num_written = as_count("num_written", num_written)
        if num_written > written:
            raise ValueError(f"commit(num_written={num_written}) but only {written} tokens of this handle "
                             f"were written ({self.prefix_tokens} matched + {self.own_written} written)")
        if num_written > num_tokens:
            raise ValueError(f"commit(num_written={num_written}) but only {num_tokens} tokens were given")
        return num_written

    def check_room(self, num_tokens: int) -> None:
        """ValueError unless `num_tokens` more tokens fit in the tokens allocated and not written."""
        if self.own_written + num_tokens > self.own_tokens:
            raise ValueError(f"writing {num_tokens} more tokens would pass the {self.own_tokens} allocated "
                             f"({self.own_written} written so far); allocate() first")
