"""`BulkEndpoint`: which bulk Get (client/bulk_client.py) one store client uses, and when.

The port is the one the server announced (`AttachResponse.bulk_port`, asked once); a bulk Get
that refused this client or could not be reached is dropped for `RETRY_S` (gRPC's Get serves
meanwhile), then the server is asked again: it may have restarted, or the route opened.
`get_into` is what the remote tier calls: True when the bulk Get served the call, False when it
is not to be used (the caller takes gRPC's Get); a bulk Get that fails after asking raises.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tiered_cache.client.bulk_client import BulkClient, BulkRefused, BulkUnreachable

log = logging.getLogger("tiered_cache.client.bulk_endpoint")
RETRY_S = 60.0  # a bulk Get refused or unreachable is tried again after this long


class BulkEndpoint:
    def __init__(self, host: str, authorization: str, namespace: str, timeout_s: float,
                 ask_port: Callable[[], int | None]) -> None:
        """`ask_port`: the server's announced port (0: none), or None when it did not answer."""
        self._args = (host, authorization, namespace, timeout_s)
        self._ask_port = ask_port
        self._lock = threading.Lock()
        self.port: int | None = None  # None: not asked yet; 0: none (or dropped until `_retry_at`)
        self._retry_at = float("inf")
        self._client: BulkClient | None = None
        self._closed = False

    def client(self) -> BulkClient | None:
        """The bulk Get's client, or None (none offered, dropped for now, or the server is down)."""
        with self._lock:
            if self._client is None and not self._closed:
                if self.port == 0 and time.monotonic() >= self._retry_at:
                    self.port = None
                if self.port is None:
                    self.port = self._ask_port()
                if self.port:
                    host, authorization, namespace, timeout_s = self._args
                    self._client = BulkClient(host, self.port, authorization, namespace, timeout_s)
            return self._client

    def get_into(self, keys: list[bytes], fingerprint: bytes, place: Callable[[bytes, memoryview], Future[Any]],
                 budget_s: float | None) -> bool:
        """Get `keys` through the bulk Get (see the module doc); False: use gRPC's Get."""
        bulk = self.client()
        if bulk is None:
            return False
        try:
            bulk.get_into(keys, fingerprint, place, budget_s)
            return True
        except (BulkRefused, BulkUnreachable) as exc:  # nothing was asked: gRPC's Get instead
            self.drop(exc)
            return False

    def warm(self) -> None:
        """Open a connection now, where the server offers a bulk Get; one refused or unreachable
        is dropped (gRPC's Get serves), never counted against the server."""
        bulk = self.client()
        if bulk is not None:
            try:
                bulk.warm()
            except (BulkRefused, BulkUnreachable) as exc:
                self.drop(exc)

    def drop(self, why: Exception | None = None) -> bool:
        """Stop using the bulk Get for `RETRY_S`; whether it was in use (then `why` is logged)."""
        with self._lock:
            bulk, self._client, self.port = self._client, None, 0
            self._retry_at = time.monotonic() + RETRY_S
        if bulk is not None:
            bulk.close()
            if why is not None:
                log.warning("%s; using gRPC's Get with this server for %g s", why, RETRY_S)
        return bulk is not None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            bulk, self._client = self._client, None
        if bulk is not None:
            bulk.close()
