"""`bench store-traffic`'s figure: latency per operation over time (p50 and p99 of each 1 s window) above
the server's RSS over time with its RAM tier's capacity. matplotlib (Agg) is imported here only."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tiered_cache.bench.store_traffic.client import Timeline

_COLORS = {"lookup": "tab:blue", "get": "tab:green", "put": "tab:red", "baseline": "tab:gray",
           "with cache": "tab:blue", "recompute": "tab:gray"}


def windowed(timeline: Timeline, t0: float, window_s: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Window centres (s after `t0`), p50 and p99 (ms) of the calls started in each window."""
    starts, latencies = np.frombuffer(timeline.starts), np.frombuffer(timeline.latencies) * 1e3
    if not len(starts):
        return np.empty(0), np.empty(0), np.empty(0)
    bins = ((starts - t0) // window_s).astype(int)
    centres, p50, p99 = [], [], []
    for b in np.unique(bins):
        chunk = latencies[bins == b]
        centres.append((b + 0.5) * window_s)
        p50.append(np.percentile(chunk, 50))
        p99.append(np.percentile(chunk, 99))
    return np.array(centres), np.array(p50), np.array(p99)


def write_png(path: str | Path, timelines: dict[str, Timeline], t0: float, rss: dict[str, list[tuple[float, int]]],
              ram_capacity: int | None, title: str, ylabel: str = "latency (ms), per 1 s window") -> Path:
    """Draw the figure into `path` (a PNG); `t0` is the mix's start, the x axis's 0. `rss`: each
    process's samples by its name in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=(3, 2))
    for op, timeline in timelines.items():
        x, p50, p99 = windowed(timeline, t0)
        color = _COLORS.get(op)
        top.plot(x, p50, color=color, marker=".", label=f"{op} p50")
        top.plot(x, p99, color=color, marker=".", linestyle="--", label=f"{op} p99")
    top.set_yscale("log")
    top.set_ylabel(ylabel)
    top.legend(ncol=4, fontsize="small")
    top.grid(True, which="both", alpha=0.3)
    top.set_title(title)
    for name, samples in rss.items():
        bottom.plot([t - t0 for t, _ in samples], [b / 2**20 for _, b in samples], label=f"{name} RSS")
    if not any(rss.values()):
        bottom.text(0.5, 0.5, "no RSS samples (a process on another host, or no --server-pid)", ha="center",
                    transform=bottom.transAxes)
    if ram_capacity:
        bottom.axhline(ram_capacity / 2**20, color="tab:orange", linestyle=":", label="RAM tier capacity")
    bottom.set_ylim(bottom=0)
    bottom.set_ylabel("MiB")
    bottom.set_xlabel("seconds since the mix began")
    bottom.legend(fontsize="small")
    bottom.grid(True, alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
