"""What an answer's `tiered_cache` field says of its route (`route_report`): the replica chosen,
what the router expected there, and the best scored of the replicas it passed over."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray.serve.llm")

from tiered_cache.workers.routing.policy import Considered, Decision
from tiered_cache.workers.serve_llm.request_router import OTHERS_SHOWN, route_report


def test_a_route_shows_the_chosen_replica_and_the_best_scored_of_those_passed_over():
    weighed = [Considered("r2", 0.5, 0.1, (0, 0, 512), 0.6)]  # chosen: it loads the prefix from the store
    weighed += [Considered(f"r{i}", 4.0 + i, 3.0 + i, (512, 0, 0), 4.5 + i) for i in range(6, 2, -1)]
    weighed += [Considered("r1", 2.0, 1.5, (256, 0, 256), 2.5)]
    decision = Decision("r2", "events", 512, (0, 0, 512), wait_s=0.1, considered=tuple(weighed))
    report = route_report(decision)
    assert report["replica"] == "r2" and report["expected_from"] == {"device": 0, "host": 0, "store": 512}
    assert (report["expected_ttft_ms"], report["score_ms"], report["expected_wait_ms"]) == (500, 600, 100)
    assert list(report["others"]) == ["r1", "r3", "r4"][:OTHERS_SHOWN]  # best scored first, not every replica
    assert report["others"]["r1"] == {"expected_from": {"device": 256, "host": 0, "store": 256},
                                      "expected_wait_ms": 1500, "expected_ttft_ms": 2000, "score_ms": 2500}


def test_a_route_decided_without_events_says_only_where_and_why():
    assert route_report(Decision("r1", "least_cached", 0)) == {"replica": "r1", "reason": "least_cached"}
