"""`TieredCacheRouter`: our event routing policy as a Ray Serve request router.

Serve's ingress asks it, for each request, which vLLM replica should answer. It reads every
replica's vLLM KV events (the engine's blocks, medium GPU, and our connector's, medium CPU: written
through to the store every replica reads), re-keys them by their tokens (routing/token_chain.py),
keys the prompt the same way with the model's tokenizer and chat template, and ranks the replicas
by expected time to first token (routing/event_policy.py: what is on the replica's device, what
the store holds, the work queued ahead of it, learned rates). While a replica's events are stale
the prefix policy decides, counted (`fallbacks`).

Where the cluster's store shards publish events too (`cluster start --kv-events`), the store is
what the shards tell, not only what live replicas' connectors saved: pages a restarted replica
or an earlier deployment left are found. Shards name pages by the connector's keys, so the router
keys prompts with the connector's chain (`tiered_cache_keying` in the replicas' routing stats).

It subclasses Ray's `KVAwareRouter` only for what Serve gives such a router's deployment: each
replica's engine publishes on its own port (rank on its node), advertised in its routing stats
(`kv_event_metadata`). Ray's own scoring (NVIDIA Dynamo's selection service, an HAProxy ingress)
is not used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

import ray
from ray.llm._internal.serve.routing_policies.kv_aware.kv_aware_router import KVAwareRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from tiered_cache.events.schema import MEDIUM_CPU, MEDIUM_STORAGE
from tiered_cache.index.keys import root_key
from tiered_cache.workers.directory import SHARD
from tiered_cache.workers.names import DIRECTORY
from tiered_cache.workers.router import member_info
from tiered_cache.workers.routing.event_index import ClusterEvents
from tiered_cache.workers.routing.event_policy import LAND_WAIT_S, EventRoutingPolicy, encode
from tiered_cache.workers.routing.policies import PrefixAwarePolicy
from tiered_cache.workers.routing.policy import Considered, Decision, prompt_text
from tiered_cache.workers.routing.token_chain import TokenChainIndex, connector_chain
from tiered_cache.workers.routing.ttft_estimate import with_store_share

log = logging.getLogger("tiered_cache.workers.serve_llm")
LOAD_AHEAD = "tiered_cache_load_ahead"  # the mark in a request's kv_transfer_params (_say_load_ahead)
# The chain the router keys tokens by while no replica has said the connector's (no connector).
FINGERPRINT = hashlib.sha256(b"tiered-cache serve router").hexdigest()
ROOT = root_key("", FINGERPRINT)
SHARDS_EVERY_S = 5.0  # how often the cluster's directory is read for its shards' event endpoints
SHARDS_WAIT_S = 2.0  # one directory or shard look-up, at most
ROUTERS: list[TieredCacheRouter] = []  # this process's routers, for the ingress's stats route
RECENT = 4096  # routes remembered for the answers' `tiered_cache` field
HOLD_POLL_S = 0.02  # how often a held request looks whether its pages have landed in the store
# Requests held at once, at most (each keeps a routing task of its own, beside Serve's): more are
# decided without a hold.
HOLDS_AT_MOST = 64
# A request waits at most this long for replicas the router is subscribing to (then the prefix
# policy decides, counted in `fallbacks`).
JOIN_WAIT_S = 10.0
STATS_POLL_S = 0.05  # how often a request that waits for a new deployment's routing stats looks again
OTHERS_SHOWN = 3  # replicas passed over that an answer's route shows (the best scored)


class TieredCacheRouter(KVAwareRouter):
    def initialize_state(self, model: str = "", namespace: str = "", **_: Any) -> None:
        """`model`: the folder (or Hugging Face id) of the replicas' tokenizer; `namespace`: the
        Ray namespace of the cluster's directory (its store shards), none: no shard is read."""
        self.model = model
        self.namespace = namespace
        self.keying: dict[str, Any] | None = None  # the connector's page keys (its replicas say)
        self._root = ROOT
        # vLLM's publisher sends no heartbeat: a replica's events are trusted while subscribed.
        events = ClusterEvents(stale_after_s=None, index=lambda: TokenChainIndex(self._root, salted=self._salted),
                               host_mediums=(), store_mediums=(MEDIUM_STORAGE, MEDIUM_CPU))
        # vLLM batches: a request waits only for the prefills ahead of it (first_token says when each ends).
        self.policy = EventRoutingPolicy(PrefixAwarePolicy(), events, batching=True)
        self._shards_read = 0.0
        self._shards_task: asyncio.Task[None] | None = None
        self.in_flight: Counter[str] = Counter()
        self.routed: Counter[str] = Counter()
        self.unparsed = 0  # requests with no prompt to key (routed to the least loaded)
        self.expired_holds = 0  # requests held for store pages that did not land in time (decided again)
        self.full_passed = 0  # decisions that passed over a replica with as many requests as it takes
        self.asked_again = 0  # requests Serve asked for again (their replica refused them, or died)
        self._holding = 0  # requests held now (`_hold`)
        self._held: list[PendingRequest] = []  # requests held and not yet handed to a replica by Serve
        self._decisions: dict[str, Decision] = {}  # internal request id -> the decision
        self.recent: OrderedDict[str, dict[str, Any]] = OrderedDict()  # request id -> its route (answers say it)
        self._routes: dict[str, Decision] = {}  # request id -> its decision (what it expected, for the answer)
        self._loads_seen: dict[str, tuple[float, int]] = {}  # replica -> its connector's load totals read
        self._prefills_seen: dict[str, dict[str, float]] = {}  # replica -> its engine's start-up prefill read
        self._joined: dict[str, tuple[str, str]] = {}  # replica -> its event endpoints
        self._joining: set[str] = set()
        self._stats_waited = False  # a request has waited for a new deployment's first routing stats
        self._join_tasks: set[asyncio.Task[None]] = set()
        self._deciding = asyncio.Lock()  # decisions one at a time, in the order asked (`_decide`)
        self._lock = threading.Lock()
        _registry().append(self)

    # --- replicas ---------------------------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new list of replicas (and their routing stats): those not followed yet are
        joined now, in the background, so a new deployment's first requests find them followed;
        the loads their connectors timed price the store, and the prefill each engine timed at
        its start prices a prefill until answers teach more."""
        super().update_replicas(replicas)
        if hasattr(self, "_loads_seen"):  # Serve has initialized our state
            self._time_loads(replicas)
            self._time_prefills(replicas)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # not on the router's loop: the next request joins them
            return
        if hasattr(self, "_join_tasks"):  # Serve has initialized our state
            self._start_joining(replicas)

    async def _join_new(self, replicas: list[RunningReplica]) -> None:
        """Join replicas not followed yet, and wait (at most `JOIN_WAIT_S`) for every join under
        way: a request that arrives while the router subscribes to a replica is decided by its
        events, not by the prefix policy with none (a deployment's first requests on one document
        would each start its prefill on another replica). While no replica is followed or being
        joined (a new deployment: Serve polls the replicas' routing stats, their event endpoints,
        every few seconds, and its first requests may come before the first poll), it waits for
        the stats too, within the same bound, once (replicas that publish no events are routed by
        the prefix policy without a wait after that)."""
        self._start_joining(replicas)
        deadline = time.monotonic() + JOIN_WAIT_S
        while (getattr(self.policy, "follows_events", False) and not self._stats_waited and not self._joined
               and not self._joining and time.monotonic() < deadline):
            await asyncio.sleep(STATS_POLL_S)
            self._start_joining(list(self.curr_replicas.values()))  # Serve hands changed stats over
        self._stats_waited = True
        under_way = [t for t in self._join_tasks if not t.done()]
        if under_way:
            await asyncio.wait(under_way, timeout=max(0.0, deadline - time.monotonic()))

    def _start_joining(self, replicas: list[RunningReplica]) -> None:
        self._learn_keying(replicas)
        new = []
        for replica in replicas:
            name = replica.replica_id.unique_id
            meta = (replica.routing_stats or {}).get("kv_event_metadata") or {}
            endpoints = (meta.get("endpoint", ""), meta.get("replay_endpoint", ""))
            if not all(endpoints) or self._joined.get(name) == endpoints or name in self._joining:
                continue
            self._joining.add(name)
            new.append((name, endpoints, int(meta.get("block_size") or 0)))
        if new:
            task = asyncio.ensure_future(self._join(new))
            self._join_tasks.add(task)
            task.add_done_callback(self._join_tasks.discard)

    async def _join(self, new: list[tuple[str, tuple[str, str], int]]) -> None:
        """Subscribe to `new` replicas' events (off the event loop: the tokenizer loads once, a new
        subscription waits for its replay)."""
        keying = self.keying or {"fingerprint": FINGERPRINT, "namespace": ""}
        for name, endpoints, block_size in new:
            info = {"address": " ".join(endpoints), "model": self.model, "fingerprint": keying["fingerprint"],
                    "namespace": keying["namespace"], "page_size": block_size}
            try:
                self.policy.add_worker(name)
                await asyncio.to_thread(self.policy.join, name, info)
                self._joined[name] = endpoints
            except Exception as exc:  # routed by the fallback until it can be followed
                log.warning("tiered-cache router: cannot follow replica %s's KV events: %s", name, exc)
            finally:
                self._joining.discard(name)

    def _learn_keying(self, replicas: list[RunningReplica]) -> None:
        """Key by the connector's chain once a replica says it, before any replica is followed (a
        router that followed some under its own chain keeps it: their indexes are keyed by it)."""
        if self.keying is not None or self._joined or self._joining:
            return
        said = next((k for r in replicas if (k := (r.routing_stats or {}).get("tiered_cache_keying"))), None)
        if not said or int(said.get("page_size") or 0) <= 0:
            return
        self.keying = dict(said)
        self._root, self.policy.events.shard_keys = connector_chain(said)
        self.policy.store_follows = True  # the replicas' connectors write what they compute to the store

    def _salted(self, salt: str) -> bytes:
        """Where the connector's chain of a request under cache salt `salt` starts: the salt is its namespace."""
        return root_key(salt, str((self.keying or {}).get("fingerprint") or FINGERPRINT))

    def _follow_shards(self) -> None:
        """Now and then, in the background, follow the cluster's shards that publish events."""
        if not self.namespace or self.keying is None or time.monotonic() - self._shards_read < SHARDS_EVERY_S:
            return
        if self._shards_task is not None and not self._shards_task.done():
            return
        self._shards_read = time.monotonic()
        self._shards_task = asyncio.ensure_future(self._read_shards())

    async def _read_shards(self) -> None:
        shards = await shard_events(self.namespace)
        if shards is not None:
            await asyncio.to_thread(self.policy.watch_shards, shards)

    def _time_loads(self, replicas: list[RunningReplica]) -> None:
        """Teach the estimate what a load from our tiers costs a request, as the replicas'
        connectors timed it (`load_seconds`, `blocks_loaded` in their routing stats: totals since
        each started; Serve hands the router changed stats through `update_replicas`), rather
        than what store hits' TTFTs leave once their other parts are taken out."""
        page = int((self.keying or {}).get("page_size") or 0)
        if page <= 0:
            return
        seconds, blocks = 0.0, 0
        for replica in replicas:
            figures = (replica.routing_stats or {}).get("tiered_cache") or {}
            now = (float(figures.get("load_seconds") or 0.0), int(figures.get("blocks_loaded") or 0))
            name = replica.replica_id.unique_id
            before = self._loads_seen.get(name, (0.0, 0))
            if now[1] < before[1]:  # a new engine under the same replica: its totals began again
                before = (0.0, 0)
            self._loads_seen[name] = now
            seconds, blocks = seconds + now[0] - before[0], blocks + now[1] - before[1]
        if blocks > 0:
            self.policy.estimate.loads_timed(seconds, blocks * page)

    def _time_prefills(self, replicas: list[RunningReplica]) -> None:
        """Each replica's engine timed a prefill once it started, and a hit on it
        (`tiered_cache_prefill` in its routing stats): one sample of the prefill's rate and of a
        cached token's share per engine, read once (a replica whose engine started again times
        them again)."""
        for replica in replicas:
            timed = (replica.routing_stats or {}).get("tiered_cache_prefill") or {}
            name = replica.replica_id.unique_id
            if timed.get("tokens") and timed.get("seconds") and self._prefills_seen.get(name) != timed:
                self._prefills_seen[name] = dict(timed)
                self.policy.estimate.prefill_timed(float(timed["seconds"]), int(timed["tokens"]),
                                                   float(timed.get("hit_seconds") or 0.0),
                                                   int(timed.get("cached_tokens") or 0))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        name = replica_id.unique_id
        self._joined.pop(name, None)
        self._loads_seen.pop(name, None)
        self._prefills_seen.pop(name, None)
        self.in_flight.pop(name, None)
        self.policy.remove_worker(name)

    # --- routing ----------------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        await self._join_new(candidate_replicas)
        self._follow_shards()
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        # A replica with as many requests as it takes refuses another, and Serve asks again after
        # a back-off (seconds on a loaded cluster), the route decided again: choose among those
        # with room, where any has.
        room = {n: r for n, r in by_name.items() if self.in_flight[n] < r.max_ongoing_requests}
        if room and len(room) < len(by_name):
            self.full_passed += 1
            by_name = room
        prompt, chat = _prompt_of(pending_request)
        if prompt is None:
            self.unparsed += 1
            loads = {name: self.in_flight[name] for name in by_name}
            chosen = min(loads, key=lambda n: (loads[n], n))
            decision = Decision(chosen, "balance", 0)
        else:
            salt = getattr(pending_request.args[0], "cache_salt", None) if pending_request else None
            decision = await self._decide(by_name, prompt, chat, salt or None, self._holding < HOLDS_AT_MOST)
            if decision.hold_s > 0:
                decision = await self._hold(decision, pending_request, by_name, prompt, chat, salt or None)
        if pending_request is not None:
            with self._lock:
                # Serve asks again for a request it could not place (a replica refused or died):
                # the new decision replaces the old one, which no longer counts.
                previous = self._decisions.get(pending_request.metadata.internal_request_id)
                if previous is not None:
                    self.asked_again += 1
                    self.in_flight[previous.worker] = max(0, self.in_flight[previous.worker] - 1)
                    self.routed[previous.worker] -= 1
                self._decisions[pending_request.metadata.internal_request_id] = decision
                self.recent[pending_request.metadata.request_id] = route_report(decision)
                self._routes[pending_request.metadata.request_id] = decision
                while len(self.recent) > RECENT:
                    self._routes.pop(self.recent.popitem(last=False)[0], None)
                self.in_flight[decision.worker] += 1
                self.routed[decision.worker] += 1
            if previous is not None:
                self.policy.finished(previous.worker, previous)
            _say_load_ahead(pending_request, decision)
        rest = [r for name, r in sorted(by_name.items()) if name != decision.worker]
        return [[by_name[decision.worker]], *([rest] if rest else [])]

    async def _decide(self, by_name: Mapping[str, RunningReplica], prompt: Any, chat: bool, salt: str | None,
                      hold: bool) -> Decision:
        """The policy's decision (off the loop: it tokenizes), one at a time in the order requests
        asked: each sees the ones decided before it as pending where they went (requests that
        waited together for a subscription are decided in their order of arrival)."""
        async with self._deciding:
            loads = {name: self.in_flight[name] for name in by_name}
            return await asyncio.to_thread(self.policy.choose, prompt_text(prompt), loads, prompt, chat, salt, hold)

    async def _hold(self, decision: Decision, pending: PendingRequest, by_name: Mapping[str, RunningReplica],
                    prompt: Any, chat: bool, salt: str | None) -> Decision:
        """Hold a request back until the store pages its decision counted have landed (another
        replica is computing them; its engine writes them through). It is decided again, without
        holding (`expired_holds`), once that prefill has had its first token `LAND_WAIT_S` ago
        and they have not landed, or after `decision.hold_s` in all."""
        started = time.monotonic()
        self._holding += 1
        self._held.append(pending)
        self._maybe_start_routing_tasks()  # a request waiting behind this one gets a task of its own
        try:
            while not self.policy.landed(decision):
                ended = self.policy.source_ended(decision)
                now = time.monotonic()
                if (ended is not None and now - ended >= LAND_WAIT_S) or now - started >= decision.hold_s:
                    self.policy.finished(decision.worker, decision)
                    self.expired_holds += 1
                    decision = await self._decide(by_name, prompt, chat, salt, False)
                    break
                await asyncio.sleep(HOLD_POLL_S)
        finally:
            self._holding -= 1
        return dataclasses.replace(decision, held_s=time.monotonic() - started)

    @property
    def max_num_routing_tasks(self) -> int:
        """Serve's bound on its routing tasks (twice the replicas), plus one for each request held
        and not yet handed to its replica: a held request keeps the task that routes it busy until
        its pages land, and every other request is still routed by as many tasks as Serve would
        run without holds. A held request counts until Serve has placed it: a routing task that
        finds more tasks than its bound gives up the request it took (Serve's
        `_fulfill_pending_requests`), which must not happen to one just released."""
        held = self._held = [p for p in getattr(self, "_held", ()) if not p.future.done()]
        return super().max_num_routing_tasks + len(held)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        with self._lock:
            decision = self._decisions.pop(internal_request_id, None)
            if decision is None:
                return
            self.in_flight[decision.worker] = max(0, self.in_flight[decision.worker] - 1)
        self.policy.finished(decision.worker, decision)

    def stats(self) -> dict[str, Any]:
        """What `stats --ray` shows for the router: routes, in flight, fallbacks and its sources,
        and each replica's connector figures (from its routing stats, TieredCacheLLMServer)."""
        connectors = {rid.unique_id: dict((r.routing_stats or {}).get("tiered_cache") or {})
                      for rid, r in self.curr_replicas.items()}
        return {"policy": "events", "routed": dict(self.routed), "in_flight": dict(self.in_flight),
                "unparsed": self.unparsed, "expired_holds": self.expired_holds,
                "full_passed": self.full_passed, "asked_again": self.asked_again,
                "replicas": sorted(self._joined), "connectors": connectors,
                "keying": self.keying,
                **self.policy.stats()}


