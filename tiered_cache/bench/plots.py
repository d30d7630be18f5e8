"""PNG figures for the benches that take `--plot FILE` (matplotlib, Agg, imported here only):
each measured figure beside its same-run baseline, TTFT per tier against recompute by prefix
length, and the cluster bench's ways."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiered_cache.bench.timing import Comparison


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    _pyplot().close(fig)
    return out


def plot_comparisons(rows: Sequence[Comparison], path: str | Path, title: str) -> Path:
    """Horizontal bars, one pair per row (tiered-cache and its baseline), a panel per unit."""
    plt = _pyplot()
    units = list(dict.fromkeys(r.unit for r in rows))
    fig, axes = plt.subplots(len(units), 1, figsize=(10, 1.2 + 0.7 * len(rows)), squeeze=False)
    for ax, unit in zip(axes[:, 0], units, strict=True):
        mine = [r for r in rows if r.unit == unit]
        y = range(len(mine))
        ax.barh([i + 0.2 for i in y], [r.value for r in mine], height=0.4, color="tab:blue", label="tiered-cache")
        ax.barh([i - 0.2 for i in y], [r.baseline for r in mine], height=0.4, color="tab:gray", label="baseline")
        ax.set_yticks(list(y), [f"{r.operation}\n({r.scale}; vs {r.baseline_name})" for r in mine], fontsize=7)
        for i, r in zip(y, mine, strict=True):
            ax.annotate(f"{r.ratio:.2f}x", (max(r.value, r.baseline), i), xytext=(4, -3),
                        textcoords="offset points", fontsize=7)
        ax.set_xlabel(unit + (" (higher is better)" if mine[0].higher_is_better else " (lower is better)"))
        ax.invert_yaxis()
        ax.legend(fontsize="small")
        ax.grid(True, axis="x", alpha=0.3)
    axes[0, 0].set_title(title)
    return _save(fig, path)


def plot_ttft(rows: Sequence[Any], path: str | Path, title: str = "TTFT by prefix length, SmolLM2-135M") -> Path:
    """TTFT (ms, log) against prefix tokens: recompute and each tier (`TtftRow`s)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    lengths = [r.prefix_tokens for r in rows]
    ax.plot(lengths, [r.recompute_s * 1e3 for r in rows], marker="o", color="black", label="recompute (baseline)")
    for tier in rows[0].tier_s:
        ax.plot(lengths, [r.tier_s[tier] * 1e3 for r in rows], marker="o", label=f"prefix from {tier}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


def plot_cluster(results: Sequence[Any], path: str | Path) -> Path:
    """Client TTFT p50 and p99 per way of `bench cluster` (`WayResult`s, recompute first): waiting
    for the worker plus its TTFT, with the share of prefill saved over each pair of bars."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r.p50_wait_s * 1e3 for r in results], width=0.4, label="client TTFT p50")
    ax.bar([i + 0.2 for i in x], [r.p99_wait_s * 1e3 for r in results], width=0.4, label="client TTFT p99")
    for i, r in zip(x, results, strict=True):
        ax.annotate(f"{r.saved_share:.0%} saved", (i, r.p99_wait_s * 1e3), xytext=(0, 4),
                    textcoords="offset points", ha="center", fontsize=8)
    ax.set_xticks(list(x), [r.way for r in results])
    ax.set_ylabel("ms")
    ax.set_title("bench cluster: TTFT per way (recompute is the baseline)")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)
