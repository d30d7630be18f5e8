"""`PrefixRouter`: the async Ray actor every request goes through.

It keeps the live workers from the directory (re-read at most once per `_REFRESH_S`), counts each
worker's requests in flight, and asks its routing policy (`routing/`) where a prompt should go:
the worker most likely to hold its longest prefix unless that would overload it, or plain round
robin. A worker that dies mid-request is dropped and the request goes to another one, up to
`retries` times; the caller gets an answer or a clear error, never a hang. A worker that joins is
asked for the prompts it holds, so a restarted router does not start blind.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import ray

from tiered_cache.integrations.chat_messages import checked_messages
from tiered_cache.workers.config import RouterSettings, RoutingPolicyName
from tiered_cache.workers.directory import SHARD, WORKER
from tiered_cache.workers.names import DIRECTORY
from tiered_cache.workers.routing import Decision, Prompt, RoutingPolicy, make_policy, prompt_text

_REFRESH_S = 1.0
_DIRECTORY_WAIT_S = 2.0  # one directory or worker look-up during a refresh, at most
_NO_WORKER_WAIT_S = 30.0  # how long a request waits for a first live worker before it fails


class NoWorkerError(RuntimeError):
    """No live worker could serve the request."""


class PrefixRouter:
    def __init__(self, settings: RouterSettings | None = None) -> None:
        self._refreshing = asyncio.Lock()
        self._begin(settings)

    def _begin(self, settings: RouterSettings | None) -> None:
        """Its policy from `settings`, and no worker, load or figure yet."""
        self.settings = settings or RouterSettings()
        s = self.settings
        thresholds = {} if s.policy is RoutingPolicyName.ROUND_ROBIN else {
            "cache_threshold": s.cache_threshold, "balance_abs_threshold": s.balance_abs_threshold,
            "balance_rel_threshold": s.balance_rel_threshold}
        self.policy: RoutingPolicy = make_policy(s.policy.value, **thresholds)
        self.workers: dict[str, Any] = {}  # name -> actor handle
        self.addresses: dict[str, str] = {}  # name -> what the directory lists (a worker's KV event endpoints)
        self.loads: Counter[str] = Counter()  # requests in flight per worker
        self.routed: Counter[str] = Counter()  # requests sent per worker
        self.reasons: Counter[str] = Counter()  # why: prefix / balance / least_cached / round_robin
        self.failures = 0  # requests that found their worker dead and were sent elsewhere
        self.directory_misses = 0  # refreshes that could not reach the directory
        self._version = -1
        self._refreshed = 0.0

    async def _refresh(self, force: bool = False) -> None:
        async with self._refreshing:  # one refresh at a time; the others wait for its result
            if not force and time.monotonic() - self._refreshed < _REFRESH_S:
                return
            self._refreshed = time.monotonic()
            try:  # bounded: a directory that is restarting or gone must not hold every request
                snapshot = await asyncio.wait_for(ray.get_actor(DIRECTORY).snapshot.remote(), _DIRECTORY_WAIT_S)
            except (ValueError, asyncio.TimeoutError, ray.exceptions.RayError):
                self.directory_misses += 1  # keep routing to the workers known so far
                return
            members = {m["name"]: m for m in snapshot["members"]}
            live = {name for name, m in members.items() if m["kind"] == WORKER}
            if snapshot["version"] == self._version and live <= set(self.workers):
                return
            self._version = snapshot["version"]
            for name in set(self.workers) - live:
                self._drop(name)
            # New workers, ones dropped after a failed call that Ray has restarted since (same
            # name, same version), and ones whose cache is new (its events start over): routable
            # once they answer, with what they hold; asked all at once.
            joining = sorted(n for n in live if n not in self.workers or self.addresses.get(n) != members[n]["address"])
            summaries = await asyncio.gather(*(_summary(name) for name in joining))
            for name, found in zip(joining, summaries, strict=True):
                if found is not None:  # else still starting: asked again on the next refresh
                    handle, prompts, info = found
                    self.workers[name] = handle
                    self.addresses[name] = members[name]["address"]
                    self.policy.add_worker(name)
                    self.policy.observe(name, prompts)
                    await asyncio.to_thread(self.policy.join, name, info)  # may load a tokenizer
            if self.policy.follows_events:
                await self._watch_shards([n for n, m in members.items() if m["kind"] == SHARD])

    async def _watch_shards(self, names: list[str]) -> None:
        """Tell the policy the live shards and their event endpoints (a shard that does not answer
        now: None, kept as it was)."""
        infos = await asyncio.gather(*(member_info(n) for n in names))
        shards = {name: info.get("events") if info is not None else None
                  for name, info in zip(names, infos, strict=True)}
        await asyncio.to_thread(self.policy.watch_shards, shards)

    def _drop(self, name: str) -> None:
        self.workers.pop(name, None)
        self.addresses.pop(name, None)
        self.loads.pop(name, None)
        self.policy.remove_worker(name)

    async def generate(self, prompt: Prompt, max_new_tokens: int | None = None, use_cache: bool = True,
                       chat: bool = True) -> dict[str, Any]:
        """Route `prompt` (text, or chat messages) and return the worker's answer plus `route`
        (worker, reason, matched chars)."""
        text = _checked(prompt)
        for _attempt in range(self.settings.retries + 1):
            decision = await self._choose(text, prompt, chat)
            started = time.perf_counter()
            try:
                result = await self.workers[decision.worker].generate.remote(prompt, max_new_tokens, use_cache, chat)
            except ray.exceptions.RayActorError:
                self._lost(decision.worker)
                continue
            finally:
                self._done(decision)
            latency = time.perf_counter() - started
            self._learn(result, latency, use_cache)
            return {**result, "latency_s": latency, "route": _route(decision)}
        raise NoWorkerError(f"every worker tried for this request died ({self.settings.retries + 1} attempts)")

    async def stream(self, prompt: Prompt, max_new_tokens: int | None = None, use_cache: bool = True,
                     chat: bool = True) -> AsyncIterator[dict[str, Any]]:
        """`generate`, token by token (`CacheWorker.stream`'s items; the last one with `route`). A
        worker that dies before its first token is replaced as in `generate`; after it, the
        stream ends with the error (the tokens sent cannot be taken back)."""
        text = _checked(prompt)
        for _attempt in range(self.settings.retries + 1):
            decision = await self._choose(text, prompt, chat)
            started = time.perf_counter()
            sent = 0
            try:
                async for ref in self.workers[decision.worker].stream.remote(prompt, max_new_tokens, use_cache, chat):
                    item = await ref
                    if "token" not in item:  # the whole answer, last
                        self._learn(item, time.perf_counter() - started, use_cache)
                        item = {**item, "latency_s": time.perf_counter() - started, "route": _route(decision)}
                    yield item
                    sent += 1
                return
            except ray.exceptions.RayActorError:
                self._lost(decision.worker)
                if sent:
                    raise
            finally:
                self._done(decision)
        raise NoWorkerError(f"every worker tried for this request died ({self.settings.retries + 1} attempts)")

    def _learn(self, answer: dict[str, Any], latency_s: float, use_cache: bool) -> None:
        if use_cache:
            self.policy.learn(answer, latency_s)

    async def _choose(self, text: str, prompt: Prompt, chat: bool) -> Decision:
        await self._refresh()
        deadline = time.monotonic() + _NO_WORKER_WAIT_S
        while not self.workers and time.monotonic() < deadline:
            # None known yet (a router just restarted, the directory or the workers restarting
            # too): wait for them, bounded, rather than fail a request a moment too early.
            await self._refresh(force=True)
            if not self.workers:
                await asyncio.sleep(_REFRESH_S / 2)
        if not self.workers:
            if self.directory_misses and self._version < 0:
                raise NoWorkerError("no cache worker known: the cluster directory does not answer "
                                    "(restarting, or gone: run `tiered-cache cluster start`)")
            raise NoWorkerError(f"no live cache worker after {_NO_WORKER_WAIT_S:.0f} s: "
                                "run `tiered-cache cluster start`")
        loads = {name: self.loads[name] for name in self.workers}
        if self.policy.choose_blocks:
            decision = await asyncio.to_thread(self.policy.choose, text, loads, prompt, chat)
        else:
            decision = self.policy.choose(text, loads, prompt, chat)
        self.loads[decision.worker] += 1
        self.routed[decision.worker] += 1
        self.reasons[decision.reason] += 1
        return decision

    def _done(self, decision: Decision) -> None:
        if decision.worker in self.loads:
            self.loads[decision.worker] -= 1
        self.policy.finished(decision.worker, decision)

    def _lost(self, worker: str) -> None:
        self.failures += 1
        self._drop(worker)

    async def reset(self, settings: RouterSettings | None = None) -> None:
        """Forget every worker, load and figure, with `settings`' policy (a benchmark's cold start)."""
        async with self._refreshing:
            self.policy.close()
            self._begin(settings)

    async def ping(self) -> str:
        return "router"

    async def info(self) -> dict[str, Any]:
        return {"kind": "router", "name": "router", "node_id": ray.get_runtime_context().get_node_id(),
                "policy": self.settings.policy.value}

    async def stats(self) -> dict[str, Any]:
        await self._refresh()
        policy = self.policy.stats()  # under the policy's name (`events`), when it counts anything
        return {**(await self.info()), "workers": sorted(self.workers), "routed": dict(self.routed),
                "in_flight": dict(self.loads), "reasons": dict(self.reasons), "failures": self.failures,
                "directory_misses": self.directory_misses, **({self.settings.policy.value: policy} if policy else {})}

    async def shutdown(self) -> None:
        await asyncio.sleep(0)


async def _summary(name: str) -> tuple[Any, list[str], dict[str, Any]] | None:
    """A worker's handle, the prompts it holds and its info; None when it is not there or does not answer."""
    try:
        handle = ray.get_actor(name)
        prompts, info = await asyncio.wait_for(
            asyncio.gather(handle.prefix_summary.remote(), handle.info.remote()), _DIRECTORY_WAIT_S)
        return handle, prompts, info
    except (ValueError, asyncio.TimeoutError, ray.exceptions.RayError):
        return None


async def member_info(name: str, namespace: str | None = None) -> dict[str, Any] | None:
    """A member's `info()` (in Ray `namespace`, default this one's), or None when it is not there
    or does not answer."""
    try:
        return await asyncio.wait_for(ray.get_actor(name, namespace=namespace).info.remote(), _DIRECTORY_WAIT_S)
    except (ValueError, asyncio.TimeoutError, ray.exceptions.RayError):
        return None


def _checked(prompt: Prompt) -> str:
    """The prompt's routing text; ValueError for an empty prompt or a malformed chat."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("generate() needs a non-empty prompt string")
        return prompt
    return prompt_text(checked_messages(prompt))


def _route(decision: Decision) -> dict[str, Any]:
    return {"worker": decision.worker, "reason": decision.reason, f"matched_{decision.unit}": decision.matched}
