"""The rows of `tiered-cache bench gpu`: TTFT over rounds, the load alone beside the same-run copy
limit, and the first token's logits against recomputation."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, cast

import torch

from tiered_cache.cache import TieredCache
from tiered_cache.integrations.transformers import generate

Progress = Callable[[str], None]
_CHUNK = 256 * 2**20  # the copy limit's device buffer: GPU memory goes to the model and the KV


class Source(Protocol):
    row: str
    cache: TieredCache

    def reset(self) -> None: ...


@dataclass
class GpuRow:
    """One row at one prefix length. Lists hold one entry per round."""

    tokens: int  # prefix tokens; the prompt is these and a suffix shorter than a page
    row: str
    tier: str | None  # where the prefix must come from (None: recompute)
    ttft_s: list[float]
    reused_tokens: list[int]
    sources: list[dict[str, int]]
    load_s: list[float] = field(default_factory=list)  # match + prefetch + load, within that round's TTFT
    load_bytes: list[int] = field(default_factory=list)  # bytes moved into the pool from below it
    limit_name: str = ""
    limit_s: float | None = None  # fastest copy of limit_bytes
    limit_bytes: int = 0
    max_abs_diff: float | None = None  # first-token logits vs recompute's, worst round
    greedy_agrees: bool | None = None  # same greedy token as recompute in every round
    margin: float | None = None  # recompute's gap between its top two logits
    recompute_s: float | None = None  # median recompute TTFT at this length
    first_s: float | None = None  # the unmeasured first round's TTFT: what a cold process pays once
    pool_full: list[float] = field(default_factory=list)  # share of the pool's pages in use as each load began
    # `host` only: the demotion that put the prefix there each round (device -> host RAM, every
    # page copied), beside a pinned device -> host copy of the same bytes
    evict_s: list[float] = field(default_factory=list)
    evict_bytes: int = 0
    evict_limit_s: float | None = None
    # Pages DMA'd from a same-host store's arena (CUDA), per round: what `ArenaCopier.figures`
    # gained in that round (pages copied, seconds of copies on the stream and of checks, ...)
    arena: list[dict[str, Any]] = field(default_factory=list)

    @property
    def p50_s(self) -> float:
        return statistics.median(self.ttft_s)

    @property
    def speedup(self) -> float | None:
        return self.recompute_s / self.p50_s if self.recompute_s else None

    @property
    def load_gbps(self) -> float | None:
        moved = max(self.load_bytes, default=0)
        return moved / statistics.median(self.load_s) / 1e9 if moved and self.load_s else None

    @property
    def evict_gbps(self) -> float | None:
        return self.evict_bytes / statistics.median(self.evict_s) / 1e9 if self.evict_s and self.evict_bytes else None

    @property
    def evict_limit_gbps(self) -> float | None:
        return self.evict_bytes / self.evict_limit_s / 1e9 if self.evict_limit_s and self.evict_bytes else None

    @property
    def limit_gbps(self) -> float | None:
        return self.limit_bytes / self.limit_s / 1e9 if self.limit_s else None

    @property
    def ratio(self) -> float | None:
        load, limit = self.load_gbps, self.limit_gbps
        return load / limit if load and limit else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ttft_p50_s=self.p50_s, ttft_min_s=min(self.ttft_s), ttft_max_s=max(self.ttft_s),
                   speedup=self.speedup, load_GBps=self.load_gbps, limit_GBps=self.limit_gbps,
                   load_over_limit=self.ratio, evict_GBps=self.evict_gbps, evict_limit_GBps=self.evict_limit_gbps)
        return out


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_limit(nbytes: int, device: str, repeat: int = 3, to_device: bool = True) -> tuple[str, float]:
    """(what was copied, fastest seconds of `repeat`) for the physical limit of moving `nbytes`
    into the pool (`to_device`; else out of it): on CUDA a pinned host -> device (device -> host)
    copy, in 256 MiB pieces into one device buffer (the link's rate from 256 MiB up is flat, and
    GPU memory belongs to the model); on the CPU a memcpy between two preallocated tensors,
    written once first so no page fault is timed."""
    cuda = torch.device(device).type == "cuda"
    size = min(nbytes, _CHUNK) if cuda else nbytes
    src = torch.empty(size, dtype=torch.uint8, pin_memory=cuda).fill_(1)
    dst = torch.zeros(size, dtype=torch.uint8, device=device)
    if not to_device:
        src, dst = dst, src
    best = float("inf")
    for _ in range(repeat):
        synchronize(device)
        start = time.perf_counter()
        for offset in range(0, nbytes, size):
            n = min(size, nbytes - offset)
            dst[:n].copy_(src[:n], non_blocking=cuda)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    direction = "host->device" if to_device else "device->host"
    return (f"pinned {direction} copy" if cuda else "memcpy"), best


class TimedLoad:
    """A `TieredCache` as `generate` sees it, timing match + prefetch + load inside that very call:
    from `match` to the loaded pages being in the pool. On CUDA two events on the compute stream
    (which `load` makes wait for its copies) time it with no synchronize added to the TTFT path;
    the caller synchronizes before `generate`, so the GPU is idle when `match` starts."""

    def __init__(self, cache: TieredCache, device: str) -> None:
        self.cache = cache
        self.cuda = torch.device(device).type == "cuda"
        self.moved = 0  # bytes loaded into the pool from below it
        self._events: tuple[Any, Any] | None = None
        self._wall = (0.0, 0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def match(self, tokens: Any, namespace: str | None = None) -> Any:
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._wall = (time.perf_counter(), 0.0)
        return self.cache.match(tokens, namespace)

    def load(self, handle: Any) -> Any:
        pages = self.cache.load(handle)
        if self._events is not None:
            self._events[1].record()
        self._wall = (self._wall[0], time.perf_counter())
        self.moved = (len(pages) - handle.sources.get("device", 0)) * self.cache.spec.bytes_per_page
        return pages

    @property
    def seconds(self) -> float:
        """The time from match to loaded (after `generate` returned: it synchronized)."""
        if self._events is not None:
            return float(self._events[0].elapsed_time(self._events[1])) / 1e3
        return self._wall[1] - self._wall[0]


def arena_figures(cache: TieredCache) -> dict[str, Any] | None:
    """The cache's `ArenaCopier.stats()`, or None before it DMA'd from an arena (CUDA only)."""
    copier = getattr(getattr(cache, "arena_loads", None), "copier", None)
    return copier.stats() if copier is not None else None


def arena_round(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What one round added to the arena copier's figures (gauges as they are after it)."""
    if after is None:
        return None
    gauges = ("checkers", "registered")
    return {k: v if k in gauges or before is None else v - before[k] for k, v in after.items()}


