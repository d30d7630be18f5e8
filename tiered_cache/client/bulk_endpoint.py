"""`BulkEndpoint`: which bulk Get (client/bulk_client.py) one store client uses, and when.

The port is the one the server announced (`AttachResponse.bulk_port`). The bulk Get is used only
once a connection to it has been made, by a probe off the request path (the cache's warm-up, or
a thread the first call starts while it uses gRPC's Get): a port that a proxy or firewall drops
costs no request its connect timeout. One that refused this client or could not be reached is
dropped for `RETRY_S` (gRPC's Get serves meanwhile), then probed again: the server may have
restarted, or the route opened. `get_into` is what the remote tier calls: True when the bulk Get
served the call, False when the caller is to take gRPC's Get; a bulk Get that fails after asking
raises.
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
RETRY_S = 60.0  # a bulk Get refused or unreachable is probed again after this long
_DOWN_RETRY_S = 5.0  # a server that did not say whether it offers one is asked again sooner


class BulkEndpoint:
    def __init__(self, host: str, authorization: str, namespace: str, timeout_s: float,
                 ask_port: Callable[[], int | None]) -> None:
        """`ask_port`: the server's announced port (0: none), or None when it did not answer."""
        self._args = (host, authorization, namespace, timeout_s)
        self._ask_port = ask_port
        self._lock = threading.Lock()
        self._client: BulkClient | None = None
        self._retry_at = 0.0  # no probe before this (after a refusal, no bulk Get, a dead server)
        self._probing = False
        self._closed = False

    def client(self) -> BulkClient | None:
        """The bulk Get's client, once a probe has connected to it; None meanwhile (a probe is
        started in the background when one is due) or when there is none to use."""
        with self._lock:
            if self._client is not None or self._closed or not self._probe_due():
                return self._client
        threading.Thread(target=self._probe, name="tiered-cache-bulk-probe", daemon=True).start()
        return None

    def warm(self) -> None:
        """Probe now, on this thread (the cache's warm-up), when a probe is due."""
        with self._lock:
            due = self._client is None and not self._closed and self._probe_due()
        if due:
            self._probe()

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

    def drop(self, why: Exception | None = None) -> None:
        """Stop using the bulk Get for `RETRY_S` (`why` is logged)."""
        with self._lock:
            bulk, self._client = self._client, None
            self._retry_at = time.monotonic() + RETRY_S
        if bulk is not None:
            bulk.close()
        if why is not None:
            log.warning("%s; using gRPC's Get with this server for %g s", why, RETRY_S)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            bulk, self._client = self._client, None
        if bulk is not None:
            bulk.close()

    def _probe_due(self) -> bool:
        """Whether to start a probe now (lock held); marks one as running."""
        if self._probing or time.monotonic() < self._retry_at:
            return False
        self._probing = True
        return True

    def _probe(self) -> None:
        """Ask the port, connect, say hello: on success the bulk Get is used from now on."""
        try:
            port = self._ask_port()
            if not port:
                with self._lock:
                    self._retry_at = time.monotonic() + (RETRY_S if port == 0 else _DOWN_RETRY_S)
                return
            host, authorization, namespace, timeout_s = self._args
            bulk = BulkClient(host, port, authorization, namespace, timeout_s)
            try:
                bulk.warm()
            except (BulkRefused, BulkUnreachable) as exc:
                self.drop(exc)
                return
            except OSError:  # a hiccup: probed again soon
                with self._lock:
                    self._retry_at = time.monotonic() + _DOWN_RETRY_S
                return
            with self._lock:
                if self._closed:
                    bulk.close()
                else:
                    self._client = bulk
        finally:
            with self._lock:
                self._probing = False
