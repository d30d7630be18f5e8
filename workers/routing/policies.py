"""The policies that route on prompt text (Ray-free): where should a prompt go?

- `PrefixAwarePolicy` (SGLang's cache-aware routing, in our words): when in-flight requests are
  imbalanced beyond both thresholds, the least-loaded worker ("balance"); else the worker whose
  recorded prefix covers at least `cache_threshold` of the prompt ("prefix"); else the worker with
  the least recorded ("least_cached"), so new documents spread out. The chosen worker is recorded
  as holding the prompt: what it was sent is what it will cache.
- `RoundRobinPolicy`: the next live worker in name order, for comparison.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Mapping

from tiered_cache.workers.routing.policy import Decision, Prompt, RoutingPolicy, require_workers
from tiered_cache.workers.routing.prefix_tree import ApproxPrefixTree


class RoundRobinPolicy(RoutingPolicy):
    def __init__(self) -> None:
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def choose(self, text: str, loads: Mapping[str, int], prompt: Prompt | None = None,
               chat: bool = True) -> Decision:
        require_workers(loads)
        names = sorted(loads)
        with self._lock:
            turn = next(self._turn)
        return Decision(names[turn % len(names)], "round_robin", 0)


class PrefixAwarePolicy(RoutingPolicy):
    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 4,
                 balance_rel_threshold: float = 1.5, max_tree_chars: int = 1_000_000,
                 evict_every: int = 256) -> None:
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_chars = max_tree_chars
        self.evict_every = evict_every  # requests between two prunings of the tree
        self.tree = ApproxPrefixTree()
        self._inserts = itertools.count(1)

    def remove_worker(self, name: str) -> None:
        self.tree.remove_worker(name)

    def observe(self, worker: str, texts: Iterable[str]) -> None:
        for text in texts:
            self._record(text, worker)

    def choose(self, text: str, loads: Mapping[str, int], prompt: Prompt | None = None,
               chat: bool = True) -> Decision:
        require_workers(loads)
        most, least = max(loads.values()), min(loads.values())
        if most - least > self.balance_abs_threshold and most > self.balance_rel_threshold * least:
            worker = min(loads, key=lambda w: (loads[w], w))
            decision = Decision(worker, "balance", self.tree.matched_chars(text, worker))
        else:
            matches = {w: self.tree.matched_chars(text, w) for w in loads}
            best = max(loads, key=lambda w: (matches[w], -loads[w], w))
            if text and matches[best] >= self.cache_threshold * len(text) and matches[best] > 0:
                decision = Decision(best, "prefix", matches[best])
            else:
                worker = min(loads, key=lambda w: (self.tree.chars(w), loads[w], w))
                decision = Decision(worker, "least_cached", matches[worker])
        self._record(text, decision.worker)
        return decision

    def _record(self, text: str, worker: str) -> None:
        self.tree.insert(text, worker)
        if next(self._inserts) % self.evict_every == 0:
            self.tree.evict(self.max_tree_chars)
