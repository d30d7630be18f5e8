"""`WriterStreams`: where each stream that wrote KV into the pool had got to, for background readers.

A request writes KV into pool pages on its own CUDA stream, which may be any stream (an engine's
side stream, a graph's capture stream), and the pages enter the tree as soon as the writes are
queued. The background demoter copies pages out on a thread of its own, whose current stream is
the device's default stream: without an order between the two, it could copy half-written pages
to host RAM and on below, under a checksum made of whatever it read. So each insert marks the
inserting stream (an event recorded there), and a background copy first makes its stream wait
for every mark: the copy stream itself (`HostCopier.from_pool(after=)`), so no request's stream
waits for another's; the current stream only for the rare gather of pages host RAM has no room
for. On the CPU there are no streams: nothing is recorded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

MAX_STREAMS = 16  # more writing streams than this: the oldest one's mark is waited for by the host


class WriterStreams:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._marks: OrderedDict[int, Any] = OrderedDict()  # stream id -> its newest event
        self._lock = threading.Lock()

    def mark(self) -> None:
        """Record how far the current stream had got (call when its pages enter the tree)."""
        if not self.cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(stream)
        with self._lock:
            self._marks[stream.stream_id] = event
            self._marks.move_to_end(stream.stream_id)
            oldest = self._marks.popitem(last=False)[1] if len(self._marks) > MAX_STREAMS else None
        if oldest is not None:
            oldest.synchronize()  # bounded: rarely more than a few streams write

    def pending(self) -> list[Any]:
        """The marks not passed yet (those passed go): for a copy stream to wait for."""
        if not self.cuda:
            return []
        with self._lock:
            for key, event in list(self._marks.items()):
                if event.query():
                    del self._marks[key]
            return list(self._marks.values())

    def wait_on_current(self) -> None:
        """Make the current stream wait for every mark still pending."""
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            for event in self.pending():
                stream.wait_event(event)

    def __len__(self) -> int:
        with self._lock:
            return len(self._marks)
