"""`tiered-cache serve`: run a store server in the foreground until SIGTERM or SIGINT, saying
where it listens, what it stores in, and when it listens or serves metrics beyond loopback."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from tiered_cache.server.config import ServerConfig
from tiered_cache.server.store_server import StoreServer


def serve(config: ServerConfig) -> int:
    """Run until SIGTERM or SIGINT; then drain, flush, and return 0."""
    stop = threading.Event()

    def on_signal(*_: Any) -> None:
        # Drain once: later signals are ignored (grace_s bounds the drain; SIGKILL still works).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):  # before "listening" is printed: no window without them
        signal.signal(sig, on_signal)
    server = StoreServer(config)
    port = server.start()
    where = f"{config.host}:{port}"
    print(f"tiered-cache serve: listening on {where} ({'TLS' if config.tls_cert else 'plaintext'}, "
          f"{_tokens(config)})", flush=True)
    from tiered_cache.server.startup import describe_tiers, memory_problem, redis_problem

    capacities = {t.name: t.capacity_bytes for t in server.store.stats()}
    print(f"tiered-cache serve: tiers: {describe_tiers(config, capacities)}", flush=True)
    if problem := memory_problem(config.ram_capacity):
        print(f"tiered-cache serve: WARNING: {problem}", file=sys.stderr, flush=True)
    if server.bulk is not None:
        print(f"tiered-cache serve: bulk Get at {config.host}:{server.bulk.port} (plain TCP, same tokens)", flush=True)
    elif config.bulk_port is not None:
        print("tiered-cache serve: no bulk Get with TLS (it is plain TCP): clients use gRPC's Get", flush=True)
    if config.redis_url and (problem := redis_problem(config.redis_url)):
        print(f"tiered-cache serve: WARNING: {problem}; the Redis tier answers misses until it is back",
              file=sys.stderr, flush=True)
    if not config.loopback_only:
        print(f"tiered-cache serve: WARNING: listening beyond loopback on {config.host}"
              + ("" if config.grants else "; set --token-file so only your instances can read and write pages"),
              file=sys.stderr, flush=True)
    if server.events is not None:
        from tiered_cache.events.endpoints import on_loopback

        publisher = server.events.publisher
        print(f"tiered-cache serve: KV events at {publisher.endpoint} (replay {publisher.replay_endpoint})", flush=True)
        if not on_loopback(publisher.endpoint):
            print("tiered-cache serve: WARNING: KV events listen beyond loopback and take no token: anyone who "
                  "reaches them reads which prefixes are stored", flush=True)
    if server.metrics is not None:
        print(f"tiered-cache serve: metrics at {server.metrics.url}"
              f"{' (token required)' if config.metrics_token else ''}", flush=True)
        if not server.metrics.loopback_only:
            print(f"tiered-cache serve: WARNING: metrics listen beyond loopback on {config.metrics_host}"
                  + ("" if config.metrics_token else "; anyone who can reach it reads the cache's figures"),
                  file=sys.stderr, flush=True)
    # Wake twice a second: a signal the kernel hands to another thread (gRPC's, say) runs its
    # Python handler only when the main thread runs, and an untimed wait might never return.
    while not stop.wait(0.5):
        pass
    print("tiered-cache serve: shutting down (draining streams, flushing RAM to the next tier)", flush=True)
    flushed = server.stop()
    print(f"tiered-cache serve: flushed {flushed} pages; bye", flush=True)
    return 0


def _tokens(config: ServerConfig) -> str:
    """What the listening line says about tokens."""
    if config.token_file:
        return f"{len(config.grants)} tokens from {config.token_file}, each scoped to its namespaces"
    return "token required" if config.token else "no token"
