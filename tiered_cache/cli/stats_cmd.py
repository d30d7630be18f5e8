"""`tiered-cache stats`: per-tier figures of one or more store servers, or of a whole Ray cluster
(`--ray ADDRESS`: every worker and shard, and cluster totals per tier)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tiered_cache.cli.table import render_table
from tiered_cache.model.units import format_binary
from tiered_cache.service.stats import server_stats


def add_parser(commands: Any) -> None:
    p = commands.add_parser("stats", help="per-tier figures of store servers or of a Ray cluster",
                            description="Per-tier figures of one or more store servers (--address), or of "
                                        "every worker and shard of a Ray cluster with totals (--ray).")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", action="append", metavar="HOST:PORT",
                       help="a store server (repeat for several)")
    where.add_argument("--ray", metavar="ADDRESS",
                       help="a Ray cluster running `tiered-cache cluster` (auto: this node's)")
    p.add_argument("--namespace", default="tiered-cache", help="Ray namespace of the cluster (default tiered-cache)")
    p.add_argument("--token", help="bearer token, if the servers require one")
    p.add_argument("--tls-ca", help="PEM of the CA for TLS servers")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per server (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                   help="refresh in place every SECONDS (default 2) until Ctrl-C")
    p.set_defaults(run=run)


def render(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"{result['address']}: unreachable ({result['error']})"
    s = result["server"]
    head = (f"{result['address']}  tiered-cache {s.get('version', '?')}, up {float(s.get('uptime_s', 0)):,.0f} s, "
            f"{int(s.get('requests', 0)):,} requests, {int(s.get('rejected_requests', 0)):,} rejected, "
            f"{int(s.get('unauthenticated', 0)):,} unauthenticated, {int(s.get('refused_blobs', 0)):,} blobs refused, "
            f"{int(s.get('active_streams', 0))} streams open, {int(s.get('refused_streams', 0)):,} refused "
            f"(max_streams), {int(s.get('stalled_streams', 0)):,} ended stalled")
    rows = [[t["name"], format_binary(t["capacity_bytes"]), format_binary(t["used_bytes"]), f"{t['pages']:,}",
             f"{t['hit_rate']:.1%}", f"{t['hits']:,}", f"{t['misses']:,}", f"{t['evictions']:,}",
             f"{t['promotions']:,}", f"{t['demotions']:,}", format_binary(t["bytes_in"]),
             format_binary(t["bytes_out"]), f"{t['errors']:,}", f"{t['corrupt']:,}",
             f"{t.get('open_breakers', 0)} ({t.get('breaker_trips', 0):,} trips)"] for t in result["tiers"]]
    table = render_table(rows, ["tier", "capacity", "used", "pages", "hit rate", "hits", "misses", "evictions",
                                "promoted", "demoted", "bytes in", "bytes out", "errors", "corrupt", "open breakers"],
                         align_right=range(1, 15))
    return f"{head}\n{table}"


def _servers(args: argparse.Namespace) -> tuple[str, bool]:
    results = [server_stats(a, args.token, args.tls_ca, args.timeout) for a in args.address]
    if args.json:
        text = json.dumps(results if len(results) > 1 else results[0], indent=2)
    else:
        text = "\n\n".join(render(r) for r in results)
    return text, any("error" not in r for r in results)


def _cluster(args: argparse.Namespace) -> tuple[str, bool]:
    from tiered_cache.cli.cluster_table import render_cluster
    from workers import cluster

    cluster.connect(args.ray, args.namespace)
    figures = cluster.stats(args.timeout)
    text = json.dumps(figures, indent=2) if args.json else render_cluster(figures)
    return text, bool(figures["actors"]) and all("error" not in a for a in figures["actors"])


def run(args: argparse.Namespace) -> int:
    while True:
        text, ok = _cluster(args) if args.ray else _servers(args)
        if args.watch:
            sys.stdout.write("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S ") + f"every {args.watch:g} s\n" + text + "\n")
            sys.stdout.flush()
            try:
                time.sleep(args.watch)
            except KeyboardInterrupt:
                return 0
            continue
        print(text)
        return 0 if ok else 1
