"""`tiered-cache bench WHAT`: benchmarks that print each figure beside a same-run baseline."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any


def add_parser(commands: Any) -> None:
    p = commands.add_parser("bench", help="benchmarks (each beside a baseline measured in the same run)")
    which = p.add_subparsers(dest="bench", required=True, metavar="WHAT")
    radix = which.add_parser("radix", help="radix tree match/insert/evict per operation")
    radix.add_argument("--nodes", default="1000,10000,100000", help="tree sizes (default 1000,10000,100000)")
    radix.add_argument("--ops", type=int, default=2000, help="operations timed per size (default 2000)")
    keys = which.add_parser("keys", help="page-key hashing throughput")
    keys.add_argument("--tokens", type=int, default=32768, help="prompt length (default 32768)")
    for sub in (radix, keys):
        sub.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
        sub.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tiered_cache.bench.timing import render_comparisons

    if args.bench == "radix":
        from tiered_cache.bench.radix_bench import bench_radix

        rows = []
        for n in (int(x) for x in args.nodes.split(",")):
            print(f"building a tree of {n:,} nodes and timing {args.ops:,} operations ...", file=sys.stderr)
            rows += bench_radix(n, ops=args.ops)
        scale = "nodes"
    else:
        from tiered_cache.bench.keys_bench import bench_keys

        rows = bench_keys(args.tokens)
        scale = "prompt"
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        print(f"host: {platform.machine()}, Python {platform.python_version()}")
        print(render_comparisons(rows, scale))
    return 0