async def shard_events(namespace: str) -> dict[str, dict[str, str] | None] | None:
    """Each live store shard of the cluster in Ray namespace `namespace` and its KV event endpoints
    (None: it publishes none, or did not answer); None when the directory cannot be read."""
    try:
        directory = ray.get_actor(DIRECTORY, namespace=namespace)
        snapshot = await asyncio.wait_for(directory.snapshot.remote(), SHARDS_WAIT_S)
    except (ValueError, asyncio.TimeoutError, ray.exceptions.RayError):
        return None
    names = [m["name"] for m in snapshot["members"] if m["kind"] == SHARD]
    infos = await asyncio.gather(*(member_info(n, namespace) for n in names))
    return {name: None if info is None else info.get("events") for name, info in zip(names, infos, strict=True)}


def route_report(decision: Decision) -> dict[str, Any]:
    """What an answer says of its route: the replica, why, and (routed by events) the prompt
    tokens the router expected it to find in a cache, by tier (its device, host RAM, the store),
    the work it expected ahead of it there, its expected TTFT there and the score that chose it
    (that TTFT plus what it costs the requests after it); `others`: the same for each replica
    passed over (the `OTHERS_SHOWN` best scored), so a route that looks wrong shows what the
    router believed."""
    report: dict[str, Any] = {"replica": decision.worker, "reason": decision.reason}
    if decision.reason == "events":
        report["expected_cached_tokens"] = decision.matched
        report["expected_from"] = _by_tier(decision.expected)  # where the router expected them: which tier
        report["expected_wait_ms"] = round(decision.wait_s * 1e3)  # the prefills it expected ahead there
        if decision.held_s:  # held in the router until the store had what another replica computed
            report["held_ms"] = round(decision.held_s * 1e3)
        weighed = {c.worker: c for c in decision.considered}
        if decision.worker in weighed:
            chosen = weighed.pop(decision.worker)
            report.update(expected_ttft_ms=round(chosen.ttft_s * 1e3), score_ms=round(chosen.score_s * 1e3))
        if weighed:  # the runners-up, best first (a stream's header carries it: a few, not every replica)
            runners_up = sorted(weighed.values(), key=lambda c: c.score_s)[:OTHERS_SHOWN]
            report["others"] = {c.worker: _considered(c) for c in runners_up}
    return report


