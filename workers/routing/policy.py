"""`RoutingPolicy`: the one interface every routing policy offers, whoever routes with it (our
router actor, `workers/router.py`, or a Ray Serve request router).

A router keeps the live workers and their requests in flight, and tells its policy what happens:
workers joining and leaving, what each holds, the store shards, each decision's answer. The policy
only decides. Calls a policy has no use for are no-ops here; what a router must do differently
for a policy is said by its attributes (`follows_events`, `choose_blocks`), never by its type.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]  # text, chat messages [{"role", "content"}], token ids


def prompt_text(prompt: Prompt) -> str:
    """The text routing and prefix summaries see: a chat's message contents, in order, each after
    its role (two chats that share their leading messages share a leading text); token ids as
    numbers, each followed by a space (two that share leading ids share a leading text)."""
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(t, int) for t in prompt):
        return "".join(f"{t} " for t in prompt)
    return "".join(f"<{m.get('role', '')}>{m.get('content', '')}" for m in prompt)


@dataclass(frozen=True)
class Considered:
    """A worker the event policy weighed for a request, as it expected the request there."""

    worker: str
    ttft_s: float  # the work ahead of it there, then its own loads and prefill
    wait_s: float  # the work ahead of it there
    expected: tuple[int, int, int]  # leading prompt tokens on its device, in its host RAM, in the store
    score_s: float  # `ttft_s` plus what sending it there costs the requests after it


@dataclass(frozen=True)
class Decision:
    worker: str
    reason: str  # "prefix" | "balance" | "least_cached" | "round_robin" | "events"
    matched: int  # of the prompt, for the chosen worker, in `unit`s
    # Under "events": the leading prompt tokens expected on the worker's device, in its host RAM,
    # in the store (a router that sees no per-tier split in answers learns the store's cost by them).
    expected: tuple[int, int, int] = (0, 0, 0)
    wait_s: float = 0.0  # under "events": the work the router expected ahead of it on the worker
    ticket: int = 0  # the event policy: names the request among the worker's pending ones (0: not kept)
    considered: tuple[Considered, ...] = ()  # under "events": every worker weighed, the chosen one first
    # Under "events": hold the request back at most this long, until the pages it counted in the
    # store have landed there (`EventRoutingPolicy.landed`); `awaits` names the prefill computing
    # them (worker, ticket: `EventRoutingPolicy.source_ended`).
    hold_s: float = 0.0
    awaits: tuple[str, int] | None = None
    held_s: float = 0.0  # how long the router held it (the caller that held it says)

    @property
    def unit(self) -> str:
        """What `matched` counts: prompt tokens expected cached (the event policy), else characters
        of the prompt's text matched (the prefix policies)."""
        return "tokens" if self.reason == "events" else "chars"


class RoutingPolicy:
    """Where should a prompt go? Subclasses implement `choose`; every other call is a no-op here."""

    follows_events = False  # wants `join` infos and `watch_shards` (their KV event endpoints)
    choose_blocks = False  # `choose` may block (it tokenizes): a router on an event loop runs it off the loop

    def add_worker(self, name: str) -> None:
        """`name` is live and may be chosen from now on."""

    def remove_worker(self, name: str) -> None:
        """`name` left (or died): forget what it held."""

    def observe(self, worker: str, texts: Iterable[str]) -> None:
        """Record that `worker` holds these prompts (its own summary, e.g. after a router restart)."""

    def join(self, name: str, info: Mapping[str, Any]) -> None:
        """A worker (re)joined with `info` (`CacheWorker.info`: its model, namespace, event
        endpoints); may block (a tokenizer loads): call it off an event loop."""

    def watch_shards(self, shards: Mapping[str, Mapping[str, str] | None]) -> None:
        """The live store shards and their KV event endpoints (None: none): new or restarted ones
        are read from the start, departed ones forgotten. Called only when `follows_events`."""

    def choose(self, text: str, loads: Mapping[str, int], prompt: Prompt | None = None,
               chat: bool = True) -> Decision:
        """Pick one of the workers in `loads` (name -> requests in flight) for `text` (`prompt`'s
        routing text; `prompt` itself and `chat` for a policy that keys it as the workers do).
        The chosen worker is recorded as holding the prompt. Raises LookupError when `loads` is
        empty."""
        raise NotImplementedError(f"{type(self).__name__} does not choose")

    def learn(self, answer: Mapping[str, Any], latency_s: float) -> None:
        """An answer relayed from a worker (its sources and times), `latency_s` after it was sent."""

    def first_token(self, worker: str, decision: Decision) -> None:
        """The request `decision` sent to `worker` has its first token: its prefill is done."""

    def finished(self, worker: str, decision: Decision) -> None:
        """The request `decision` sent to `worker` was answered or failed."""

    def stats(self) -> dict[str, Any]:
        """What the policy counts (empty: nothing); a router shows it beside its own stats, under
        the policy's name."""
        return {}

    def close(self) -> None:
        """Stop what the policy runs (subscriptions)."""


def require_workers(loads: Mapping[str, int]) -> None:
    if not loads:
        raise LookupError("no live workers to route to")
