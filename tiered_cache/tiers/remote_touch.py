"""Telling same-host store servers which pages were read where they lie, in batches.

A page read straight from a server's arena, through the arena's published index, costs the server
nothing and tells it nothing; but its eviction gives pages that are read a second chance. So the
keys read that way are told to their server afterwards, as a Lookup it answered would have (a
Lookup marks them read and leases them): gathered for `TOUCH_DELAY_S` and sent in one Lookup per
server, off the moments a request copies pages.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tiered_cache.shm.arena_map import ArenaMap
from tiered_cache.tiers.remote_servers import Server, StoreServers

TOUCH_DELAY_S = 0.2  # pages read through an arena's index are told to its server this much later
MAX_TOUCH_KEYS = 1 << 16  # keys waiting to be told to one server


class Toucher:
    """Batches of read keys per server, each sent once `TOUCH_DELAY_S` after its first key.
    Past `MAX_TOUCH_KEYS` waiting for one server, keys are dropped and counted (`dropped`):
    they only inform eviction."""

    def __init__(self, servers: StoreServers) -> None:
        self._servers = servers
        # Its thread is started now: a thread started by the first touch would cost that request
        # a millisecond or more.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remote-tier-touch")
        self._pool.submit(lambda: None)
        self._lock = threading.Lock()
        self._waiting: dict[Server, dict[bytes, None]] = {}  # keys read, to tell each server
        self._arenas: dict[Server, ArenaMap] = {}  # the map each server's waiting keys were read in
        self.dropped = 0

    def touch(self, server: Server, keys: list[bytes], arena: ArenaMap) -> None:
        """Tell `server`, in the background, that these pages of its `arena` are being read."""
        with self._lock:
            waiting = self._waiting.get(server)
            first = waiting is None
            if first:
                waiting = self._waiting[server] = {}
                self._arenas[server] = arena
            room = MAX_TOUCH_KEYS - len(waiting)
            self.dropped += max(0, len(keys) - room)
            waiting.update(dict.fromkeys(keys[:max(0, room)]))
        if not first:
            return

        def send() -> None:
            time.sleep(TOUCH_DELAY_S)
            with self._lock:
                sent = list(self._waiting.pop(server, {}))
                self._arenas.pop(server, None)
            self._tell(server, sent, arena)

        try:
            self._pool.submit(send)
        except RuntimeError:  # closed meanwhile
            with self._lock:
                self._waiting.pop(server, None)
                self._arenas.pop(server, None)

    def close(self) -> None:
        """Tell each server the keys still waiting now, then stop (call it before the servers'
        channels close): pages read just before a client closes still count as read there."""
        with self._lock:
            waiting, self._waiting = self._waiting, {}
            arenas, self._arenas = self._arenas, {}
        self._pool.shutdown(wait=False, cancel_futures=True)
        for server, keys in waiting.items():
            self._tell(server, list(keys), arenas[server])

    def _tell(self, server: Server, keys: list[bytes], arena: ArenaMap) -> None:
        if keys and not self._servers.closed:
            self._servers.call(server, lambda client: client.lookup(keys, arena=arena), None)
