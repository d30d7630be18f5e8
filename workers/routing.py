"""Routing policies of the `PrefixRouter` (Ray-free): where should a prompt go?

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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tiered_cache.workers.prefix_tree import ApproxPrefixTree

Prompt = str | Sequence[Mapping[str, str]]  # text, or chat messages [{"role", "content"}]


def prompt_text(prompt: Prompt) -> str:
    """The text routing and prefix summaries see: a chat's message contents, in order, each after
    its role (two chats that share their leading messages share a leading text)."""
    if isinstance(prompt, str):
        return prompt
    return "".join(f"<{m.get('role', '')}>{m.get('content', '')}" for m in prompt)


@dataclass(frozen=True)
class Decision:
    worker: str
    reason: str  # "prefix" | "balance" | "least_cached" | "round_robin"
    matched_chars: int  # of the prompt, recorded for the chosen worker


class RoutingPolicy(Protocol):
    def add_worker(self, name: str) -> None: ...

    def remove_worker(self, name: str) -> None: ...

    def choose(self, text: str, loads: Mapping[str, int]) -> Decision:
        """Pick one of the workers in `loads` (name -> requests in flight) for `text`. Raises
        LookupError when `loads` is empty."""
        ...

    def observe(self, worker: str, texts: Iterable[str]) -> None:
        """Record that `worker` holds these prompts (its own summary, e.g. after a router restart)."""
        ...


def _require(loads: Mapping[str, int]) -> None:
    if not loads:
        raise LookupError("no live workers to route to")


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def add_worker(self, name: str) -> None:
        pass

    def remove_worker(self, name: str) -> None:
        pass

    def observe(self, worker: str, texts: Iterable[str]) -> None:
        pass

    def choose(self, text: str, loads: Mapping[str, int]) -> Decision:
        _require(loads)
        names = sorted(loads)
        with self._lock:
            turn = next(self._turn)
        return Decision(names[turn % len(names)], "round_robin", 0)


class PrefixAwarePolicy:
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

    def add_worker(self, name: str) -> None:
        pass  # a worker enters the tree with its first prompt

    def remove_worker(self, name: str) -> None:
        self.tree.remove_worker(name)

    def observe(self, worker: str, texts: Iterable[str]) -> None:
        for text in texts:
            self._record(text, worker)

    def choose(self, text: str, loads: Mapping[str, int]) -> Decision:
        _require(loads)
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


def make_policy(name: str, **settings: float) -> RoutingPolicy:
    """The policy called `name` ("prefix" or "round_robin") with its settings."""
    if name == "prefix":
        return PrefixAwarePolicy(**settings)  # type: ignore[arg-type]
    if name == "round_robin":
        if settings:
            raise ValueError(f"round_robin takes no settings, got {', '.join(sorted(settings))}")
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}; known: prefix, round_robin")
