"""`bench serve`'s report from outcomes (no engines: the outcomes are built here): the summary's
quantiles and cache share, answers compared by key, and the per-request dump lined up by arrival."""

from tiered_cache.bench.serve.client import Outcome
from tiered_cache.bench.serve.report import outcomes, summary
from tiered_cache.bench.serve.runner import WayRun
from tiered_cache.bench.serve.workload import ServeWorkload


def _run(way: str, keys: list[str], ttft: dict[str, float], text: dict[str, str]) -> WayRun:
    return WayRun(way, [Outcome(k, ttft_s=ttft[k], latency_s=ttft[k] + 1, text=text.get(k, "same"), prompt_tokens=100,
                                cached_tokens=50 if ttft[k] < 1 else 0, output_tokens=16) for k in keys], wall_s=10.0)


def test_outcomes_line_up_by_arrival_and_the_summary_compares_answers_by_key():
    requests = ServeWorkload(2, 2, 300, 1, 2, 1.0, 5).requests()
    keys = [r.key for r in requests]
    late_first = list(reversed(keys))  # a way's outcomes come back in any order
    ttft = {k: 0.1 * (i + 1) if i % 2 else 2.0 + i for i, k in enumerate(keys)}
    first = _run("b", keys, ttft, {})
    other = _run("d", late_first, ttft, {keys[0]: "different"})

    dumped = outcomes([first, other], requests)
    assert list(dumped) == ["b", "d"]
    for rows in dumped.values():
        assert [r["key"] for r in rows] == keys  # arrival order, whatever order they came back in
        assert [r["arrival_s"] for r in rows] == [r.arrival_s for r in requests]
        assert [r["ttft_s"] for r in rows] == [ttft[k] for k in keys]

    row = summary(other, first)
    assert row["answers_compared"] == len(keys) and row["answers_equal"] == len(keys) - 1
    assert row["cached_share"] == sum(50 for k in keys if ttft[k] < 1) / (100 * len(keys))
