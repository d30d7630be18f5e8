"""`bench store-traffic --ray`'s workload: the same conversations as the page-key mix (`TurnPicker`: shared
system prompts and multi-turn histories by Zipf-like popularity), written as chat prompts a cache
worker answers. A system prompt is a seeded slice of the shipped document; each turn adds a
question (and, after the first, the previous answer's placeholder), so a conversation's prompts
share ever longer prefixes, and popular system prompts are shared by every client.

No torch, no Ray: a client process builds its prompts alone and stays small.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from functools import cached_property

from tiered_cache.bench.store_traffic.workload import TurnPicker, Workload

QUESTIONS = (
    "Summarise this in one sentence.", "What is the main subject?", "Which years are mentioned?",
    "Who are the people named?", "What happened first?", "What happened last?",
    "Give one surprising detail.", "What place is described?", "Explain the second paragraph.",
    "What would you ask next?", "List three key words.", "Is anything left unexplained?",
)
MIN_PROMPT_CHARS, MAX_PROMPT_CHARS = 400, 2400  # ~100 to ~600 tokens of system prompt


@dataclass(frozen=True)
class ChatWorkload:
    workload: Workload  # prompts, histories, max_turns, zipf_s and seed; its page sizes are unused

    @cached_property
    def system_prompts(self) -> list[str]:
        from tiered_cache.integrations.document import document

        text = document()
        rng = random.Random(f"{self.workload.seed}:system-prompts")
        prompts = []
        for _ in range(self.workload.prompts):
            length = rng.randint(MIN_PROMPT_CHARS, min(MAX_PROMPT_CHARS, len(text)))
            start = rng.randint(0, len(text) - length)
            prompts.append(text[start:start + length])
        return prompts


def prompt_id(prompt: str) -> str:
    """A prompt's name in reports: SHA-256 of its text (answers are compared per prompt)."""
    return hashlib.sha256(prompt.encode()).hexdigest()


@dataclass
class ChatConversations:
    """One client's conversations as prompts: `next_prompt()` adds a turn to the one `TurnPicker`
    chooses and returns the whole conversation so far."""

    chat: ChatWorkload
    client: int
    _text: dict[int, str] = field(default_factory=dict)  # slot -> its conversation so far

    def __post_init__(self) -> None:
        self.picker = TurnPicker(self.chat.workload, self.client)
        self.rng = random.Random(f"{self.chat.workload.seed}:{self.client}:questions")

    def next_prompt(self) -> str:
        turn = self.picker.next_turn()
        question = QUESTIONS[self.rng.randrange(len(QUESTIONS))]
        if turn.turn == 0:
            self._text[turn.slot] = f"{self.chat.system_prompts[turn.prompt]}\n\nQuestion: {question}"
        else:
            self._text[turn.slot] += f"\nAnswer: (noted)\nQuestion: {question}"
        return self._text[turn.slot]