def _by_tier(tokens: tuple[int, int, int]) -> dict[str, int]:
    device, host, store = tokens
    return {"device": device, "host": host, "store": store}


def _considered(c: Considered) -> dict[str, Any]:
    return {"expected_from": _by_tier(c.expected),
            "expected_wait_ms": round(c.wait_s * 1e3), "expected_ttft_ms": round(c.ttft_s * 1e3),
            "score_ms": round(c.score_s * 1e3)}


def _registry() -> list[TieredCacheRouter]:
    """This process's routers. Serve may hand the router class over by value (with its own copy
    of this module's globals): the registry is always the imported module's."""
    return importlib.import_module(__name__).ROUTERS


def route_of(request_id: str) -> dict[str, Any] | None:
    """The route of a recent request (Serve's request id), from this process's routers."""
    return next((r.recent[request_id] for r in _registry() if request_id in r.recent), None)


def learn(request_id: str, answer: Mapping[str, Any], latency_s: float) -> None:
    """Teach the router that routed `request_id` what its answer took (ttft_s, prompt_tokens,
    reused_tokens, timed by the front end): its estimate learns this hardware's prefill rate and
    service time. A request held in the router spent its hold inside that TTFT, before any
    replica saw it: taken out, with the part of the wait it expected that the hold covered (else
    the hold would be charged to the store's load)."""
    routed = _routed(request_id)
    if routed is not None:
        router, decision = routed
        held = decision.held_s
        answer = {**answer, "ttft_s": float(answer.get("ttft_s") or 0.0) - held}
        ahead = max(0.0, decision.wait_s - held)
        router.policy.learn(with_store_share(answer, decision.expected, ahead), latency_s - held)


