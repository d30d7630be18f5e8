"""The `bench serve` workload: chat requests arriving open-loop (exponential gaps at `rate` a
second), each a question on one of a few shared documents, or the next turn of a multi-turn
chat (its earlier turns fixed, so every way asks the very same messages)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from tiered_cache.bench.cluster_bench import QUESTIONS
from tiered_cache.integrations.document import document


@dataclass(frozen=True)
class ServeRequest:
    key: str  # names the request across ways: its answers are compared by it
    messages: tuple[tuple[str, str], ...]  # (role, content)
    arrival_s: float  # after the run's start

    def body(self, model: str, max_tokens: int, salt: str | None) -> dict:
        body = {"model": model, "messages": [{"role": r, "content": c} for r, c in self.messages],
                "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if salt:
            body["cache_salt"] = salt
        return body


@dataclass(frozen=True)
class ServeWorkload:
    docs: int = 4
    questions: int = 6  # per document
    doc_chars: int = 2000
    chats: int = 2
    turns: int = 3  # per chat
    rate: float = 1.0  # requests a second, on average
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("docs", "questions", "doc_chars", "turns"):
            if getattr(self, name) <= 0:
                raise ValueError(f"bench serve: {name} must be positive, got {getattr(self, name)}")
        if self.chats < 0 or not self.rate > 0:
            raise ValueError(f"bench serve: chats must be >= 0 and rate > 0, got {self.chats} and {self.rate:g}")

    def requests(self) -> list[ServeRequest]:
        """Every request, in arrival order: document questions shuffled, a chat's turns in order."""
        rng = random.Random(self.seed)
        text = document()
        text = text * (self.docs * self.doc_chars // len(text) + 1)
        asks = QUESTIONS * (self.questions // len(QUESTIONS) + 1)
        items: list[tuple[str, tuple[tuple[str, str], ...]]] = [
            (f"doc{d}-q{q}", (("user", f"{text[d * self.doc_chars:(d + 1) * self.doc_chars]}\n\n"
                                       f"Question: {asks[q]}\nAnswer in one sentence."),))
            for d in range(self.docs) for q in range(self.questions)]
        rng.shuffle(items)
        for c in range(self.chats):  # each chat's turns spread over the run, in order
            history: tuple[tuple[str, str], ...] = (("system", f"You are assistant number {c}. " + text[-600:]),)
            slots = sorted(rng.sample(range(len(items) + self.turns), self.turns))
            for turn, slot in enumerate(slots):
                history = (*history, ("user", f"Turn {turn}: {asks[(c + turn) % len(asks)]}"))
                items.insert(min(slot, len(items)), (f"chat{c}-t{turn}", history))
                history = (*history, ("assistant", f"Noted, turn {turn}."))
        at, out = 0.0, []
        for key, messages in items:
            at += rng.expovariate(self.rate)
            out.append(ServeRequest(key, messages, at))
        return out
