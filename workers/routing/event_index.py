"""`ClusterEvents`: the router's picture of where every page is, from the cluster's KV events.

One subscriber (tiered_cache/events/subscriber.py) per worker's cache and per shard, each feeding
a `BlockIndex`. For a prompt's page keys it answers, per worker, how many leading pages lie on
its device, then how many more in its host RAM, and how many more after those the store holds
(any shard: every worker reads every shard). A source whose last batch (events, or the
publisher's heartbeat) is older than `stale_after_s` is stale: the router then does not trust the
picture (`fresh`) and falls back to guessing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiered_cache.events.block_index import BlockIndex
from tiered_cache.events.schema import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE
from tiered_cache.events.subscriber import EventSubscriber

STALE_AFTER_S = 3.0  # three missed heartbeats (tiered_cache/events/recorder.py)
READY_WAIT_S = 3.0  # for a new subscriber's replay (it gives up on its own after 2 s)


@dataclass
class Source:
    endpoint: str
    replay: str
    index: BlockIndex
    subscriber: EventSubscriber
    incarnation: str = ""


@dataclass(frozen=True)
class Holdings:
    device: int  # leading pages on the worker's device
    host: int  # the pages after those in its host RAM
    store: int  # the pages after those in the store


class ClusterEvents:
    def __init__(self, stale_after_s: float | None = STALE_AFTER_S, index: Callable[[], BlockIndex] = BlockIndex,
                 host_mediums: tuple[str, ...] = (MEDIUM_CPU,), store_mediums: tuple[str, ...] = (MEDIUM_STORAGE,)
                 ) -> None:
        """`stale_after_s` None: a source that publishes no heartbeat (a vLLM engine) is fresh
        while its subscription lives and has read its replay. `index` makes each worker's index (a
        shard's is a plain `BlockIndex`: it tells our page keys themselves);
        a worker's own `host_mediums` count as its host RAM, any source's `store_mediums` as the
        store every worker reads (a vLLM replica's connector tells its blocks as CPU, written
        through to the shared store: `store_mediums` there)."""
        self.stale_after_s = stale_after_s
        self._index = index
        self.host_mediums = host_mediums
        self.store_mediums = store_mediums
        self.workers: dict[str, Source] = {}
        self.shards: dict[str, Source] = {}
        # The keys a shard tells for a prompt's keys (a store page per block; a reader whose shards
        # name pages otherwise, per layer group, sets it).
        self.shard_keys: Callable[[Sequence[bytes]], Sequence[bytes]] = list
        self._lock = threading.Lock()

    def watch(self, name: str, endpoint: str, replay: str, shard: bool = False, incarnation: str = "") -> None:
        """Subscribe to `name`'s events, again from the start when its endpoints or its
        `incarnation` (a new cache behind the same endpoints) changed."""
        sources = self.shards if shard else self.workers
        with self._lock:
            old = sources.get(name)
            same = old is not None and (old.endpoint, old.replay, old.incarnation) == (endpoint, replay, incarnation)
            if same and old.subscriber.alive:
                return
            index = BlockIndex() if shard else self._index()  # a shard tells our page keys themselves
            subscriber = EventSubscriber(endpoint, replay, index.apply, index.clear).start()
            sources[name] = Source(endpoint, replay, index, subscriber, incarnation)
        if old is not None:
            old.subscriber.close()
        # What it holds now, from the replay, before the router routes with it (bounded: a source
        # that does not answer is stale until it does).
        subscriber.ready.wait(READY_WAIT_S)

    def forget(self, name: str) -> None:
        with self._lock:
            gone = [s.pop(name) for s in (self.workers, self.shards) if name in s]
        for source in gone:
            source.subscriber.close()

    def fresh(self, name: str) -> bool:
        """Whether `name`'s events are live: a batch (or heartbeat) within `stale_after_s`."""
        source = self.workers.get(name)
        if source is None or not source.subscriber.alive:
            return False
        if self.stale_after_s is None:
            return source.subscriber.ready.is_set()
        last = source.subscriber.last_batch
        return bool(last) and time.monotonic() - last < self.stale_after_s

    def holdings(self, name: str, keys: Sequence[bytes], coming: int = 0) -> Holdings:
        """`coming`: leading pages a request already sent there will have put on its device by the
        time this one runs (it queues behind)."""
        index = self.workers[name].index
        device = max(coming, index.leading(keys, (MEDIUM_GPU,)))
        host = index.leading(keys[device:], self.host_mediums) if self.host_mediums else 0
        return Holdings(device, host, self._stored(keys[device + host:]))

    def _stored(self, keys: Sequence[bytes]) -> int:
        """Leading pages of `keys` some shard holds (or, with no shard watched, some worker tells in
        a store medium)."""
        indexes = [s.index for s in self.shards.values()]
        if indexes:
            keys = self.shard_keys(keys)
        else:
            indexes = [s.index for s in self.workers.values()]
        held = 0
        for key in keys:
            if not any(not index.mediums(key).isdisjoint(self.store_mediums) for index in indexes):
                break
            held += 1
        return held

    def stats(self) -> dict[str, dict[str, int | bool]]:
        out: dict[str, dict[str, int | bool]] = {}
        for name, source in {**self.workers, **self.shards}.items():
            sub = source.subscriber
            out[name] = {"pages": len(source.index), "batches": sub.batches, "gaps": sub.gaps,
                         "replays": sub.replays, "restarts": sub.restarts,
                         "fresh": name in self.shards or self.fresh(name)}
        return out

    def close(self) -> None:
        with self._lock:
            sources = [*self.workers.values(), *self.shards.values()]
            self.workers, self.shards = {}, {}
        for source in sources:
            source.subscriber.close()