def first_token(request_id: str) -> None:
    """Tell the router that routed `request_id` that its answer's first token came: its prefill
    no longer holds up the requests behind it on that replica."""
    routed = _routed(request_id)
    if routed is not None:
        router, decision = routed
        router.policy.first_token(decision.worker, decision)


def _routed(request_id: str) -> tuple[TieredCacheRouter, Decision] | None:
    """The router of this process that routed a recent request (Serve's request id), and its decision."""
    router = next((r for r in _registry() if request_id in r.recent), None)
    decision = router._routes.get(request_id) if router is not None else None
    return None if router is None or decision is None else (router, decision)


def _prompt_of(pending: PendingRequest | None) -> tuple[Any, bool]:
    """(prompt, chat) of a pending request's OpenAI body (`prompt_of`)."""
    if pending is None or not pending.args:
        return None, False
    return prompt_of(pending.args[0])


def _say_load_ahead(pending: PendingRequest, decision: Decision) -> None:
    """Mark a request the chosen replica will load from our tiers beyond what its device holds (in
    the body's `kv_transfer_params`, which travels with it): the replica then tells its workers to
    start loading (`llm_server.py`). A replica holding the prefix gets no mark, so no store read
    goes to waste; Serve asking again clears or renews it."""
    device, host, store = decision.expected
    body = pending.args[0] if pending.args else None
    if body is None or not hasattr(body, "kv_transfer_params"):
        return
    params = {k: v for k, v in (body.kv_transfer_params or {}).items() if k != LOAD_AHEAD}
    if max(host, store) > device:
        params[LOAD_AHEAD] = True
    body.kv_transfer_params = params or None


