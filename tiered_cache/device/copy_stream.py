"""`CopyStream`: a transfer queued chunk by chunk on one CUDA copy stream, the way both copiers
between host memory and the pool do it (`host_copy.py`, `arena_copy.py`).

The copy stream first waits for the caller's stream (KV the model is still writing, earlier
readers of the pages); each chunk is queued under a small lock, because the copier's one chunk
buffer is reused by the next chunk, whoever's (the stream keeps them in order); at the end, also
when a chunk raised, the caller's stream waits for the copies and so does the host: the caller
may reuse its source or free its pages after. A background transfer waits for each chunk before
queueing the next, so a request's transfer queues behind one chunk, not a whole transfer. On the
CPU the chunks just run in turn under the lock.

`wait=False` leaves the host free as soon as the copies are queued: the caller's stream still waits
for them (work queued there after sees the pages), and the caller gets a `QueuedCopy` to learn when
they are done, keeping its source untouched until then. A transfer queued as several runs whose
host waits for each before the pages are used (the arena copier's staged chunks) asks for neither
stream wait after its first run (`follow_caller`, `caller_waits`). An engine queues its forward while the
DMA runs, so the kernel launches of a short prefill overlap the load instead of following it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class QueuedCopy:
    """Copies queued on a copy stream, bracketed by two timing events."""

    started: Any  # torch.cuda.Event
    done: Any  # torch.cuda.Event

    def finished(self) -> bool:
        return bool(self.done.query())

    def wait(self) -> None:
        self.done.synchronize()

    def seconds(self) -> float:
        """How long the copies ran on the stream (call once `finished`)."""
        return float(self.started.elapsed_time(self.done)) / 1e3


class CopyStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream: Any = torch.cuda.Stream(device) if self.cuda else None
        # One transfer at a time uses the chunk buffer (they share one link anyway). Never held
        # while waiting for anything but the copy itself.
        self._busy = threading.Lock()

    def run(self, n: int, size: int, chunk: Callable[[int, int], None], background: bool = False,
            wait: bool = True, after: Sequence[Any] = (), follow_caller: bool = True,
            caller_waits: bool = True) -> QueuedCopy | None:
        """`chunk(start, end)` for each chunk of `size` of `n` items, queued on the copy stream
        (see the module doc); returns when every copy has finished, or with `wait=False` (and no
        chunk raising) as soon as they are queued, with the `QueuedCopy` (None on the CPU, where
        they ran already). A transfer queued as several runs (one per staged chunk) has only its
        first follow the caller's stream, and none make the caller's stream wait, when its host
        waits for every run before the pages are used (`follow_caller`, `caller_waits`): the
        caller's stream, which other threads may queue on, does not take turns with each chunk."""
        if not self.cuda:
            for start, end in chunks(n, size):
                with self._busy:
                    chunk(start, end)
            return None
        stream, caller = self.stream, torch.cuda.current_stream(self.device)
        if follow_caller:
            stream.wait_stream(caller)
        # Recorded with the first chunk, under the lock: a transfer queued behind another's chunks
        # is not timed from before them (the reuse policy's rates come from these times).
        started = torch.cuda.Event(enable_timing=True)
        event: Any = None  # the end, recorded after the last chunk
        queued = False
        try:
            for start, end in chunks(n, size):
                with self._busy, torch.cuda.stream(stream):
                    if start == 0:
                        for mark in after:  # e.g. where the streams that wrote these pages had got to
                            stream.wait_event(mark)
                        started.record(stream)
                    chunk(start, end)
                    if end == n:  # the end marked under the lock too: no other transfer's chunk timed
                        event = torch.cuda.Event(enable_timing=True)
                        event.record(stream)
                    done = stream.record_event() if background else None
                if done is not None:
                    done.synchronize()  # a request's chunks queue behind this one only
            queued = True
        finally:
            if event is None:  # no chunk, or one raised: the end is where the stream is now
                if n == 0:
                    started.record(stream)
                event = torch.cuda.Event(enable_timing=True)
                event.record(stream)
            if caller_waits:
                caller.wait_event(event)
            if wait or not queued:
                event.synchronize()
        return None if wait else QueuedCopy(started, event)


def chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each run of at most `size` of `n` items."""
    for start in range(0, n, size):
        yield start, min(start + size, n)
