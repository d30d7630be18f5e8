"""`tiered-cache serve`: the store server other instances push pages to and get prefixes from."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(commands: Any) -> None:
    p = commands.add_parser("serve", help="run the gRPC store server",
                            description="Run the store server: RAM in front of a disk folder (and/or Redis). "
                                        "Binds 127.0.0.1 unless told otherwise. SIGTERM/SIGINT drain and flush.")
    p.add_argument("--config", help="a YAML file of ServerConfig settings (flags win)")
    p.add_argument("--host", help="interface to bind (default 127.0.0.1; anything else is announced)")
    p.add_argument("--port", type=int, help="port (default 50551; 0 picks a free one and prints it)")
    p.add_argument("--token", help="require `authorization: Bearer TOKEN` on every call (visible to every local "
                                   "user in the process list: prefer $TIERED_CACHE_SERVE_TOKEN or --token-file)")
    p.add_argument("--token-file", help="tokens scoped to namespaces, one 'TOKEN NAMESPACE[, NAMESPACE...]' per "
                                        "line ('TOKEN *': every namespace); default $TIERED_CACHE_SERVE_TOKEN_FILE")
    p.add_argument("--tls-cert", help="PEM certificate (with --tls-key) to serve TLS")
    p.add_argument("--tls-key", help="PEM private key")
    p.add_argument("--ram", dest="ram_capacity", help="RAM tier size, e.g. 4GiB (default 1GiB)")
    p.add_argument("--disk", dest="disk_path", help="disk tier folder (default $TIERED_CACHE_DIR/store, else "
                                                          "~/.cache/tiered-cache/store)")
    p.add_argument("--no-disk", action="store_true", help="no disk tier")
    p.add_argument("--disk-capacity", help="disk tier size (default 10GiB)")
    p.add_argument("--redis", dest="redis_url", help="a Redis tier below disk, e.g. redis://127.0.0.1:6379/0")
    p.add_argument("--max-page", dest="max_page_bytes", help="largest page blob accepted (default 64MiB)")
    p.add_argument("--workers", type=int, help="threads for store I/O of Get and Put (default 8)")
    p.add_argument("--max-streams", dest="max_streams", type=int,
                   help="Get/Put streams at once; past it calls fail fast with RESOURCE_EXHAUSTED (default 64)")
    p.add_argument("--stream-idle", dest="stream_idle_s", type=float,
                   help="seconds a stream may make no progress before it is ended (default 30)")
    p.add_argument("--shm", dest="shm", metavar="on|off",
                   help="keep the RAM tier in shared memory that clients on this host (same user) read in place, "
                        "with no copy by the server (default on; off: every page goes over gRPC)")
    p.add_argument("--bulk-port", dest="bulk_port", metavar="PORT|off",
                   help="port of the bulk Get (plain TCP beside gRPC, same host and tokens: the fast path for "
                        "pages from another host; default 0: a free port; off: none; never with TLS)")
    p.add_argument("--arena-lease", dest="arena_lease_s", type=float, metavar="SECONDS",
                   help="how long a page handed to a same-host client is not written over (default 2)")
    p.add_argument("--write-through", action="store_true", default=None,
                   help="copy new pages below RAM at once (default: on eviction and at shutdown)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics "
                                                    "(0: a free port, printed; default: none)")
    p.add_argument("--metrics-host", help="interface for the metrics (default 127.0.0.1; anything else is announced)")
    p.add_argument("--kv-events", dest="kv_events", metavar="tcp://HOST:PORT",
                   help="publish the pages this server stores and drops as vLLM KV events (ZMQ PUB, msgpack) "
                        "at this endpoint, replay on the next port (default: off)")
    p.add_argument("--kv-events-replay", dest="kv_events_replay", metavar="tcp://HOST:PORT",
                   help="the replay endpoint for late subscribers (default: the --kv-events port + 1)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os
    import sys

    from tiered_cache.server.config import ServerConfig
    from tiered_cache.server.serve import serve
    from tiered_cache.wire.auth import TOKEN_ENV, TOKEN_FILE_ENV, token_from

    overrides = {name: getattr(args, name) for name in
                 ("host", "port", "token", "tls_cert", "tls_key", "ram_capacity", "disk_path", "disk_capacity",
                  "redis_url", "max_page_bytes", "write_through", "workers", "max_streams", "stream_idle_s",
                  "metrics_port", "metrics_host", "shm", "arena_lease_s", "bulk_port", "kv_events",
                  "kv_events_replay")}
    if args.token is not None:
        print("tiered-cache serve: WARNING: --token is visible to every local user (/proc/<pid>/cmdline); "
              f"give it as ${TOKEN_ENV} or in a --token-file", file=sys.stderr, flush=True)
    token_file = args.token_file or os.environ.get(TOKEN_FILE_ENV) or None
    if token_file and args.token is None and os.environ.get(TOKEN_ENV):
        print(f"tiered-cache serve: ${TOKEN_ENV} is set but not used: the token file {token_file} says who may "
              "connect (add the token there, with its namespaces or '*')", file=sys.stderr, flush=True)
    overrides["token"] = None if token_file and args.token is None else token_from(args.token, dict(os.environ))
    overrides["token_file"] = token_file
    if args.no_disk:
        overrides["disk_path"] = ""
    if args.config:
        config = ServerConfig.from_yaml(args.config, **overrides)
    else:
        config = ServerConfig(**{k: v for k, v in overrides.items() if v is not None})
    return serve(config)
