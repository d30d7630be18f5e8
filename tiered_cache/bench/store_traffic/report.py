"""`bench store-traffic`'s figures from the clients' reports: calls/s and p50/p99/p999 per operation beside
the same-run baseline, errors by kind, pages checked, and the server's memory over the run.

`bench store-traffic --ray`'s figures: per phase (recompute, the baseline; then with the cache) requests/s,
p50/p99/p999 latency and TTFT, prefill saved, errors by kind and routes; every answer compared with
the recompute answer for its prompt; each actor's RSS over the run with its plateau verdict."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tiered_cache.bench.store_traffic.client import OPS, ClientReport, Timeline
from tiered_cache.bench.store_traffic.rss import Plateau, plateau
from tiered_cache.bench.timing import Comparison

if TYPE_CHECKING:
    from tiered_cache.bench.store_traffic.ray_client import ChatReport


@dataclass(frozen=True)
class OpFigures:
    op: str
    calls: int
    per_s: float
    p50_ms: float
    p99_ms: float
    p999_ms: float


@dataclass(frozen=True)
class TierFigures:
    name: str
    used: int
    capacity: int
    pages: int
    evictions: int


@dataclass(frozen=True)
class TrafficResult:
    clients: int
    window_s: float  # the mix: first release to the last call's end
    requests: int
    ops: list[OpFigures]
    baseline: OpFigures  # 1-key Lookups, as many client processes, store idle
    errors: dict[str, int]
    pages_compared: int
    pages_missing: int
    pages_put: int
    distinct_pages: int
    blob_bytes: int
    rss: list[tuple[float, int]]  # (s since the mix began, bytes)
    plateau: Plateau | None
    tiers: list[TierFigures]  # the server's, after the run
    png: str | None

    @property
    def wrong_bytes(self) -> int:
        return self.errors.get("wrong_bytes", 0)

    def comparisons(self) -> list[Comparison]:
        scale = f"{self.clients} client{'s' if self.clients > 1 else ''}"
        base = self.baseline
        rows = [Comparison(scale, "calls/s, all operations", sum(o.per_s for o in self.ops),
                           "1-key Lookups/s", base.per_s, "calls/s", True)]
        for op in self.ops:
            for q in ("p50", "p99", "p999"):
                rows.append(Comparison(scale, f"{op.op} {q}", getattr(op, f"{q}_ms"), f"1-key Lookup {q}",
                                       getattr(base, f"{q}_ms"), "ms", False))
        return rows

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["plateau"] = self.plateau.to_dict() if self.plateau else None
        out["wrong_bytes"] = self.wrong_bytes
        out["comparisons"] = [r.to_dict() for r in self.comparisons()]
        return out


def percentiles(values: np.ndarray) -> tuple[float, float, float]:
    """p50, p99 and p999 of `values` (NaN when there are none)."""
    if not len(values):
        return float("nan"), float("nan"), float("nan")
    p50, p99, p999 = np.percentile(values, [50, 99, 99.9])
    return float(p50), float(p99), float(p999)


def figures(op: str, timelines: list[Timeline], window_s: float) -> OpFigures:
    latencies = np.concatenate([np.frombuffer(t.latencies) for t in timelines]) * 1e3
    return OpFigures(op, len(latencies), len(latencies) / window_s, *percentiles(latencies))


def summarise(reports: list[ClientReport], rss: list[tuple[float, int]], prompt_pages: int, blob_bytes: int,
              tiers: list[TierFigures], png: str | None) -> TrafficResult:
    """Merge the clients' reports; `rss` in time.monotonic seconds (made relative to the mix's start)."""
    start, end = min(r.window[0] for r in reports), max(r.window[1] for r in reports)
    b_start, b_end = min(r.baseline_window[0] for r in reports), max(r.baseline_window[1] for r in reports)
    errors: Counter = Counter()
    for r in reports:
        errors.update(r.errors)
    return TrafficResult(
        clients=len(reports), window_s=end - start, requests=sum(r.requests for r in reports),
        ops=[figures(op, [r.ops[op] for r in reports], end - start) for op in OPS],
        baseline=figures("1-key lookup", [r.baseline for r in reports], b_end - b_start),
        errors=dict(sorted(errors.items())), pages_compared=sum(r.pages_compared for r in reports),
        pages_missing=sum(r.pages_missing for r in reports), pages_put=sum(r.pages_put for r in reports),
        distinct_pages=prompt_pages + sum(r.new_pages for r in reports), blob_bytes=blob_bytes,
        rss=[(t - start, b) for t, b in rss], plateau=plateau(rss, start, end), tiers=tiers, png=png)


# `bench store-traffic --ray`


@dataclass(frozen=True)
class PhaseFigures:
    phase: str
    clients: int
    window_s: float
    requests: int
    per_s: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    prompt_tokens: int
    reused_tokens: int
    errors: dict[str, int]
    routes: dict[str, int]
    sources: dict[str, int]

    @property
    def saved_share(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class AnswerCheck:
    prompts: int  # distinct prompts answered
    answers_compared: int  # answers checked against another answer for the same prompt
    recomputed: int  # prompts answered without the cache (in the baseline or after the run)
    wrong: int  # answers that differed from the recompute answer (or from another answer)
    failed: int = 0  # recomputes for the check that got no answer


@dataclass(frozen=True)
class ProcessMemory:
    name: str  # the actor
    samples: list[tuple[float, int]]  # (s since the mix began, bytes)
    plateau: Plateau | None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "samples": self.samples,
                "plateau": self.plateau.to_dict() if self.plateau else None}


@dataclass(frozen=True)
class RayTrafficResult:
    workers: int
    shards: int
    max_new_tokens: int
    recompute: PhaseFigures
    cache: PhaseFigures
    answers: AnswerCheck
    memory: list[ProcessMemory]
    tiers: dict[str, dict[str, Any]]  # the cluster's totals per tier after the run
    png: str | None

    def comparisons(self) -> list[Comparison]:
        scale = f"{self.cache.clients} clients"
        c, r = self.cache, self.recompute
        rows = [Comparison(scale, "requests/s", c.per_s, "recompute", r.per_s, "req/s", True)]
        for q in ("p50", "p99", "p999"):
            rows.append(Comparison(scale, f"request {q}", getattr(c, f"{q}_ms"), "recompute",
                                   getattr(r, f"{q}_ms"), "ms", False))
        for q in ("p50", "p99"):
            rows.append(Comparison(scale, f"TTFT {q}", getattr(c, f"ttft_{q}_ms"), "recompute",
                                   getattr(r, f"ttft_{q}_ms"), "ms", False))
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {"workers": self.workers, "shards": self.shards, "max_new_tokens": self.max_new_tokens,
                "recompute": {**asdict(self.recompute), "saved_share": self.recompute.saved_share},
                "cache": {**asdict(self.cache), "saved_share": self.cache.saved_share},
                "answers": asdict(self.answers), "memory": [m.to_dict() for m in self.memory],
                "tiers": self.tiers, "png": self.png, "comparisons": [r.to_dict() for r in self.comparisons()]}


def phase_figures(reports: list[ChatReport]) -> PhaseFigures:
    start, end = min(r.window[0] for r in reports), max(r.window[1] for r in reports)
    latencies = np.concatenate([np.frombuffer(r.requests.latencies) for r in reports]) * 1e3
    ttft = np.concatenate([np.frombuffer(r.ttft_s) for r in reports]) * 1e3
    errors, routes, sources = Counter(), Counter(), Counter()
    for r in reports:
        errors.update(r.errors)
        routes.update(r.routes)
        sources.update(r.sources)
    p50, p99, p999 = percentiles(latencies)
    t50, t99, _ = percentiles(ttft)
    return PhaseFigures(reports[0].phase, len(reports), end - start, len(latencies), len(latencies) / (end - start),
                        p50, p99, p999, t50, t99, sum(r.prompt_tokens for r in reports),
                        sum(r.reused_tokens for r in reports), dict(sorted(errors.items())),
                        dict(sorted(routes.items())), dict(sorted(sources.items())))


def check_answers(reports: list[ChatReport], recomputed: dict[str, tuple[int, ...]]) -> AnswerCheck:
    """Compare every answer kept in `reports` with the recompute answer for its prompt (from a
    "recompute" report or `recomputed`), or, where there is none, with the prompt's first answer;
    a client's own repeats were compared with its first answer already."""
    reference = {key: (tokens, -1) for key, tokens in recomputed.items()}  # prompt -> (answer, report index)
    for i, r in enumerate(reports):
        if r.phase == "recompute":
            for key, tokens in r.answers.items():
                reference.setdefault(key, (tokens, i))
    recomputed_prompts = len(reference)
    compared = wrong = 0
    for i, r in enumerate(reports):
        compared, wrong = compared + r.repeats, wrong + r.conflicts
        for key, tokens in r.answers.items():
            expected, origin = reference.setdefault(key, (tokens, i))
            if origin != i:
                compared += 1
                wrong += expected != tokens
    return AnswerCheck(len(reference), compared, recomputed_prompts, wrong)


def memory_figures(samples: dict[str, list[tuple[float, int]]], start: float, end: float) -> list[ProcessMemory]:
    """Each actor's samples made relative to the mix's `start`, with its plateau over the mix."""
    return [ProcessMemory(name, [(t - start, b) for t, b in s], plateau(s, start, end))
            for name, s in sorted(samples.items())]