def load_ahead(body: Any) -> bool:
    """Whether the router marked this request for its replica to start loading it (`_say_load_ahead`)."""
    return bool((getattr(body, "kv_transfer_params", None) or {}).get(LOAD_AHEAD))


def prompt_tokens(tokenizer: Any, body: Any) -> list[int] | None:
    """The token ids a replica's engine will see for an OpenAI body, keyed as this router keys
    them; None for a body it does not key (a batch of prompts)."""
    prompt, chat = prompt_of(body)
    return None if prompt is None else encode(tokenizer, prompt, chat)


def prompt_of(body: Any) -> tuple[Any, bool]:
    """(prompt, chat) of an OpenAI request body: a completion's prompt (text or token ids), a
    chat's messages; (None, False) for anything else (a batch of prompts)."""
    messages = getattr(body, "messages", None)
    if messages:
        return [_message(m) for m in messages], True
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, str):
        return prompt, False
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return prompt, False
    return None, False


def _message(message: Any) -> Mapping[str, str]:
    data = message if isinstance(message, Mapping) else getattr(message, "model_dump", lambda: {})()
    content = data.get("content")
    if isinstance(content, list):  # OpenAI content parts: the text ones, in order
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return {"role": str(data.get("role", "")), "content": str(content or "")}


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)
