"""Retention policies: which of a long sequence's private tokens to keep, so its KV stays bounded.

A policy looks at a sequence's live tokens (their original positions, and for `HeavyHitter` the
attention each has received) and names the ones to drop; `TieredCache.drop_tokens` drops them
and frees pages left with no live token (compaction.py). Tokens of the shared matched prefix are
never dropped (`fixed`). Policies are pure: they hold their settings and no state of a sequence,
so one policy object serves any number of requests.

- `SinkWindow(sink, window)`, StreamingLLM (Xiao et al., 2023): keep the first `sink` tokens
  (attention sinks) and the last `window`; drop the middle. Pages free as they leave the window.
- `HeavyHitter(budget, recent)`, H2O (Zhang et al., 2023): keep at most `budget` tokens: the last
  `recent` and, of the others, those with the largest accumulated attention (fed by the engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SinkWindow:
    sink: int = 4
    window: int = 1024

    def __post_init__(self) -> None:
        if self.sink < 0 or self.window < 1:
            raise ValueError(f"SinkWindow needs sink >= 0 and window >= 1, got sink={self.sink}, window={self.window}")

    needs_scores = False

    def to_drop(self, positions: np.ndarray, fixed: int, scores: np.ndarray | None = None) -> np.ndarray:
        """Indices (into the live tokens) to drop. `positions`: each live token's position in
        the original sequence, ascending; the first `fixed` live tokens cannot be dropped."""
        if not positions.size:
            return np.empty(0, dtype=np.int64)
        end = int(positions[-1]) + 1
        middle = (positions >= self.sink) & (positions < end - self.window)
        middle[:fixed] = False
        return np.flatnonzero(middle)


@dataclass(frozen=True)
class HeavyHitter:
    budget: int
    recent: int | None = None  # None: half the budget, as H2O splits it

    def __post_init__(self) -> None:
        recent = self.budget // 2 if self.recent is None else self.recent
        if self.budget < 1 or not 0 <= recent <= self.budget:
            raise ValueError(f"HeavyHitter needs budget >= 1 and 0 <= recent <= budget, got budget={self.budget}, "
                             f"recent={self.recent}")

    needs_scores = True

    def to_drop(self, positions: np.ndarray, fixed: int, scores: np.ndarray | None = None) -> np.ndarray:
        """Indices (into the live tokens) to drop: past `budget` private tokens, the ones with the
        least accumulated attention (`scores`, one per live token), never the last `recent`."""
        private = positions.size - fixed
        if private <= self.budget:
            return np.empty(0, dtype=np.int64)
        if scores is None or len(scores) != positions.size:
            raise ValueError(f"HeavyHitter needs one accumulated attention score per live token "
                             f"({positions.size}), got {None if scores is None else len(scores)}")
        recent = self.budget // 2 if self.recent is None else self.recent
        candidates = np.arange(fixed, positions.size - recent)
        excess = private - self.budget
        order = np.argsort(np.asarray(scores)[candidates], kind="stable")  # least attended first; ties: oldest
        return np.sort(candidates[order[:excess]])
