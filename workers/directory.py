"""`ClusterDirectory`: the named actor that knows who is in the cluster.

Shards register their gRPC address, workers their name, each on start. The directory pings every
member each `health_interval_s` and drops one whose actor is dead, so a killed shard leaves the
ring within a few seconds. A member that is alive but slow to answer (a busy node) stays: its
missed pings are only counted, since dropping it would move a whole shard's keys, and the
workers' remote tier already skips a server that does not answer (backoff). `version` grows on every change:
workers poll `shards()` and rebuild their rendezvous ring only when it moved. A member that comes
back (same name) registers again, with whatever address it has now. A restarted directory finds
the running shards and workers by their names in the namespace within a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray

from tiered_cache.workers.names import SHARD_PREFIX, WORKER_PREFIX

SHARD, WORKER = "shard", "worker"
log = logging.getLogger("tiered_cache.workers.directory")
_DISCOVER_EVERY = 5
_READY_TIMEOUT_S = 10.0  # health rounds between two looks for named actors that are not members


@dataclass
class Member:
    kind: str  # SHARD or WORKER
    name: str
    address: str  # HOST:PORT of a shard's store server; "" for a worker
    node_id: str
    handle: Any
    since: float
    missed: int = 0


class ClusterDirectory:
    def __init__(self, health_interval_s: float = 1.0) -> None:
        self.health_interval_s = health_interval_s
        self.members: dict[str, Member] = {}
        # Versions start at the clock (µs), so a restarted directory's never repeat an old one's.
        self.version = time.time_ns() // 1000
        self._health: asyncio.Task[None] | None = None
        self._ready: asyncio.Event | None = None  # set once the first discovery round is done

    def _watch(self) -> None:
        # Started from the first call: an async actor's loop is running by then.
        if self._health is None:
            self._ready = asyncio.Event()
            self._health = asyncio.get_running_loop().create_task(self._health_loop())

    async def _discovered(self) -> None:
        """Answer about members only after the first discovery round: a restarted directory must
        not tell workers "no shards" (they would empty their rings) before it has looked."""
        self._watch()
        assert self._ready is not None
        if not self._ready.is_set():
            with contextlib.suppress(asyncio.TimeoutError):  # then answer with what is known
                await asyncio.wait_for(self._ready.wait(), timeout=_READY_TIMEOUT_S)

    async def register(self, kind: str, name: str, address: str, node_id: str) -> int:
        """Add or refresh a member; returns the directory version."""
        self._watch()
        if kind not in (SHARD, WORKER):
            raise ValueError(f"kind must be {SHARD!r} or {WORKER!r}, got {kind!r}")
        handle = ray.get_actor(name)
        old = self.members.get(name)
        if old is None or (old.address, old.node_id) != (address, node_id):
            self.version += 1
        self.members[name] = Member(kind, name, address, node_id, handle, time.time())
        return self.version

    async def unregister(self, name: str) -> int:
        self._watch()
        if self.members.pop(name, None) is not None:
            self.version += 1
        return self.version

    async def shards(self) -> tuple[int, list[str]]:
        """(version, the live shards' addresses, sorted)."""
        await self._discovered()
        return self.version, sorted(m.address for m in self.members.values() if m.kind == SHARD)

    async def snapshot(self) -> dict[str, Any]:
        """Every member: kind, name, address, node and how long it has been registered."""
        await self._discovered()
        now = time.time()
        members = sorted(self.members.values(), key=lambda m: m.name)
        return {"version": self.version,
                "members": [{"kind": m.kind, "name": m.name, "address": m.address, "node_id": m.node_id,
                             "up_s": now - m.since, "missed_pings": m.missed} for m in members]}

    async def ping(self) -> str:
        return "directory"

    async def _discover(self) -> None:
        """Register the cluster's named shards and workers that are not members: after this
        directory was restarted, nobody would register again (they did so once, at start).
        Asked all at once: an actor still starting (it registers itself when ready) costs one
        timeout, not one each."""
        names = [n for n in ray.util.list_named_actors()
                 if n not in self.members and n.startswith((SHARD_PREFIX, WORKER_PREFIX))]
        infos = await asyncio.gather(*(self._info(n) for n in names))
        for name, info in zip(names, infos, strict=True):
            if info is not None and name not in self.members:
                await self.register(info["kind"], name, info.get("address", ""), info["node_id"])

    async def _info(self, name: str) -> dict[str, Any] | None:
        try:
            handle = ray.get_actor(name)
            return await asyncio.wait_for(handle.info.remote(), timeout=max(2.0, self.health_interval_s))
        except (asyncio.TimeoutError, ValueError, ray.exceptions.RayError):
            return None  # still starting, or already gone

    async def _health_loop(self) -> None:
        for beat in itertools.count():
            try:
                if beat % _DISCOVER_EVERY == 0:
                    await self._discover()
                    assert self._ready is not None
                    self._ready.set()
                await asyncio.sleep(self.health_interval_s)
                await self._check_members()
            except Exception:  # one bad round must not end the loop: it is the directory's heartbeat
                log.exception("cluster directory: health round failed")

    async def _check_members(self) -> None:
        members = list(self.members.values())
        results = await asyncio.gather(*(self._alive(m) for m in members))
        for member, alive in zip(members, results, strict=True):
            if self.members.get(member.name) is not member:
                continue  # re-registered meanwhile
            member.missed = 0 if alive else member.missed + 1
            if alive is None:
                del self.members[member.name]
                self.version += 1

    async def _alive(self, member: Member) -> bool | None:
        """True: answered; False: no answer in time; None: the actor is dead."""
        try:
            await asyncio.wait_for(member.handle.ping.remote(), timeout=max(1.0, self.health_interval_s))
        except asyncio.TimeoutError:
            return False
        except ray.exceptions.RayActorError:
            return None
        return True
