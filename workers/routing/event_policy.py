"""`EventRoutingPolicy`: send a prompt where its expected time to first token is lowest, judged
from where the cluster's KV events say its pages are (event_index.py) and what the answers taught
about each tier's cost (ttft_estimate.py).

The router keys a prompt as the workers do: their tokenizer and chat template, then the page-key
chain of their namespace and model (DESIGN.md §4), so a key here is the block hash in their
events. While any live worker's events are stale (no batch, not even a heartbeat, for a few
seconds: a worker stuck or its events cut), the prefix policy decides instead and `fallbacks`
counts it; that policy records every route either way, so it is warm when it is needed.

The work ahead of a request is what the router sent to that worker and was not done yet. A worker
that serves one request at a time (our HF workers) is busy with each until its answer ends. An
engine that batches (vLLM) runs a new request's prefill beside the others' decoding: only the
prefills ahead of it delay it, each until its first token (`first_token`). Either way the wait
ends when the last request sent there was expected to be done with it, not that long from now:
the time since it was sent has run (one overdue still counts a share of its cost). There, where a
request goes matters to the others as well: the prefills waiting on that worker are batched
with it and wait for its prefill too, and one that arrives while every worker is still
prefilling waits for the first to finish. A request held in the router for store pages is not in
its engine yet: a new request there does not wait for it, it waits for what is left of the new
one's prefill when its pages land. A
worker's score adds the waiting its new work would cause them at the recent arrival rate
(`_all_busy_cost`): on a loaded cluster a long prefill goes where long work already is, and a
worker is kept free for the short ones. That waiting is an expectation and the request's own is
certain: within a near tie (`_NEAR_TIE`) the worker where its own TTFT is lowest wins.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tiered_cache.index.keys import chain_keys, root_key
from tiered_cache.workers.routing.event_index import ClusterEvents
from tiered_cache.workers.routing.policies import PrefixAwarePolicy
from tiered_cache.workers.routing.policy import Considered, Decision, Prompt, RoutingPolicy
from tiered_cache.workers.routing.ttft_estimate import TTFTEstimate

_NEAR_TIE = 0.05  # scores this close are a tie: the request's own TTFT decides (`choose`)
# Of a pending request's expected work, what still counts once it is overdue (its end was expected
# and has not come: the worker is slower than the rates learned so far, or the rates are priors).
_OVERDUE_SHARE = 0.25
# From a prefill's end to its pages in the store as the router sees them (the engine's save, the
# shard's event): a request held for them is expected to go no sooner.
STORE_LAG_S = 0.3
# A held request goes on (decided again) once the prefill it waits for has had its first token this
# long without the pages landing (a save dropped, a shard gone), or once held this long in all.
LAND_WAIT_S = 2.0
HOLD_AT_MOST_S = 30.0


class ArrivalRate:
    """Requests a second lately: over the last `window` arrivals, none counted until a few came,
    and over `span_s` at least (a burst of a few at once is not a rate)."""

    def __init__(self, window: int = 32, least: int = 4, span_s: float = 5.0) -> None:
        self._times: deque[float] = deque(maxlen=window)
        self._least = least
        self._span_s = span_s

    def record(self, at: float | None = None) -> None:
        self._times.append(time.monotonic() if at is None else at)

    def per_s(self) -> float:
        if len(self._times) < self._least:
            return 0.0
        return (len(self._times) - 1) / max(self._span_s, self._times[-1] - self._times[0])


@dataclass
class Pending:
    """A request the router sent to a worker, not answered yet."""

    keys: list[bytes]  # its prompt's page keys: on that worker's device before a request queued behind it runs
    cost_s: float  # the work it was expected to take there (a batching worker: its prefill; else all of it)
    due_at: float  # monotonic time that work was expected to end: when sent, the work ahead of it, then its own
    prefilling: bool = True  # no first token yet
    holding: bool = False  # held in the router until pages another worker computes land in the store
    ended_at: float | None = None  # monotonic time of its first token


@dataclass(frozen=True)
class _Candidate:
    """A worker as `choose` scores it for one request."""

    worker: str
    score: float  # its expected TTFT plus what sending it there costs the others
    wait: float  # the work ahead of it there
    own: float  # its own loads and prefill there
    load: int  # requests in flight there
    found: int  # prompt tokens cached for it there (device, host RAM, store)
    split: tuple[int, int, int]  # of which on the device, in host RAM, in the store
    pending: Pending  # what it adds to that worker's work once sent
    awaits: tuple[str, int] | None = None  # held for the pages the prefill (worker, ticket) computes


class EventRoutingPolicy(RoutingPolicy):
    follows_events = True
    choose_blocks = True  # keys the prompt with the workers' tokenizer

    def __init__(self, fallback: PrefixAwarePolicy, events: ClusterEvents | None = None, batching: bool = False,
                 arrivals: ArrivalRate | None = None) -> None:
        """`batching`: the workers run requests side by side (vLLM's continuous batching); else
        one at a time (our HF workers)."""
        self.fallback = fallback
        self.events = events or ClusterEvents()
        self.batching = batching
        self.arrivals = arrivals or ArrivalRate()
        self.estimate = TTFTEstimate()
        self.fallbacks = 0  # decisions the prefix policy made because events were stale
        # The workers write what they compute through to the store (vLLM with our connector): a
        # prefix on its way to one worker's device is one another may load once it lands there.
        self.store_follows = False
        self.holds = 0  # decisions that held a request for pages on their way to the store
        self._identity: dict[str, tuple[str, str, int]] = {}  # worker -> (fingerprint, namespace, page size)
        # Per worker, by ticket, the requests sent there and not answered yet (their pages are on no
        # one's device so far).
        self._pending: dict[str, dict[int, Pending]] = defaultdict(dict)
        self._tickets = itertools.count(1)
        self._tokenizer: Any = None
        self._model = ""
        self._lock = threading.Lock()
        self._pending_lock = threading.Lock()  # choose runs on a thread, the rest on the router's loop

    # --- members ----------------------------------------------------------------------------------
    def add_worker(self, name: str) -> None:
        self.fallback.add_worker(name)

    def remove_worker(self, name: str) -> None:
        self.fallback.remove_worker(name)
        with self._pending_lock:
            self._pending.pop(name, None)
        self.events.forget(name)
        self._identity.pop(name, None)

    def observe(self, worker: str, texts: Iterable[str]) -> None:
        self.fallback.observe(worker, texts)

    def join(self, name: str, info: Mapping[str, Any]) -> None:
        """A worker (re)joined with `info` (`CacheWorker.info`): subscribe to its events and learn
        how it keys prompts. Blocking the first time (the tokenizer loads): call it off the loop."""
        address = str(info.get("address") or "").split()
        if len(address) < 2:
            return  # no events from it: it is routed by the fallback
        with self._lock:
            if self._tokenizer is None or info["model"] != self._model:
                from tiered_cache.integrations.hf_models import load_tokenizer

                self._tokenizer, self._model = load_tokenizer(info["model"]), info["model"]
        self._identity[name] = (info["fingerprint"], info["namespace"], int(info["page_size"]))
        self.events.watch(name, address[0], address[1], incarnation=" ".join(address[2:]))

    def watch_shards(self, shards: Mapping[str, Mapping[str, str] | None]) -> None:
        for gone in set(self.events.shards) - set(shards):
            self.events.forget(gone)
        for name, events in shards.items():
            if events:
                self.events.watch(name, events["endpoint"], events["replay"], shard=True)

    # --- routing ----------------------------------------------------------------------------------
    def choose(self, text: str, loads: Mapping[str, int], prompt: Prompt | None = None,
               chat: bool = True, namespace: str | None = None, hold: bool = True) -> Decision:
        """`namespace`: the request's own (vLLM's cache salt), keying its pages in place of the
        workers' namespace; pages under any other count for nothing. `hold`: with
        `store_follows`, a decision may ask the caller to hold the request until pages another
        worker is computing are in the store (`Decision.awaits`, `landed`, `source_ended`);
        False: never."""
        self.arrivals.record()
        if prompt is None or self._tokenizer is None or not all(
                w in self._identity and self.events.fresh(w) for w in loads):
            self.fallbacks += 1
            return self._pending_fallback(self.fallback.choose(text, loads), prompt, chat, namespace)
        ids = self._encode(prompt, chat)
        rate = self.arrivals.per_s()
        keyed: dict[tuple[str, str, int], list[bytes]] = {}
        scored: list[_Candidate] = []
        now = time.monotonic()
        with self._pending_lock:
            pending = {w: list(self._pending[w].values()) for w in loads}
            computing = [(w, t, p) for w in loads for t, p in self._pending[w].items()
                         if p.prefilling and not p.holding]  # held ones compute nothing yet
            waits = {w: self._ahead_s(pending[w], now)
                     + max(0, loads[w] - len(pending[w])) * self.estimate.service_s
                     for w in loads}  # requests sent while events were stale: cost unknown, service_s each
            # Prefills in the engine, and when each request held for the store is expected to join
            # it (its start as sent: when what it waits for lands).
            prefills = {w: (sum(p.prefilling and not p.holding for p in pending[w]),
                            tuple(p.due_at - p.cost_s for p in pending[w] if p.holding)) for w in loads}
        for worker in sorted(loads):
            fingerprint, own_namespace, page = self._identity[worker]
            identity = (fingerprint, own_namespace if namespace is None else namespace, page)
            if identity not in keyed:
                keyed[identity] = chain_keys(ids, page, root_key(identity[1], fingerprint))
            keys = keyed[identity]
            # A request held for pages that are not in the store yet brings nothing here so far.
            coming = max((_common(keys, p.keys) for p in pending[worker] if not p.holding), default=0)
            held = self.events.holdings(worker, keys, coming)
            here = (held.device, held.host, held.store)
            candidate = self._candidate(worker, ids, keys, page, here, waits, prefills, loads, rate, now)
            if hold and self.store_follows:
                # A prefix another worker is computing lands in the store when done (written
                # through): this worker may load it from there, the request held back until it
                # is, rather than compute it again or queue at the holder.
                landing, ready_s, source = _landing(keys, [c for c in computing if c[0] != worker], now)
                if landing > sum(here):
                    later = {**waits, worker: max(waits[worker], ready_s + STORE_LAG_S)}
                    held_back = self._candidate(worker, ids, keys, page, (held.device, held.host,
                                                landing - held.device - held.host), later, prefills, loads, rate, now)
                    if held_back.score < candidate.score:
                        candidate = replace(held_back, awaits=source)
            scored.append(candidate)
        # Within a near tie, the worker where this request's own TTFT is lowest: the waiting it
        # would cause others is an expectation, its own wait is certain (a new document, a busy
        # worker with as long a prefill ahead as its own: the two tie exactly at the cap above).
        least = min(c.score for c in scored)
        best = min((c for c in scored if c.score <= least * (1 + _NEAR_TIE)),
                   key=lambda c: (c.wait + c.own, c.load, c.worker))
        self.fallback.observe(best.worker, [text])  # kept warm for when events stop
        ticket = self._keep_pending(best.worker, replace(best.pending, holding=best.awaits is not None))
        self.holds += best.awaits is not None
        considered = tuple(Considered(c.worker, c.wait + c.own, c.wait, c.split, c.score)
                           for c in sorted(scored, key=lambda c: (c is not best, c.score)))
        return Decision(best.worker, "events", best.found, best.split, wait_s=best.wait, ticket=ticket,
                        considered=considered, hold_s=HOLD_AT_MOST_S if best.awaits else 0.0, awaits=best.awaits)

    def _candidate(self, worker: str, ids: Sequence[int], keys: list[bytes], page: int,
                   held: tuple[int, int, int], waits: Mapping[str, float],
                   prefills: Mapping[str, tuple[int, tuple[float, ...]]],
                   loads: Mapping[str, int], rate: float, now: float) -> _Candidate:
        """`worker` scored for a prompt of `ids` whose leading pages `held` lie on its device, in
        its host RAM and in the store, after `waits[worker]` of work there."""
        device, host, store = (n * page for n in held)
        wait = waits[worker]
        own = self.estimate.seconds(len(ids), device, host, store)
        found = device + host + store
        if self.batching:
            # What it costs the others: recomputed tokens are work the cluster does again; the
            # prefills waiting there (all but the one under way) run in its step and get their
            # first token only when its prefill is done too, as do the requests held there for
            # the store that go in while it runs (what is left of it then: one let in after it
            # ends waits for none of it); and a worker kept busy while every other is busy too
            # delays whoever arrives. That last waiting counts up to the request's own time: a
            # long one may queue behind long work, never for longer than it takes itself.
            others = [waits[w] for w in loads if w != worker]
            running, joining = prefills[worker]
            ends = now + wait + own
            spent = (self.estimate.compute_s(len(ids), found) + max(0, running - 1) * own
                     + sum(min(own, max(0.0, ends - at)) for at in joining)
                     + (min(own, _all_busy_cost(wait, own, min(others), rate)) if others else 0.0))
        else:
            # A recomputed token costs in this TTFT and, on a busy cluster, again in the TTFT of
            # the request that will queue behind it there: racing an idle worker to recompute a
            # prefix another is about to hold wins one request and slows the next.
            behind = 1.0 + min(1.0, sum(loads.values()) / len(loads))  # 1 on an idle cluster, 2 once busy
            spent = behind * self.estimate.compute_s(len(ids), found)
        cost = own if self.batching else own + self.estimate.decode_s
        return _Candidate(worker, wait + own + spent, wait, own, loads[worker], found, (device, host, store),
                          Pending(keys, cost, now + wait + cost))

    def landed(self, decision: Decision) -> bool:
        """Whether the pages a held decision waits for are where it expected them: its worker finds
        as many leading pages of its prompt (device, host RAM, store) as the decision counted.
        Once they are, the request counts as bringing them there (`coming`) for those after it."""
        with self._pending_lock:
            entry = self._pending.get(decision.worker, {}).get(decision.ticket)
        if entry is None or decision.worker not in self._identity:
            return True  # no longer pending: nothing to hold it for
        held = self.events.holdings(decision.worker, entry.keys)
        if (held.device + held.host + held.store) * self._identity[decision.worker][2] < decision.matched:
            return False
        with self._pending_lock:
            entry.holding = False
        return True

    def source_ended(self, decision: Decision) -> float | None:
        """When the prefill a held decision waits for had its first token (monotonic time; now, if
        it is no longer pending at all); None while it is still under way."""
        if decision.awaits is None:
            return time.monotonic()
        worker, ticket = decision.awaits
        with self._pending_lock:
            entry = self._pending.get(worker, {}).get(ticket)
        if entry is None:
            return time.monotonic()
        return None if entry.prefilling else entry.ended_at

    def _keep_pending(self, worker: str, pending: Pending) -> int:
        """Count `pending` on `worker` until `finished`; its ticket."""
        ticket = next(self._tickets)
        with self._pending_lock:
            self._pending[worker][ticket] = pending
        return ticket

    def _pending_fallback(self, decision: Decision, prompt: Prompt | None, chat: bool,
                          namespace: str | None) -> Decision:
        """`decision`, the prefix policy's, kept among the worker's pending requests where its
        prompt can be keyed (events not yet fresh: a deployment's first requests): the next request
        on the same prefix then sees it coming there, and its cost, as for a decision of ours."""
        identity = self._identity.get(decision.worker)
        if prompt is None or self._tokenizer is None or identity is None:
            return decision
        fingerprint, own_namespace, page = identity
        try:
            ids = self._encode(prompt, chat)
            keys = chain_keys(ids, page, root_key(own_namespace if namespace is None else namespace, fingerprint))
        except Exception:  # the fallback routes what cannot be keyed, as it always did
            return decision
        cost = self.estimate.seconds(len(ids), 0, 0, 0) + (0.0 if self.batching else self.estimate.decode_s)
        pending = Pending(keys, cost, time.monotonic() + cost)  # what is ahead of it there: unknown
        return replace(decision, ticket=self._keep_pending(decision.worker, pending))

    def _ahead_s(self, pending: Sequence[Pending], now: float) -> float:
        """The work ahead of a request sent now where `pending` are: one at a time, every request
        there; batching, the prefills without a first token yet; neither counts a request held
        in the router (it is not in the engine: it will go in behind this one). They end when the last of them
        was expected to (each was expected after those sent before it): what has run since it was
        sent is not waited for again. One overdue still holds the worker up by a share of its cost
        (`_OVERDUE_SHARE`): how much is left of it, rates that were wrong cannot tell."""
        ahead = [p for p in pending if (p.prefilling or not self.batching) and not p.holding]
        if not ahead:
            return 0.0
        overdue = sum(_OVERDUE_SHARE * p.cost_s for p in ahead if p.due_at <= now)
        return max(max(p.due_at for p in ahead) - now, overdue)

    def first_token(self, worker: str, decision: Decision) -> None:
        with self._pending_lock:
            entry = self._pending.get(worker, {}).get(decision.ticket)
            if entry is not None:
                entry.prefilling = False
                entry.ended_at = time.monotonic()

    def finished(self, worker: str, decision: Decision) -> None:
        """A request routed by `decision` to `worker` was answered (or failed): its pages are told
        by events now."""
        if not decision.ticket:
            return  # not kept among the pending (a fallback's without a prompt)
        with self._pending_lock:
            self._pending.get(worker, {}).pop(decision.ticket, None)

    def _encode(self, prompt: Prompt, chat: bool) -> list[int]:
        return encode(self._tokenizer, prompt, chat)

    def learn(self, answer: Mapping[str, Any], latency_s: float) -> None:
        self.estimate.observe(answer, latency_s)

    def stats(self) -> dict[str, Any]:
        return {"fallbacks": self.fallbacks, "holds": self.holds, "estimate": self.estimate.to_dict(),
                "sources": self.events.stats(), "arrivals_per_s": round(self.arrivals.per_s(), 3)}

    def close(self) -> None:
        self.events.close()


def _all_busy_cost(wait_s: float, own_s: float, others_s: float, rate: float) -> float:
    """Seconds of waiting that `own_s` more work on a worker busy for `wait_s` adds to the
    requests arriving at `rate` a second, when the least busy other worker is free in `others_s`:
    a request that comes while every worker is busy waits until the first is free, and this work
    makes that moment later by `longer` (a worker left free, or one long busy anyway, costs none:
    long prefills go where long work already is, short ones keep a worker free; `choose` counts
    it up to the request's own time)."""
    free_before = min(wait_s, others_s)
    longer = min(wait_s + own_s, others_s) - free_before
    return rate * longer * (free_before + longer / 2)


def _landing(keys: Sequence[bytes], computing: Sequence[tuple[str, int, Pending]], now: float
             ) -> tuple[int, float, tuple[str, int] | None]:
    """The most leading pages of `keys` one of the prefills under way (worker, ticket, pending)
    computes, in how many seconds it is expected to end (one overdue: a share of its cost), and
    which it is."""
    best, ready, source = 0, 0.0, None
    for worker, ticket, p in computing:
        n = _common(keys, p.keys)
        if n > best:
            best, ready, source = n, max(p.due_at - now, _OVERDUE_SHARE * p.cost_s), (worker, ticket)
    return best, ready, source


def _common(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """Leading keys `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def encode(tokenizer: Any, prompt: Prompt, chat: bool) -> list[int]:
    """Token ids of a prompt as the workers see it: text (through the chat template when `chat`),
    token ids as given, or a chat's messages through the template."""
    from tiered_cache.integrations.hf_models import encode_messages, encode_prompt

    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt, chat)
    if prompt and all(isinstance(t, int) for t in prompt):  # token ids, as an engine takes them
        return [int(t) for t in prompt]  # type: ignore[arg-type, union-attr]
    return encode_messages(tokenizer, prompt)
