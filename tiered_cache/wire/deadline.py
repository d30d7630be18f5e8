"""Deadlines of our own on store calls, and the errors they end a call with.

A Get or Put stream gets a *progress* deadline instead of an overall one: it fails only when no
message moves for `idle_s`, so a 10 GiB prefix arrives as long as it keeps arriving, and a peer
that sends nothing, or reads nothing, is let go. Both ends use `ProgressDeadline`: the server on
each stream it serves, the client on each stream it calls. An optional overall budget bounds a
whole client call where the caller wants one (`BudgetSpent` between the calls it is made of).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import grpc


class DeadlineError(grpc.RpcError):
    """A deadline of our own (not gRPC's) ended the call: read as DEADLINE_EXCEEDED."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return str(self)


class StreamStalled(DeadlineError):
    """No message moved on a stream for the progress deadline; the call was cancelled."""

    def __init__(self, what: str, idle_s: float) -> None:
        super().__init__(f"{what}: nothing moved for {idle_s:g} s (progress deadline)")
        self.idle_s = idle_s


class BudgetSpent(DeadlineError):
    """A call's overall budget (`budget_s`) ran out between the RPCs it is made of."""

    def __init__(self, what: str, budget_s: float) -> None:
        super().__init__(f"{what}: its budget of {budget_s:g} s is spent")


class ProgressDeadline:
    """A progress deadline for one stream: `progress()` after every message; when `idle_s` pass
    without one, `stalled` becomes True and `on_stall()` runs once (it cancels the call, or the
    task serving it); `close()` when the stream is over. `error()` is the `StreamStalled` to end
    the call with.

    With `loop`, the deadline is a timer on that event loop (create and close it on the loop's
    thread): one timer per stream, re-armed lazily, so a message costs nothing beyond reading the
    clock (a `wait_for` per message, which makes a task each time, cost a third of the throughput
    of small pages). Without, a daemon thread waits for it."""

    def __init__(self, idle_s: float, what: str, on_stall: Callable[[], object],
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.idle_s = idle_s
        self.what = what
        self.stalled = False
        self._on_stall = on_stall
        self._last = time.monotonic()
        self._loop = loop
        self._done = threading.Event()
        if loop is not None:
            self._timer = loop.call_later(idle_s, self._check)
        else:
            threading.Thread(target=self._watch, name="tiered-cache-progress", daemon=True).start()

    @classmethod
    def of_task(cls, idle_s: float, what: str) -> ProgressDeadline:
        """A deadline on the running loop that cancels the current task when the stream stalls."""
        task = asyncio.current_task()
        return cls(idle_s, what, task.cancel if task is not None else _nothing, asyncio.get_running_loop())

    def progress(self) -> None:
        self._last = time.monotonic()

    def error(self) -> StreamStalled:
        return StreamStalled(self.what, self.idle_s)

    def close(self) -> None:
        self._done.set()
        if self._loop is not None:
            self._timer.cancel()

    def _left(self) -> float:
        """Seconds until the deadline passes (0 or less: it has)."""
        return self.idle_s - (time.monotonic() - self._last)

    def _stall(self) -> None:
        self.stalled = True
        self._on_stall()

    def _check(self) -> None:  # the loop's timer
        left, loop = self._left(), self._loop
        if left > 0 and loop is not None:
            self._timer = loop.call_later(left, self._check)
        elif not self._done.is_set():
            self._stall()

    def _watch(self) -> None:  # the daemon thread
        while not self._done.wait(max(self._left(), 0.0)):
            if self._left() <= 0:
                self._stall()
                return


def _nothing() -> None:
    pass
