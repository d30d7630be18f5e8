"""`tiered-cache demo`: two instances reuse a long document's KV through a store (embedded defaults)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(commands: Any) -> None:
    p = commands.add_parser("demo", help="two instances, one store: reuse instead of prefill (SmolLM2-135M)",
                            description="Starts a store server on a free loopback port, runs instance A and "
                                        "instance B in their own processes, and prints TTFT per tier and both "
                                        "answers. No Redis, GPU or Ray needed.")
    p.add_argument("--repeat", type=int, default=3,
                   help="TTFT runs per row after a warm-up; the median and the spread are printed (default 3)")
    p.add_argument("--doc-chars", type=int, default=None,
                   help="read only the document's first N characters (default: all of it, ~2,800 tokens)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens in each answer (default 48)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from tiered_cache.demo.runner import run_demo

    try:
        return run_demo(args.repeat, args.json, args.doc_chars, args.max_new_tokens)
    except KeyboardInterrupt:
        print("tiered-cache demo: interrupted; the store server and the instances were stopped", file=sys.stderr)
        return 130
