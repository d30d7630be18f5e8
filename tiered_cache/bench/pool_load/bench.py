"""`tiered-cache bench pool-load`: a prefix loaded into the device pool through `TieredCache` from
host RAM, disk, Redis and a store server on this host, each beside the raw operation that moves
the same bytes out of that tier (its limit: sites.py), measured in the same run.

Per path, three figures, the serving case first:
- **serving** (the headline, serving.py): every round a prefix this reader never read,
  into a pool that is full and stays full (it holds `--pool-prefixes` prefixes, so the
  watermarks work), taken as engines take it (`match -> prefetch -> load`), and beside it
  `match -> load` (no prefetch);
- **first load** (first.py): a reader process started for the bench, its first load
  after `--settle` seconds from `TieredCache(...)` against its next ones, beside what the same
  pause costs a plain memcpy in that process (the machine's own share) and the path's raw read
  (the tier's own: a server idle as long); and a reader process that
  loads right after it is built, against a copy of the same bytes into fresh memory (what its
  memory costs: the pages a new pool hands out were never touched);
- **warm** (the side column, warm.py): one prefix again and again, a pool with room.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from tiered_cache.bench.pool_load.sites import PATHS, Way, serving_prefixes

if TYPE_CHECKING:
    from tiered_cache.bench.pool_load.first import FirstLoads
    from tiered_cache.bench.pool_load.serving import Timed
    from tiered_cache.model.spec import KVSpec

FIRST_LOADS = 4  # the reader process's loads: the first, then the steady ones
JUST_BUILT_LOADS = 2  # the loads of the reader that loads right after it is built


@dataclass(frozen=True)
class PoolLoadRow:
    """One path's figures (see the module doc); `direct`: the serving case by `match + load` (a
    path into the pool); `demotion` for host RAM only (pool -> host RAM, warm)."""

    path: str  # one of PATHS
    label: str
    baseline_name: str
    nbytes: int  # KV bytes of one prefix
    serving: Timed
    first: FirstLoads | None
    warm: Timed | None
    demotion: Timed | None = None
    direct: Timed | None = None
    just_built: FirstLoads | None = None  # a reader process loading right after it is built

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("serving", "direct", "warm", "demotion"):
            timed = getattr(self, name)
            if timed is not None:
                out[name].update(ratio=timed.ratio, gb_per_s=self.nbytes / timed.seconds / 1e9,
                                 baseline_gb_per_s=self.nbytes / timed.baseline_seconds / 1e9)
        if self.first is not None:
            out["first"].update(first_over_steady=self.first.first_over_steady,
                                memcpy_first_over_steady=self.first.memcpy_first_over_steady,
                                limit_first_over_steady=self.first.limit_first_over_steady)
        if self.just_built is not None:
            out["just_built"].update(fresh_over_first=self.just_built.fresh_over_first,
                                     fresh_pool_over_first=self.just_built.fresh_pool_over_first)
        return out


def bench_pool_load(spec: KVSpec, mib: float = 256, rounds: int = 7, paths: tuple[str, ...] = PATHS,
                    folder: str | None = None, redis_url: str | None = None, pool_prefixes: int = 8,
                    settle_s: float = 5.0, first: bool = True, warm: bool = True,
                    progress: Callable[[str], None] | None = None) -> list[PoolLoadRow]:
    """The rows of `paths` (of PATHS) for prefixes of `mib` MiB; `folder` holds the disk tier's
    files (default: a temporary folder), `redis_url` an existing Redis (default: one started for
    the run). `first` / `warm`: take those figures too."""
    from tiered_cache.bench.pool_load.first import first_loads, limit_after_idle
    from tiered_cache.bench.pool_load.prefixes import Prefixes
    from tiered_cache.bench.pool_load.serving import serving_rounds
    from tiered_cache.bench.pool_load.sites import site
    from tiered_cache.bench.pool_load.warm import warm_rounds
    from tiered_cache.device.malloc import tune_malloc

    assert pool_prefixes >= 2 and rounds >= 1
    tune_malloc()  # as TieredCache and the commands do: the baselines get the same heap
    say = progress or (lambda _: None)
    prefixes = Prefixes(spec, mib)
    mine = serving_prefixes(pool_prefixes, rounds)  # the reader processes' prefixes come after these
    count = mine + (FIRST_LOADS + JUST_BUILT_LOADS if first else 0)
    rows = []
    for path in paths:
        say(f"{path}: {count} prefixes of {prefixes.num_pages} pages of {spec.bytes_per_page:,} bytes ...")
        with site(path, prefixes, count, folder, redis_url) as where:
            first_figures = just_built = None
            if first:
                say(f"{path}: a reader process, {settle_s:g} s settle, {FIRST_LOADS} loads ...")
                first_figures = first_loads(spec.to_dict(), mib, where.settings, path, mine,
                                            FIRST_LOADS, settle_s, where.way.value)
                first_figures = replace(first_figures, limit_seconds=limit_after_idle(
                    where.baseline, prefixes, mine, FIRST_LOADS, settle_s))
                say(f"{path}: a reader process loading right after it is built ...")
                just_built = first_loads(spec.to_dict(), mib, where.settings, path, mine + FIRST_LOADS,
                                         JUST_BUILT_LOADS, 0.0, where.way.value)
            say(f"{path}: {rounds} new prefixes a way ({' / '.join(w.value for w in where.ways)}) into a full "
                f"pool of {pool_prefixes} ...")
            timed = serving_rounds(where, prefixes, rounds, pool_prefixes)
            gc.collect()  # the reader's pool and host RAM go now (its parts refer to each other), not later
            loaded, demoted = None, None
            if warm:
                say(f"{path}: the warm loop, {rounds} rounds ...")
                loaded, demoted = warm_rounds(where, prefixes, rounds)
                gc.collect()
            rows.append(PoolLoadRow(path, where.label, where.baseline_name, prefixes.nbytes, timed[where.way],
                                    first_figures, loaded, demoted, timed.get(Way.LOAD), just_built))
    return rows


# --- the command ----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=float, default=256, help="MiB of KV in each prefix (default 256)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds, the median kept (default 7)")
    parser.add_argument("--model", default="llama-3.1-8b", help="preset whose KV is moved")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16: 2 MiB pages)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"which of {','.join(PATHS)} (default all)")
    parser.add_argument("--pool-prefixes", type=int, default=8,
                        help="prefixes the serving reader's pool holds (default 8, at least 2)")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds a new reader process settles before its first load (default 5)")
    parser.add_argument("--no-first", action="store_true", help="skip the new reader process")
    parser.add_argument("--no-warm", action="store_true", help="skip the warm loop (the side column)")
    parser.add_argument("--dir", help="folder for the disk tier's files (default: a temporary folder)")
    parser.add_argument("--url", help="an existing Redis (default: start a throwaway redis-server)")


def run_pool_load_bench(args: argparse.Namespace) -> int:
    from tiered_cache.model.presets import get_preset

    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    unknown = sorted(set(paths) - set(PATHS))
    if unknown or not paths:
        raise SystemExit(f"tiered-cache bench pool-load: --paths takes some of {','.join(PATHS)}, got {args.paths!r}")
    if not args.mib > 0 or args.rounds <= 0 or args.pool_prefixes < 2 or args.settle < 0:
        raise SystemExit("tiered-cache bench pool-load: --mib and --rounds must be positive, --pool-prefixes at "
                         "least 2, --settle not negative")
    spec = get_preset(args.model).spec.with_options(page_size=args.page_size)
    rows = bench_pool_load(spec, args.mib, args.rounds, paths, args.dir, args.url, args.pool_prefixes, args.settle,
                           first=not args.no_first, warm=not args.no_warm,
                           progress=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        print(f"host: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
              f"{rows[0].nbytes / 2**20:,.0f} MiB prefixes of {spec.dtype.value} KV ({args.model}, "
              f"{spec.bytes_per_page:,}-byte pages). Serving: a new prefix each round into a full pool of "
              f"{args.pool_prefixes} prefixes, median of {args.rounds}, match -> prefetch -> load as engines call "
              f"it (get() for the tensor), match -> load beside it; first load: a reader process after a "
              f"{args.settle:g} s settle; just built: a reader process loading at once, beside a copy into fresh "
              f"memory and one into fresh pages of a pool like its own; warm: one prefix again, a pool with "
              f"room. Disk: page cache warm for both")
        print(render(rows))
    return 0


def render(rows: list[PoolLoadRow]) -> str:
    from tiered_cache.report.table import render_table

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:,.1f} ms"

    table = []
    for r in rows:
        s = r.serving
        first = (f"{ms(r.first.first_seconds)} / {ms(r.first.steady)}" + _up(r.first),
                 f"{r.first.first_over_steady:.2f}x", f"{r.first.memcpy_first_over_steady:.2f}x / "
                 + (f"{r.first.limit_first_over_steady:.2f}x" if r.first.limit_first_over_steady else "-")) \
            if r.first else ("-", "-", "-")
        built = r.just_built
        just_built = (f"{ms(built.first_seconds)} / {ms(built.fresh_copy_seconds[0])}",
                      f"{built.fresh_over_first:.2f}x", f"{built.fresh_pool_over_first:.2f}x") if built else \
            ("-", "-", "-")
        table.append([r.label, ms(s.seconds), f"{r.nbytes / s.seconds / 1e9:,.2f} GB/s", r.baseline_name,
                      ms(s.baseline_seconds), f"{s.ratio:.2f}x", f"{r.direct.ratio:.2f}x" if r.direct else "-",
                      *first, *just_built, f"{r.warm.ratio:.2f}x" if r.warm else "-"])
        if r.demotion is not None:
            d = r.demotion
            table.append(["pool -> host RAM (evict), warm", ms(d.seconds), f"{r.nbytes / d.seconds / 1e9:,.2f} GB/s",
                          r.baseline_name, ms(d.baseline_seconds), *["-"] * 8, f"{d.ratio:.2f}x"])
    return render_table(table, ["path", "serving: load", "rate", "limit", "limit time", "vs limit",
                                "match -> load: vs limit", "new reader: first / steady", "first/steady",
                                "paused: memcpy / limit first/steady",
                                "just built: first / fresh copy", "fresh copy/first",
                                "fresh pool pages/first", "warm: vs limit"],
                        align_right=(1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13))


def _up(first: FirstLoads) -> str:
    """Whether the new reader had come up by its first load, and when it did."""
    if first.ready:
        return ""
    return f" (up at {first.up_s:.1f} s)" if first.up_s is not None else " (not up by the end)"
