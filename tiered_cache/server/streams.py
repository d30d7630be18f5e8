"""What keeps a store server serving when some peers are slow, idle or too many.

- `StreamPermits`: at most `max_streams` Get/Put streams at once. Past it a call fails at once with
  RESOURCE_EXHAUSTED and a retry hint (the `grpc-retry-pushback-ms` trailer gRPC clients know)
  instead of queueing: memory stays bounded by what each stream may hold.
- Progress deadlines (`wire/deadline.py`, on the event loop): a stream that sends nothing, or
  does not read what it asked for, for `idle_s` is ended (DEADLINE_EXCEEDED) and counted; it
  never holds a thread, because the server is asyncio and a stalled stream is only a parked
  coroutine.
- `BatchSizer`: how many blobs a stream handles per step so that one step holds about
  `budget_bytes`, whatever the page size (16 KiB pages and 64 MiB pages alike).
"""

from __future__ import annotations

import grpc

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
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
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
