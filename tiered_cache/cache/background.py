"""Background work of a `TieredCache`: a thread per queue, each with a bounded queue of jobs.

The request path only submits: `submit` never blocks, and a full queue drops the job and counts
it (a dropped demotion loses a copy below, never correctness: the pages stay where they were or
are recomputed). `flush` waits until everything submitted so far has run, for tests, benches
and an orderly shutdown. Jobs that raise are counted and logged; the thread keeps serving.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueueStats:
    name: str
    depth: int  # jobs waiting now
    capacity: int
    submitted: int
    done: int
    dropped: int  # refused because the queue was full
    failed: int  # raised while running


# Background threads run at a lower CPU priority than the threads serving requests: where both
# want a core (and they share the host's cores with the Redis or store server), the scheduler
# gives it to the request. Linux lets a thread raise its own nice value without privileges.
BACKGROUND_NICE = 10


def lower_priority(nice: int) -> bool:
    """Raise the calling thread's nice value by `nice` (Linux: per thread); False where it cannot."""
    if not nice or not sys.platform.startswith("linux"):
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        return False
    return True


class BackgroundQueue:
    """One daemon thread running submitted jobs in order, with at most `capacity` waiting."""

    def __init__(self, name: str, capacity: int, nice: int = 0) -> None:
        if capacity <= 0:
            raise ValueError(f"{name}: queue capacity must be positive, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.nice = nice
        # (job, args, is_job): flush markers ride the same queue but are not counted as jobs.
        self._jobs: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], bool] | None] = queue.Queue(capacity + 1)
        self._counts = {"submitted": 0, "done": 0, "dropped": 0, "failed": 0}
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None  # started by the first submit: idle caches cost no thread

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"tiered-cache-{self.name}", daemon=True)
                self._thread.start()

    def submit(self, job: Callable[..., Any], *args: Any) -> bool:
        """Queue `job(*args)`; False (and counted as dropped) when the queue is full or closed."""
        if self._closed:
            self._add("dropped")
            return False
        self._start()
        try:
            if self._jobs.qsize() >= self.capacity:
                raise queue.Full
            self._jobs.put_nowait((job, args, True))
        except queue.Full:
            self._add("dropped")
            return False
        self._add("submitted")
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far has run; False if `timeout` passed first."""
        if self._closed or self._thread is None:
            return True
        done = threading.Event()
        self._jobs.put((done.set, (), False))  # FIFO: runs after everything queued before it
        return done.wait(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Run what is queued (waiting up to `timeout`), then stop the thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)

    def stats(self) -> QueueStats:
        with self._lock:
            counts = dict(self._counts)
        return QueueStats(self.name, self._jobs.qsize(), self.capacity, **counts)

    def _add(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def _run(self) -> None:
        lower_priority(self.nice)
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, args, is_job = item
            try:
                job(*args)
            except Exception:  # a background job must never kill the thread
                log.exception("tiered-cache %s: background job failed", self.name)
                self._add("failed")
            else:
                if is_job:
                    self._add("done")


class QueueOwner:
    """A part whose slow work runs on one `BackgroundQueue` of its own (the demoter, the lower
    writer, the spare output): its flush, figures and close are the queue's."""

    def __init__(self, queue: BackgroundQueue) -> None:
        self.queue = queue

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the jobs queued so far have run; False if `timeout` passed first."""
        return self.queue.flush(timeout)

    def stats(self) -> QueueStats:
        return self.queue.stats()

    def close(self) -> None:
        """Run what is queued, then stop the queue's thread."""
        self.queue.close()
