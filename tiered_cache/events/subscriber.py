"""`EventSubscriber`: one publisher's KV event batches, in order, on a thread of its own.

It connects a SUB socket to the publisher and asks its replay endpoint for every batch kept from
number 0, so a subscriber that starts late (or restarts) learns what is cached before it reads
live batches. A number past the next one expected (a batch ZMQ dropped, or a restarted publisher
of ours, whose numbers start past its predecessor's) is filled from the replay endpoint; one below
it is a batch read already (a replay and the live stream overlap), except number 0: a publisher
numbering from 0 (vLLM's) restarted, so what was learned from it is forgotten (`on_reset`) and
read again from the start. A restarted cache of ours says the same with its first batch,
`AllBlocksCleared`. Batches are applied in order and events are
idempotent, so reading some twice changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tiered_cache.events.publisher import END_OF_REPLAY
from tiered_cache.events.schema import decode_batch

log = logging.getLogger(__name__)
OnBatch = Callable[[list[dict[str, Any]]], None]
_REPLAY_WAIT_MS = 2000
_JOIN_S = 0.5  # a SUB socket joins within milliseconds on a quiet machine


class EventSubscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None, on_batch: OnBatch,
                 on_reset: Callable[[], None] = lambda: None, topic: str = "") -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.topic = topic.encode()
        self.next_seq = 0
        self.batches = self.replays = self.gaps = self.restarts = 0
        self.last_batch = 0.0  # time.monotonic() of the last batch applied (0: none yet)
        self.ready = threading.Event()  # set once the first replay is read (or found not to answer)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-sub", daemon=True)

    def start(self) -> EventSubscriber:
        self._thread.start()
        return self

    def _run(self) -> None:
        import zmq

        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            self._replay(0)
            self.ready.set()
            # ZMQ joins a SUB socket some time after connect: a batch sent between the replay's answer
            # and the join reaches no one, and with no later batch no gap would ever show it. One
            # more replay once the join is surely done catches it.
            catch_up = time.monotonic() + _JOIN_S
            while not self._stop.is_set():
                if not sub.poll(100):
                    if catch_up and time.monotonic() > catch_up:
                        catch_up = 0.0
                        self._replay(self.next_seq)
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                self._receive(int.from_bytes(frames[1], "big"), frames[2])
        except Exception as exc:  # a subscriber that dies says why; its owner sees it stop (`alive`)
            log.warning("tiered-cache: KV events from %s stopped: %s", self.endpoint, exc)
        finally:
            self.ready.set()
            sub.close(linger=0)

    def _receive(self, seq: int, payload: bytes) -> None:
        if seq == self.next_seq:
            self._apply(seq, payload)
        elif seq > self.next_seq:
            self.gaps += 1
            self._replay(self.next_seq)
            if seq >= self.next_seq:  # the replay did not reach it (not kept, or no replay endpoint)
                self._apply(seq, payload)
        elif seq == 0:  # a new publisher at the same endpoint: a new cache
            self.restarts += 1
            self.on_reset()
            self.next_seq = 0
            self._apply(seq, payload)
            self._replay(1)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            _, events, _ = decode_batch(payload)
        except ValueError as exc:
            log.warning("tiered-cache: KV event batch %d from %s skipped: %s", seq, self.endpoint, exc)
        else:
            self.on_batch(events)
        self.next_seq = seq + 1
        self.batches += 1
        self.last_batch = time.monotonic()

    def _replay(self, first: int) -> None:
        """Apply every kept batch from number `first` on (none when there is no replay endpoint or
        it does not answer within `_REPLAY_WAIT_MS`)."""
        if self.replay_endpoint is None:
            return
        import zmq

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, _REPLAY_WAIT_MS)
        sock.connect(self.replay_endpoint)
        self.replays += 1
        try:
            sock.send_multipart((b"", first.to_bytes(8, "big")))
            while True:
                frames = sock.recv_multipart()
                if len(frames) != 4 or frames[2] == END_OF_REPLAY:
                    return
                seq = int.from_bytes(frames[2], "big")
                if seq >= self.next_seq:
                    self._apply(seq, frames[3])
        except zmq.Again:
            log.info("tiered-cache: no KV event replay from %s", self.replay_endpoint)
        finally:
            sock.close(linger=0)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self._thread.join(timeout_s)