def describe_arena(figures: dict[str, Any], page_bytes: int) -> str:
    """One round's arena DMA as a phrase: pages, then the copies' and the checks' rates."""
    moved = figures["copied"] * page_bytes

    def rate(seconds: float) -> str:
        return f"{moved / seconds / 1e9:.1f} GB/s" if moved and seconds > 0 else "-"

    f = figures
    # Staged pages (a map the driver would not register) went through pinned host chunks: their
    # "checks" are the threads' copies with their checks.
    staged = f" ({f['staged']} staged through host chunks)" if f.get("staged") else ""
    return (f"arena DMA {f['copied']} pages{staged} in {f['calls']} call(s): copy stream {f['copy_s'] * 1e3:.1f} ms "
            f"({rate(f['copy_s'])}), checks {f['check_s'] * 1e3:.1f} ms ({rate(f['check_s'])} on "
            f"{f['checkers']} threads), whole {f['call_s'] * 1e3:.1f} ms; maps registered "
            f"{f['registered']}, refused {f['refused']}, lost {f['lost']}")


def fidelity(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, bool]:
    """(max |logit difference|, same greedy token) of a row's first token against recompute's."""
    return float((logits.float() - reference.float()).abs().max()), int(logits.argmax()) == int(reference.argmax())


def measure_recompute(model: Any, prompt: list[int], prefix: int, rounds: int,
                      progress: Progress) -> tuple[GpuRow, torch.Tensor]:
    """The recompute row (no cache) and its first-token logits, the reference of the others. One
    round runs first unmeasured, as in every row (see `measure_reuse`)."""
    row = GpuRow(prefix, "recompute", None, [], [], [])
    row.first_s = generate(model, prompt, None, 1).ttft_s
    reference = None
    for i in range(rounds):
        result = generate(model, prompt, None, 1)
        row.ttft_s.append(result.ttft_s)
        row.reused_tokens.append(result.reused_tokens)
        row.sources.append(result.sources)
        reference = result.first_logits if reference is None else reference
        progress(f"  recompute {i + 1}/{rounds}: {result.ttft_s * 1e3:,.1f} ms")
    assert reference is not None
    top2 = torch.topk(reference.float(), 2).values
    row.margin = float(top2[0] - top2[1])
    row.recompute_s = row.p50_s
    return row, reference


def measure_reuse(model: Any, source: Source, tier: str, prompts: Iterator[tuple[list[int], torch.Tensor]],
                  prefix: int, rounds: int, reference: GpuRow, device: str, progress: Progress) -> GpuRow:
    """A reuse row: rounds of `generate`, each on the next of `prompts` (a prompt and its
    recomputed first-token logits) after `source.reset`, each timing its load too. One round runs
    first unmeasured (its TTFT is the row's `first`): a running engine has its allocator's blocks
    for these sizes, its staging buffers pinned and its shared-memory mapping faulted in."""
    row = GpuRow(prefix, source.row, tier, [], [], [], margin=reference.margin, recompute_s=reference.p50_s)
    worst, agrees = 0.0, True
    for i, (prompt, reference_logits) in zip(range(-1, rounds), prompts, strict=False):
        source.reset()
        timed = TimedLoad(source.cache, device)
        synchronize(device)  # before the clock starts: the GPU is idle when match begins
        arena_before = arena_figures(source.cache)
        pool = source.cache.pool
        full = 1 - pool.num_free / pool.num_pages
        result = generate(model, prompt, cast(TieredCache, timed), 1)
        arena = arena_round(arena_before, arena_figures(source.cache))
        if i < 0:
            row.first_s = result.ttft_s
            continue
        if arena is not None:
            row.arena.append(arena)
        row.ttft_s.append(result.ttft_s)
        row.pool_full.append(full)
        row.load_s.append(timed.seconds)
        row.load_bytes.append(timed.moved)
        row.reused_tokens.append(result.reused_tokens)
        row.sources.append(result.sources)
        assert result.first_logits is not None
        diff, same = fidelity(result.first_logits, reference_logits)
        worst, agrees = max(worst, diff), agrees and same
        progress(f"  {source.row} {i + 1}/{rounds}: TTFT {result.ttft_s * 1e3:,.1f} ms, load "
                 f"{timed.seconds * 1e3:,.1f} ms, reused {result.reused_tokens:,} from {result.sources}"
                 + (f"; {describe_arena(arena, source.cache.spec.bytes_per_page)}" if arena else ""))
    row.max_abs_diff, row.greedy_agrees = worst, agrees
    return row
