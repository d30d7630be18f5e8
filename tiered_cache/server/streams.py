"""What keeps a store server serving when some peers are slow, idle or too many.

- `StreamPermits`: at most `max_streams` Get/Put streams at once. Past it a call fails at once with
  RESOURCE_EXHAUSTED and a retry hint (the `grpc-retry-pushback-ms` trailer gRPC clients know)
  instead of queueing: memory stays bounded by what each stream may hold.
- Progress deadlines (`wire/deadline.py`, on the event loop): a stream that sends nothing, or
  does not read what it asked for, for `idle_s` is ended (DEADLINE_EXCEEDED) and counted; it
  never holds a thread, because the server is asyncio and a stalled stream is only a parked
  coroutine.
- `BatchSizer`: how many blobs a stream handles per step so that one step holds about
  `budget_bytes`, whatever the page size (16 KiB pages and 64 MiB pages alike); `GetBatches`, the
  batches of one Get (gRPC's or the bulk one), each read while the one before is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import grpc

from tiered_cache.server.status import end_call

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class StreamPermits:
    def __init__(self, max_streams: int, retry_after_ms: int = 200) -> None:
        if max_streams <= 0:
            raise ValueError(f"max_streams must be positive, got {max_streams}")
        self.max_streams = max_streams
        self.retry_after_ms = retry_after_ms
        self.active = 0
        self.refused = 0

    async def acquire(self, context: grpc.aio.ServicerContext) -> None:
        """Take a permit, or end the call with RESOURCE_EXHAUSTED (the event loop is one thread:
        no lock is needed around the counter)."""
        if self.active >= self.max_streams:
            self.refused += 1
            context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(self.retry_after_ms)),))
            await end_call(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.active} streams in progress, the server's limit (max_streams); "
                                f"retry in {self.retry_after_ms} ms")
        self.active += 1

    def release(self) -> None:
        self.active -= 1


class BatchSizer:
    """Blobs per step: `budget_bytes` divided by the largest blob seen so far, within [1, cap]."""

    def __init__(self, budget_bytes: int, cap: int = 64) -> None:
        self.budget_bytes = budget_bytes
        self.cap = cap
        self.largest = 0

    def see(self, size: int) -> None:
        self.largest = max(self.largest, size)

    @property
    def count(self) -> int:
        if not self.largest:
            return 1  # nothing seen yet: one blob tells the size
        return max(1, min(self.cap, self.budget_bytes // self.largest))

    def full(self, count: int, nbytes: int) -> bool:
        """Whether a batch of `count` blobs of `nbytes` in all should be handled now."""
        return count >= self.cap or nbytes >= self.budget_bytes


K = TypeVar("K")
F = TypeVar("F")  # a future of one batch's read: concurrent or asyncio


class GetBatches(Generic[K, F]):
    """The keys of one Get in batches of about `budget_bytes`, each batch's read started once the
    one before it has been read and while it is sent: at most two batches are held per stream.
    `read(batch, sizer)` starts a batch's read and returns its future; the read tells `sizer` the
    size of each blob it found, so the next batch is sized by what this one held.

        ahead = GetBatches(keys, budget, read)
        pending = ahead.next()
        while pending is not None:
            batch = pending.result()  # or `await pending`
            pending = ahead.next()
            send(batch)
        # on the way out, whatever happened: ahead.cancel(pending)
    """

    def __init__(self, keys: Sequence[K], budget_bytes: int, read: Callable[[list[K], BatchSizer], F]) -> None:
        self.keys = keys
        self.sizer = BatchSizer(budget_bytes)
        self._read = read
        self._start = 0

    def next(self) -> F | None:
        """The next batch's read, started now; None when every key has been asked for."""
        if self._start >= len(self.keys):
            return None
        batch = list(self.keys[self._start:self._start + self.sizer.count])
        self._start += len(batch)
        return self._read(batch, self.sizer)

    @staticmethod
    def cancel(pending: Any) -> None:
        """A read started and not sent (the stream ended early): cancelled."""
        if pending is not None:
            pending.cancel()
