"""`BulkClient`: a store client's side of the bulk Get (wire/bulk.py), the fast path for pages as
bytes from a server on another host.

Each page is read straight into one of a few reused buffers and handed to the caller (`place`:
e.g. verify and decode it into its pool page on a checker thread) while the next page is read;
a buffer is read into again only once its page has been placed. Connections are kept for the
next call (a connection the server closed meanwhile is replaced once, before any page of the
call arrived). Reads wait at most `timeout_s` each (a progress deadline), the whole call at most
`budget_s` when set: a server that stalls or dies fails the call, never hangs it; the pages
placed before that stay placed.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

import numpy as np

from tiered_cache.wire import bulk
from tiered_cache.wire.bulk import BulkError

_BUFFERS = 4  # pages in flight between the socket and the placing threads
_MAX_BLOB = 1 << 30  # a length past this is not a page: the stream is broken


class BulkRefused(BulkError):
    """The server refused the connection (token, namespace, too many connections): its reason."""


class BulkUnreachable(BulkError):
    """No connection to the bulk port (a firewall or proxy that passes gRPC's port only, or the
    server is down): nothing was asked, so gRPC's Get can be tried instead."""


class BulkClient:
    def __init__(self, host: str, port: int, authorization: str, namespace: str, timeout_s: float) -> None:
        self.address = (host.strip("[]"), port)
        self.hello = bulk.hello(authorization, namespace)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._rings: list[list[np.ndarray]] = []  # reused page buffers, one ring per call in flight
        self.closed = False
        self.reconnects = 0  # kept connections the server had closed, replaced

    def warm(self) -> None:
        """Open a connection now (and say hello), so the first Get does not pay for it."""
        sock = self._connect()
        with self._lock:
            self._idle.append(sock)

    def get_into(self, keys: list[bytes], fingerprint: bytes, place: Callable[[bytes, memoryview], Future[Any]],
                 budget_s: float | None = None) -> None:
        """Ask for `keys` and hand each page that arrives to `place(key, blob)`, which must return a
        future that ends once `blob` (a reused buffer) has been read; returns when every page has
        been placed. Raises BulkError (or OSError, `socket.timeout`) when the connection fails,
        BulkRefused when the server refuses it."""
        deadline = None if budget_s is None else time.monotonic() + budget_s
        sock, kept = self._take()
        sock.settimeout(self.timeout_s)  # a kept connection may carry the last call's budget
        ring = self._ring_for()
        pending: list[Future[Any] | None] = [None] * len(ring)
        ok = False
        try:
            try:
                sock.sendall(bulk.request(keys, fingerprint))
                first = bulk.read_length(sock)
            except (OSError, BulkError):
                if not kept:
                    raise
                sock.close()  # the server closed the kept connection meanwhile: one new try
                self.reconnects += 1
                sock = self._connect()
                sock.sendall(bulk.request(keys, fingerprint))
                first = bulk.read_length(sock)
            for i, key in enumerate(keys):
                if deadline is not None:  # no read waits past the budget
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise BulkError(f"the bulk Get of {len(keys)} pages ran past its budget of {budget_s:g} s")
                    sock.settimeout(min(self.timeout_s, left))
                n = first if i == 0 else bulk.read_length(sock)
                if n == bulk.FAILED:
                    raise BulkError(f"the server ended the bulk Get: {bulk.read_text(sock)}")
                if n == 0:
                    continue
                if n > _MAX_BLOB:
                    raise BulkError(f"a page of {n:,} bytes: the bulk stream is broken")
                slot = i % len(ring)
                if pending[slot] is not None:
                    pending[slot].result()  # its buffer is free again
                if len(ring[slot]) < n:
                    ring[slot] = np.ones(n, dtype=np.uint8)  # touched now, reused after
                view = memoryview(ring[slot])[:n]
                bulk.read_into(sock, view)
                pending[slot] = place(key, view)
            ok = True
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise BulkError(f"the bulk Get of {len(keys)} pages ran past its budget of {budget_s:g} s") from None
            raise BulkError(f"the bulk Get of {len(keys)} pages stalled: nothing arrived for {self.timeout_s:g} s") \
                from None
        finally:
            wait([f for f in pending if f is not None])  # every buffer read before it is reused
            with self._lock:
                self._rings.append(ring)
                if ok and not self.closed:
                    self._idle.append(sock)
                    sock = None  # kept
            if sock is not None:
                sock.close()

    def _take(self) -> tuple[socket.socket, bool]:
        """A connection: a kept one (True) or a new one."""
        with self._lock:
            if self.closed:
                raise BulkError("the bulk client is closed")
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _ring_for(self) -> list[np.ndarray]:
        with self._lock:
            return self._rings.pop() if self._rings else _ring()

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
        except OSError as exc:
            raise BulkUnreachable(f"the store server's bulk Get at {self.address[0]}:{self.address[1]} is "
                                  f"unreachable ({exc})") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(self.hello)
            status = bulk.read_exact(sock, 1)[0]
            message = bulk.read_text(sock)
            if status != bulk.OK:
                raise BulkRefused(f"the store server's bulk Get at {self.address[0]}:{self.address[1]} refused: "
                                  f"{message}")
            return sock
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


def _ring() -> list[np.ndarray]:
    return [np.empty(0, dtype=np.uint8) for _ in range(_BUFFERS)]
