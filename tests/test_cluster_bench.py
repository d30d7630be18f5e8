"""`tiered-cache bench cluster` on the session's Ray cluster, small: every way runs, answers equal
recompute's, and the shared store saves more prefill than workers alone, the router at least as
much as round robin."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def test_bench_cluster_compares_four_ways_in_one_run(ray_cluster):
    out = run_cli("bench", "cluster", "--address", ray_cluster.address, "--docs", "2", "--questions", "3",
                  "--max-new-tokens", "3", "--json").stdout
    rows = {r["way"]: r for r in json.loads(out)}
    assert list(rows) == ["recompute", "alone", "shared_round_robin", "shared_prefix"]
    assert all(r["requests"] == 6 and r["answers_match_recompute"] for r in rows.values())
    assert rows["recompute"]["reused_tokens"] == 0
    assert len({r["prompt_tokens"] for r in rows.values()}) == 1  # the same workload each way
    # Alone, each worker prefills each document once; shared, the cluster does.
    assert rows["shared_round_robin"]["reused_tokens"] > rows["alone"]["reused_tokens"] > 0
    assert rows["shared_prefix"]["reused_tokens"] >= rows["shared_round_robin"]["reused_tokens"]
