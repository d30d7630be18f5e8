"""`PageTokens`: the token ids of recently inserted pages, so `tiered-cache tree` can show a
node's text."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class PageTokens:
    """The token ids of recently inserted pages, by page key (at most `capacity` pages): enough to
    show a node's text; a page it forgot is shown without."""

    def __init__(self, capacity: int = 1 << 15) -> None:
        self.capacity = capacity
        self._tokens: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def record(self, keys: Sequence[bytes], tokens: np.ndarray, page_size: int, first: int = 0) -> None:
        """Remember pages `first..` of a sequence: page i holds tokens[i*page_size:(i+1)*page_size]
        (a page remembered already is only marked as recent)."""
        for i in range(first, len(keys)):
            if keys[i] in self._tokens:
                self._tokens.move_to_end(keys[i])
            else:
                self._tokens[keys[i]] = tokens[i * page_size:(i + 1) * page_size].copy()
        while len(self._tokens) > self.capacity:
            self._tokens.popitem(last=False)

    def get(self, key: bytes) -> np.ndarray | None:
        return self._tokens.get(key)
