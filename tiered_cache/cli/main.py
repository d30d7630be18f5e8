"""`tiered-cache` command line: one module per subcommand, imported only when it runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tiered_cache import __version__
from tiered_cache.cli import bench_cmd, cluster_cmd, demo_cmd, serve_cmd, size_cmd, stats_cmd, tree_cmd
from tiered_cache.errors import TieredCacheError
from tiered_cache.tiers.memtune import tune_malloc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiered-cache",
        description="Distributed multi-tier KV cache for LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"tiered-cache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_cmd.add_parser(commands)
    serve_cmd.add_parser(commands)
    stats_cmd.add_parser(commands)
    size_cmd.add_parser(commands)
    bench_cmd.add_parser(commands)
    cluster_cmd.add_parser(commands)
    tree_cmd.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    tune_malloc()
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (TieredCacheError, ValueError, KeyError, FileNotFoundError, OSError, RuntimeError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"tiered-cache {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
