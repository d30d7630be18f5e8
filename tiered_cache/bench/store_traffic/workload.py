"""The `bench store-traffic` workload: shared system prompts and per-client multi-turn conversations, each
picked with a Zipf-like popularity (rank k drawn with weight 1/k^s).

A request is one turn of one conversation. Its page keys chain over tokens as real page keys do
(`PageKeyer`): system prompt, earlier turns, then the turn's new pages. Every token is a function
of the seed and of where it sits, and every page's blob is a function of its key alone
(`PagePayloads.blob`), so any process can say which bytes a key must hold.

No torch: a client process stays small and starts fast.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field

import numpy as np

from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.wire.codec import encode_page

_TOKENS_PER_PAGE = 16
_PAYLOADS = 16  # distinct page contents; the key in each blob's header makes every blob distinct
_VOCAB = 32000
_NAMESPACE = "store-traffic"  # the pages' keys, and the name of their spec


@dataclass(frozen=True)
class Workload:
    """What the clients ask for. Every size derives from `spec`."""

    page_kib: int = 64
    prompts: int = 32  # shared system prompts, 4 to 32 pages each
    histories: int = 16  # conversations each client keeps going at once
    max_turns: int = 8  # a conversation this long is replaced by a new one
    zipf_s: float = 1.1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("page_kib", "prompts", "histories", "max_turns"):
            if getattr(self, name) <= 0:
                raise ValueError(f"bench store-traffic: {name} must be positive, got {getattr(self, name)}")
        if not self.zipf_s > 0:
            raise ValueError(f"bench store-traffic: the Zipf exponent must be > 0, got {self.zipf_s:g}")

    @property
    def spec(self) -> KVSpec:
        """One layer, one head, 16-token fp16 pages of `page_kib` KiB."""
        return KVSpec(_NAMESPACE, 1, 1, self.page_kib * 1024 // (4 * _TOKENS_PER_PAGE), page_size=_TOKENS_PER_PAGE)

    def prompt_tokens(self, prompt: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0, prompt])
        return rng.integers(0, _VOCAB, int(rng.integers(4, 33)) * _TOKENS_PER_PAGE, dtype=np.int32)

    def turn_tokens(self, client: int, serial: int, turn: int) -> np.ndarray:
        """A turn's new tokens (the last answer and the next question): 1 to 4 pages."""
        rng = np.random.default_rng([self.seed, 1, client, serial, turn])
        return rng.integers(0, _VOCAB, int(rng.integers(1, 5)) * _TOKENS_PER_PAGE, dtype=np.int32)

    def prompt_keys(self) -> list[list[bytes]]:
        keyer = PageKeyer(self.spec, _NAMESPACE)
        return [keyer.keys(self.prompt_tokens(p)) for p in range(self.prompts)]


class PagePayloads:
    """The blob every key must hold: one of a few seeded page contents, chosen by the key."""

    def __init__(self, workload: Workload) -> None:
        self.spec = workload.spec
        rng = np.random.default_rng([workload.seed, 2])
        self.pages = [rng.integers(0, 256, self.spec.bytes_per_page, dtype=np.uint8) for _ in range(_PAYLOADS)]

    def blob(self, key: bytes) -> bytes:
        return encode_page(self.pages[key[0] % _PAYLOADS], self.spec, key)


class Zipf:
    """Ranks 0..n-1, rank k drawn with weight 1/(k+1)^s."""

    def __init__(self, n: int, s: float) -> None:
        weights = np.cumsum(1.0 / np.arange(1, n + 1) ** s)
        self.cumulative = list(weights / weights[-1])

    def sample(self, rng: random.Random) -> int:
        return min(bisect.bisect_left(self.cumulative, rng.random()), len(self.cumulative) - 1)


@dataclass(frozen=True)
class Turn:
    slot: int  # which of the client's conversations (its history slot)
    serial: int  # the conversation's number, per client
    prompt: int  # its system prompt
    turn: int  # 0: the conversation's first


class TurnPicker:
    """Which conversation a client's next request continues: a history slot by popularity; where
    the slot is empty or its conversation has `max_turns` turns, a new conversation on a system
    prompt picked by popularity. Shared by the page-key workload and the chat one (Ray)."""

    def __init__(self, workload: Workload, client: int) -> None:
        self.workload = workload
        self.rng = random.Random(f"{workload.seed}:{client}")
        self.prompt_zipf, self.slot_zipf = Zipf(workload.prompts, workload.zipf_s), Zipf(workload.histories,
                                                                                         workload.zipf_s)
        self._slots: list[Turn | None] = [None] * workload.histories
        self._serial = 0

    def next_turn(self) -> Turn:
        slot = self.slot_zipf.sample(self.rng)
        last = self._slots[slot]
        if last is None or last.turn + 1 >= self.workload.max_turns:
            turn = Turn(slot, self._serial, self.prompt_zipf.sample(self.rng), 0)
            self._serial += 1
        else:
            turn = Turn(slot, last.serial, last.prompt, last.turn + 1)
        self._slots[slot] = turn
        return turn


@dataclass(frozen=True)
class Request:
    keys: list[bytes]  # every page of the conversation so far, the new turn's last
    new_pages: int  # how many of them this turn added


@dataclass
class Conversations:
    """One client's conversations as page keys: `next_request()` adds a turn to the one
    `TurnPicker` chooses and returns every key of it so far."""

    workload: Workload
    client: int
    prompt_keys: list[list[bytes]]
    new_pages: int = 0  # pages this client made up: with the prompts, every distinct page
    _keys: dict[int, list[bytes]] = field(default_factory=dict)  # slot -> its conversation's keys

    def __post_init__(self) -> None:
        self.picker = TurnPicker(self.workload, self.client)
        self.keyer = PageKeyer(self.workload.spec, _NAMESPACE)

    def next_request(self) -> Request:
        turn = self.picker.next_turn()
        if turn.turn == 0:
            self._keys[turn.slot] = list(self.prompt_keys[turn.prompt])
        keys = self._keys[turn.slot]
        new = self.keyer.extend(keys[-1], self.workload.turn_tokens(self.client, turn.serial, turn.turn))
        keys += new
        self.new_pages += len(new)
        return Request(list(keys), len(new))
