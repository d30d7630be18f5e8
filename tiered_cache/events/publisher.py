"""KV event batches over ZMQ, as vLLM's `ZmqEventPublisher` sends them, so its subscribers read ours.

A PUB socket this side binds (subscribers connect) sends each batch as three frames: the topic,
the batch's sequence number (8 bytes, big-endian) and the payload (`schema.encode_batch`). Numbers
run on from `first_seq`: by default the wall clock's microseconds at start, past any earlier
publisher's at the same endpoints, so a subscriber still connected across a restart sees a
forward gap and asks the replay, which gives the new publisher's batches from its first (a
cache's first is `AllBlocksCleared`), whatever rule it follows (vLLM's example replays only on a
forward gap; vLLM's own publisher numbers from 0).
The last `buffer_batches` are kept for a ROUTER replay endpoint: a subscriber that starts late, or
saw a gap in the numbers, sends (empty frame, first wanted number as 8 bytes) and gets every kept
batch from there as (empty, topic, number, payload), then (empty, b"", -1 as 8 signed bytes, b"").

With `heartbeat_s`, a batch with no events goes out after that long without one, so a subscriber
can tell a quiet publisher from a gone one (vLLM's decoder reads an empty batch as nothing new);
heartbeats are numbered but not kept for replay, so an idle publisher never pushes out what changed.

`publish` never blocks the caller: batches go to a bounded queue a thread drains; when it is full
the batch is dropped and counted (`dropped`), as every background queue here does. Endpoints are
loopback unless `beyond_loopback=True`: ZMQ carries no token, so anyone who reaches the port reads
which prefixes are cached.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from tiered_cache.events.endpoints import check_endpoint
from tiered_cache.events.schema import encode_batch

log = logging.getLogger(__name__)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class EventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_batches: int = 10_000, max_queue: int = 10_000, data_parallel_rank: int | None = None,
                 beyond_loopback: bool = False, heartbeat_s: float | None = None,
                 first_seq: int | None = None) -> None:
        import zmq

        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = self._bind(self._pub, check_endpoint(endpoint, beyond_loopback))
        self._replay = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(self._replay, check_endpoint(replay_endpoint, beyond_loopback))
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self.heartbeat_s = heartbeat_s  # an empty batch after this long without one: "still here"
        self._queue: queue.Queue[list[dict[str, Any]] | None] = queue.Queue(maxsize=max_queue)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self.published = self.dropped = self.replayed = 0
        self.first_seq = time.time_ns() // 1000 if first_seq is None else first_seq  # see the module doc
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(sock: Any, endpoint: str) -> str:
        import zmq

        if endpoint.endswith(":0"):
            sock.bind(endpoint[:-2] + ":*")
        else:
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as exc:
                raise OSError(f"cannot publish KV events on {endpoint}: {exc}") from None
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, events: Sequence[dict[str, Any]]) -> bool:
        """Queue one batch (schema.py's events); False when the queue is full and it was dropped."""
        if not events or not self._running:
            return False
        try:
            self._queue.put_nowait(list(events))
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def _run(self) -> None:
        seq = self.first_seq
        last = time.monotonic()
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self.heartbeat_s is None or time.monotonic() - last < self.heartbeat_s:
                    continue
                events = []
            if events is None:
                break
            last = time.monotonic()
            payload = encode_batch(time.time(), events, self._rank)
            number = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, number, payload))
            except Exception as exc:  # a socket closed under us at shutdown: nothing left to tell
                log.warning("tiered-cache: KV events stopped: %s", exc)
                return
            if events:  # a heartbeat is not kept: replay is for what changed
                self._kept.append((seq, payload))
            self.published += 1
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("tiered-cache: a KV events replay request of %d frames ignored", len(frames))
            return
        client, _, first = frames
        start = int.from_bytes(first, "big")
        for seq, payload in list(self._kept):
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
                self.replayed += 1
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (within `timeout_s`), then close the sockets."""
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout=timeout_s)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
