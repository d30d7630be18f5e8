"""`tiered-cache` command line: one module per subcommand, imported only when it runs."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from tiered_cache import __version__
from tiered_cache.cli import bench_cmd, cluster_cmd, demo_cmd, serve_cmd, size_cmd, stats_cmd, tree_cmd
from tiered_cache.device.malloc import tune_malloc
from tiered_cache.errors import TieredCacheError


class _Parser(argparse.ArgumentParser):
    """An error names the option a mistyped one is closest to (subcommands' parsers are this class
    too): `stats --adress X` -> "--adress: did you mean --address?"."""

    argv: Sequence[str] = ()  # the command line being parsed (main sets it)

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        known = [o for a in self._actions for o in a.option_strings]
        hints = [f"{x.split('=')[0]}: did you mean {close[0]}?" for x in self.argv
                 if x.startswith("-") and x.split("=")[0] not in known
                 and (close := difflib.get_close_matches(x.split("=")[0], known, n=1, cutoff=0.6))]
        super().error(message + (f" ({'; '.join(dict.fromkeys(hints))})" if hints else ""))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
    """`-v` / `--log-level` on every command and subcommand (`tiered-cache bench store-traffic -v` works)."""
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
    argv = bench_cmd.new_names(list(sys.argv[1:] if argv is None else argv))
    _Parser.argv = argv
    args, extras = parser.parse_known_args(argv)
    if extras:  # said by the subcommand that was given them, with its usage
        _refuse_extras(parser, args, extras)
    _configure_logging(args)
    tune_malloc()
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:  # `... | head -1` closed our stdout: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE
    except KeyboardInterrupt:  # what the command started is stopped on the way out (its finally blocks)
        print(f"tiered-cache {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if not isinstance(exc, (TieredCacheError, ValueError, KeyError, OSError, RuntimeError)) and not _from_ray(exc):
            raise
        if getattr(args, "verbose", 0):
            traceback.print_exc()
        print(f"tiered-cache {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2


def _refuse_extras(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    """Exit with the usage of the subcommand the extra arguments went to, and the option each
    mistyped one is closest to."""
    current = parser
    while True:
        subparsers = next((a for a in current._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, subparsers.dest, None) if subparsers is not None else None
        if subparsers is None or name not in subparsers.choices:
            break
        current = subparsers.choices[name]
    current.error(f"unrecognized arguments: {' '.join(extras)}")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _from_ray(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0] == "ray"


def one_line(exc: BaseException) -> str:
    """What went wrong, in one line: for an error a Ray actor raised, the actor's own error (Ray
    wraps it in the remote traceback, with colour codes); `-v` prints the whole traceback."""
    cause = getattr(exc, "cause", None) if _from_ray(exc) else None
    if isinstance(cause, BaseException):
        exc = cause
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    text = _ANSI.sub("", str(exc)).strip()
    if not _from_ray(exc):
        return text or type(exc).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]  # Ray's own errors: the
    errors = [line for line in lines if "Error" in line.split(":")[0]]     # last error line, after the traceback
    return (errors or lines or [type(exc).__name__])[-1]


if __name__ == "__main__":
    sys.exit(main())
