"""`/metrics` over HTTP for Prometheus: loopback by default, and a bearer token when one is set
(Prometheus sends it with `authorization: {credentials: TOKEN}` in its scrape config)."""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

from tiered_cache.wire.auth import check_token

LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def _guarded(app: Callable[..., Iterable[bytes]], token: str) -> Callable[..., Iterable[bytes]]:
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        if hmac.compare_digest(given, expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"tiered-cache metrics: send `authorization: Bearer TOKEN`\n"]

    return guarded


def _with_routes(app: Callable[..., Iterable[bytes]], routes: dict[str, Callable[[], bytes]]) -> Callable[..., Any]:
    """`app`, except that a path in `routes` is answered with that callable's JSON."""
    def routed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        route = routes.get(environ.get("PATH_INFO", ""))
        if route is None:
            return app(environ, start_response)
        body = route()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return routed


class MetricsServer:
    """Serves `registry` at http://HOST:PORT/metrics from a daemon thread until `stop()`, and each
    of `routes` (path -> JSON bytes, e.g. "/tree") beside it, behind the same token."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, routes: dict[str, Callable[[], bytes]] | None = None) -> None:
        check_token(token, "metrics token")
        if not 0 <= int(port) < 65536:
            raise ValueError(f"metrics port must be in 0..65535, got {port}")
        self.host, self.token = host, token
        app = _with_routes(make_wsgi_app(registry), routes or {})
        try:
            self._httpd: WSGIServer = make_server(host, int(port), _guarded(app, token) if token else app,
                                                  ThreadingWSGIServer, handler_class=_SilentHandler)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
        self.port = int(self._httpd.server_port)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="tiered-cache-metrics", daemon=True)
        self._thread.start()

    @property
    def loopback_only(self) -> bool:
        return self.host in LOOPBACK

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
