"""`tiered-cache` command line: one module per subcommand, imported only when it runs."""

from __future__ import annotations

import argparse
import logging
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
    _add_logging_flags(parser)
    return parser


def _add_logging_flags(parser: argparse.ArgumentParser) -> None:
    """`-v` / `--log-level` on every command and subcommand (`tiered-cache bench load -v` works)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _add_logging_flags(sub)
    if parser.prog == "tiered-cache":
        return
    group = parser.add_argument_group("logging")
    group.add_argument("-v", "--verbose", action="count", default=0, help="more log lines: -v info, -vv debug")
    group.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                       help="log level (default warning: a tier going down or coming back is logged)")


def _configure_logging(args: argparse.Namespace) -> None:
    verbose = getattr(args, "verbose", 0)
    level = getattr(args, "log_level", None) or ("debug" if verbose >= 2 else "info" if verbose else "warning")
    logging.basicConfig(level=level.upper(), format="tiered-cache %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args)
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
