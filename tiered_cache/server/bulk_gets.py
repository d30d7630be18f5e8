"""`BulkGets`: the store's bulk Get (wire/bulk.py) on a plain TCP listener beside gRPC.

A thread per connection, at most `max_streams` connections at once (past it a client is refused
with a message and uses gRPC's Get). A connection authenticates once, with the token and
namespace rules of gRPC calls (admission.py); each request is read whole, checked (key count, key
sizes, fingerprint), and answered page by page from the store, a batch read ahead of the one
being sent. A client that reads nothing for `stream_idle_s` is dropped. Bad input ends the
connection with a message, never the server.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Executor

from tiered_cache.index.keys import KEY_BYTES
from tiered_cache.server.admission import admitted_count, admitted_namespace
from tiered_cache.server.config import ServerConfig
from tiered_cache.server.get_handlers import as_sent
from tiered_cache.server.store import BlobStore
from tiered_cache.server.streams import GetBatches
from tiered_cache.wire import bulk
from tiered_cache.wire.namespaces import scoped_keys

log = logging.getLogger("tiered_cache.server.bulk_gets")


class BulkGets:
    """The listener and its connections (see the module doc)."""

    def __init__(self, config: ServerConfig, store: BlobStore, io: Executor) -> None:
        self.config = config
        self.store = store
        self._io = io  # the store's reads run here, a batch ahead of the socket
        self._permits = threading.BoundedSemaphore(config.max_streams)
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = 0

    def start(self) -> int:
        """Listen on the gRPC host, on `config.bulk_port` (0: a free port); returns the port."""
        host = self.config.host
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        try:
            self._listener = socket.create_server((host.strip("[]"), self.config.bulk_port or 0), family=family)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen for the bulk Get on {host}:{self.config.bulk_port} "
                                     f"({exc.strerror}): give another --bulk-port, 0 for a free one, or off") from None
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="tiered-cache-bulk-accept", daemon=True).start()
        return self.port

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while (listener := self._listener) is not None:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed by stop()
            if not self._permits.acquire(blocking=False):
                self._refuse(conn, f"the server has {self.config.max_streams} bulk connections already; use Get")
                continue
            threading.Thread(target=self._serve, args=(conn,), name="tiered-cache-bulk", daemon=True).start()

    def _refuse(self, conn: socket.socket, why: str) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(bulk.answer(bulk.REFUSED, why))
        except OSError:
            pass
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)
        try:
            conn.settimeout(self.config.stream_idle_s)  # a client that neither asks nor reads is dropped
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            namespace = self._hello(conn)
            if namespace is None:
                return
            while self._answer(conn, namespace):
                pass
        except (OSError, bulk.BulkError) as exc:  # the client went away or stalled: its loss only
            log.debug("bulk connection ended: %s", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            self._permits.release()

    def _hello(self, conn: socket.socket) -> str | None:
        """The namespace the connection acts in, or None (refused, told why)."""
        if bulk.read_exact(conn, len(bulk.MAGIC)) != bulk.MAGIC:
            self._refuse(conn, "not a tiered-cache bulk Get client (bad hello)")
            return None
        authorization, asked = bulk.read_text(conn), bulk.read_text(conn)
        try:
            namespace = admitted_namespace(self.config.grants, authorization, asked or None, "namespace")
        except (PermissionError, ValueError) as exc:
            self._refuse(conn, str(exc))
            return None
        conn.sendall(bulk.answer(bulk.OK))
        return namespace

    def _answer(self, conn: socket.socket, namespace: str) -> bool:
        """Read one request and send its pages; False when the client closed or the request failed."""
        try:
            head = conn.recv(4, socket.MSG_WAITALL)
        except TimeoutError:
            return False  # an idle connection the client keeps for later: closed; it reconnects
        if len(head) < 4:
            return False
        try:
            count = admitted_count(int.from_bytes(head, "little"), self.config.max_keys, least=1)
        except ValueError as exc:
            return self._fail(conn, str(exc))
        fingerprint = bulk.read_exact(conn, KEY_BYTES)
        fingerprint = b"" if fingerprint == bulk.NO_FINGERPRINT else fingerprint
        raw = bulk.read_exact(conn, count * KEY_BYTES)
        keys = [raw[i:i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]
        self._send_pages(conn, list(zip(keys, scoped_keys(namespace, keys), strict=True)), fingerprint)
        return True

    def _fail(self, conn: socket.socket, message: str) -> bool:
        conn.sendall(bulk.failure(message))
        return False

    def _send_pages(self, conn: socket.socket, keys: list[tuple[bytes, bytes]], fingerprint: bytes) -> None:
        """Each key's blob (or a length of 0), in order; the store read a batch ahead of the socket."""
        ahead = GetBatches(keys, self.config.stream_buffer_bytes,
                          lambda batch, sizer: self._io.submit(self._read, batch, fingerprint, sizer.see))
        pending = ahead.next()
        try:
            while pending is not None:
                blobs = pending.result()
                pending = ahead.next()
                for blob in blobs:
                    if blob is None:
                        conn.sendall(bulk.length(0))
                    else:
                        _send_parts(conn, [bulk.length(len(blob)), memoryview(blob)])
        finally:
            ahead.cancel(pending)

    def _read(self, chunk: list[tuple[bytes, bytes]], fingerprint: bytes,
              see: Callable[[int], None]) -> list[bytes | None]:
        blobs = [as_sent(key, kept, blob, fingerprint)
                 for (key, kept), blob in zip(chunk, self.store.get([kept for _, kept in chunk]), strict=True)]
        for blob in blobs:
            if blob is not None:
                see(len(blob))
        return blobs


def _send_parts(conn: socket.socket, parts: list[bytes | memoryview]) -> None:
    """Send `parts` in one `sendmsg` where the kernel takes them all (no joined copy of a blob),
    the rest after a partial send."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = conn.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]
