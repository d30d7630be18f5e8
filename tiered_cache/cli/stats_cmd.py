"""`tiered-cache stats`: per-tier figures of one or more store servers, or of a whole Ray cluster
(`--ray ADDRESS`: every worker and shard, and cluster totals per tier)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from tiered_cache.client.stats import server_stats
from tiered_cache.report.stats import render_stats, tier_rates


def add_parser(commands: Any) -> None:
    p = commands.add_parser("stats", help="per-tier figures of store servers or of a Ray cluster",
                            description="Per-tier figures of one or more store servers (--address), or of "
                                        "every worker and shard of a Ray cluster with totals (--ray).")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", action="append", metavar="HOST[:PORT]",
                       help="a store server, port 50551 when not given (repeat for several)")
    where.add_argument("--ray", metavar="ADDRESS",
                       help="a Ray cluster running `tiered-cache cluster` (auto: this node's)")
    p.add_argument("--namespace", default="tiered-cache", help="Ray namespace of the cluster (default tiered-cache)")
    p.add_argument("--token", help="bearer token, if the servers require one (default $TIERED_CACHE_SERVE_TOKEN)")
    p.add_argument("--tls-ca", help="PEM of the CA for TLS servers")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per server (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                   help="refresh in place every SECONDS (default 2) until Ctrl-C, with rates over the last "
                        "interval; with --json, one JSON line per refresh")
    p.set_defaults(run=run)


def _servers(args: argparse.Namespace, before: dict[str, Any], seconds: float) -> tuple[str, bool]:
    """`before`: each server's previous result (for rates over `seconds`), updated in place."""
    results = [server_stats(a, args.token, args.tls_ca, args.timeout) for a in args.address]
    over = f"over the last {seconds:.1f} s" if before else ""
    rates = {r["address"]: tier_rates(r, before.get(r["address"]), seconds) for r in results if "error" not in r}
    for r in results:
        for t in r.get("tiers", []):
            t["rates"] = rates[r["address"]][t["name"]]  # per second: hits, misses, bytes_out
    if args.json:
        data = results if len(results) > 1 else results[0]
        text = json.dumps(data, separators=(",", ":")) if args.watch else json.dumps(data, indent=2)
    else:
        text = "\n\n".join(render_stats(r, rates.get(r["address"]), over) for r in results)
    before.clear()
    before.update({r["address"]: r for r in results})
    return text, all("error" not in r for r in results)


def _cluster(args: argparse.Namespace) -> tuple[str, bool]:
    from tiered_cache.cli.cluster_table import render_cluster
    from tiered_cache.workers import cluster

    cluster.connect(args.ray, args.namespace)  # after `stdout_for_the_answer` (run)
    figures = cluster.stats(args.timeout)
    if not figures["actors"] and not figures.get("control"):
        print(f"stats: no tiered-cache actors in Ray namespace {args.namespace!r} (start them with "
              "`tiered-cache cluster start`, or name the cluster's --namespace)", file=sys.stderr)
    if args.json:
        text = json.dumps(figures, separators=(",", ":")) if args.watch else json.dumps(figures, indent=2)
    else:
        text = render_cluster(figures)
    return text, bool(figures["actors"]) and all("error" not in a for a in figures["actors"])


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every server (or actor) answered, 1 when any did not."""
    import os

    from tiered_cache.wire.auth import token_from
    from tiered_cache.wire.options import normalize_address

    args.token = token_from(args.token, dict(os.environ))
    if args.address:
        args.address = [normalize_address(a) for a in args.address]
    if args.watch is not None and not args.watch > 0:
        raise ValueError(f"--watch must be a positive number of seconds, got {args.watch:g}")
    if not args.ray:
        return _report(args, sys.stdout)
    from tiered_cache.workers.cluster import stdout_for_the_answer

    return _report(args, stdout_for_the_answer())  # the figures alone on stdout, Ray's driver talking or not


def _report(args: argparse.Namespace, out: TextIO) -> int:
    before: dict[str, Any] = {}
    last = time.monotonic()

    def sample() -> tuple[str, bool]:
        nonlocal last
        now = time.monotonic()
        text, ok = _cluster(args) if args.ray else _servers(args, before, now - last)
        last = now
        return text, ok

    if not args.watch:
        text, ok = sample()
        print(text, file=out)
        return 0 if ok else 1
    try:
        if args.json or not out.isatty():
            _watch_lines(args, sample, out)
        else:
            _watch_screen(args, sample, out)
    except KeyboardInterrupt:
        return 0
    return 0


def _watch_lines(args: argparse.Namespace, sample: Callable[[], tuple[str, bool]], out: TextIO) -> None:
    """--watch into a pipe or with --json: one block (or one JSON document per line) per refresh,
    no escape codes, so tools and log files read it."""
    while True:
        text, _ = sample()
        print(text if args.json else f"# {time.strftime('%H:%M:%S')}, every {args.watch:g} s\n{text}\n", file=out,
              flush=True)
        time.sleep(args.watch)


def _watch_screen(args: argparse.Namespace, sample: Callable[[], tuple[str, bool]], out: TextIO) -> None:
    """--watch on a terminal: rich's Live redraws in the alternate screen (no flicker, and the
    terminal is restored on exit or Ctrl-C) instead of hand-written clear-screen codes."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    def frame() -> Text:
        text, _ = sample()
        return Text(f"{time.strftime('%H:%M:%S')} every {args.watch:g} s (Ctrl-C to stop)\n{text}")

    with Live(frame(), screen=True, auto_refresh=False, console=Console(file=out)) as live:
        while True:
            time.sleep(args.watch)
            live.update(frame(), refresh=True)
