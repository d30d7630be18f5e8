"""`tiered-cache bench cluster` on the session's Ray cluster, small: every way runs, answers equal
recompute's, the shared store saves more prefill than workers alone, the routers at least as
much, and from the workers' own devices where round robin loads from the store."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli_here

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.long]  # a benchmark run, not the cache's correctness: make test-long


def test_bench_cluster_compares_five_ways_in_one_run(ray_cluster, tmp_path):
    png = tmp_path / "cluster.png"
    ray.shutdown()  # the bench joins the cluster itself, in its own namespace (in this process: main())
    try:
        out = run_cli_here("bench", "cluster", "--address", ray_cluster.address, "--docs", "2", "--questions", "3",
                           "--max-new-tokens", "2", "--doc-chars", "600", "--concurrency", "1", "--json",
                           "--plot", str(png)).stdout
    finally:
        ray.shutdown()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {r["way"]: r for r in json.loads(out)}
    assert list(rows) == ["recompute", "alone", "shared_round_robin", "shared_prefix", "shared_events"]
    assert all(r["requests"] == 6 and r["answers_match_recompute"] for r in rows.values())
    assert rows["recompute"]["reused_tokens"] == 0
    assert len({r["prompt_tokens"] for r in rows.values()}) == 1  # the same workload each way
    # One request at a time, each one's pages in the store before the next (the default bench runs
    # several, where round robin loses more): round robin routes the same way with or without a
    # store, and the store adds hits (another document's pages: here 656 tokens reused, alone 352);
    # the router sends each document's questions where it was prefilled, so it reuses the most
    # there is to reuse (656 here too) and from the device, where round robin loads from the store.
    alone, shared, routed = (rows[w]["reused_tokens"] for w in ("alone", "shared_round_robin", "shared_prefix"))
    assert routed >= shared > alone > 0
    remote = {w: rows[w]["reused_from"].get("remote", 0) for w in rows}
    assert remote["alone"] == 0 < remote["shared_prefix"] < remote["shared_round_robin"]
    # The event router knows where each page is: with nothing in flight it sends a question to the
    # worker whose device holds the document, so it reuses as much as the prefix router, no more
    # from the store, and says what the store sent (bytes moved between nodes).
    events = rows["shared_events"]
    assert events["reused_tokens"] == routed and remote["shared_events"] <= remote["shared_prefix"]
    assert rows["shared_round_robin"]["store_bytes"] == remote["shared_round_robin"] * 23040  # SmolLM2 fp16 KV
    assert all(r["p50_client_ttft_s"] > 0 for r in rows.values())
