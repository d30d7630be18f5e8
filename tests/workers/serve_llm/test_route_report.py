"""What an answer's `tiered_cache` field says of its route (`route_report`): the replica chosen,
what the router expected there, and the best scored of the replicas it passed over."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray.serve.llm")

from tiered_cache.workers.routing.policies import PrefixAwarePolicy
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


class _HoldsDocuments(PrefixAwarePolicy):
    """Decides as the event policy does for a question on a document another replica is still
    computing: held (`hold_s`) until `landed` says its pages are in the store; every other
    prompt at once. A stand-in for the event policy, whose holds test_event_policy.py tests."""

    def __init__(self) -> None:
        super().__init__()
        self.landed_now = False

    def choose(self, text, loads, prompt=None, chat=True, namespace=None, hold=True):
        held = hold and text.startswith("doc")
        return Decision(sorted(loads)[0], "events", 0, hold_s=30.0 if held else 0.0, ticket=1)

    def landed(self, decision):
        return self.landed_now

    def source_ended(self, decision):
        return None

    def finished(self, worker, decision):
        pass


class _Replica:
    """What Serve's routing loop reads of a replica."""

    def __init__(self, name: str, deployment) -> None:
        from ray.serve._private.common import ReplicaID

        self.replica_id = ReplicaID(name, deployment)
        self.max_ongoing_requests = 1000
        self.node_id, self.availability_zone, self.multiplexed_model_ids, self.routing_stats = "", None, set(), {}

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def test_requests_held_for_the_store_leave_serve_its_routing_tasks_for_every_other_request():
    """More requests held at once than Serve runs routing tasks (two per replica), and a question
    that needs no hold arriving behind them: every held request is held (none decided again
    without its hold for want of a task) and the other is routed at once; once the pages land,
    every held request is handed to its replica."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from tiered_cache.workers.serve_llm.request_router import TieredCacheRouter

    async def scenario() -> None:
        deployment = DeploymentID("llm", "app")
        router = TieredCacheRouter(deployment, DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        router.policy = policy = _HoldsDocuments()
        router.update_replicas([_Replica("r1", deployment), _Replica("r2", deployment)])
        serve_tasks = router.max_num_routing_tasks

        def request(n: int, prompt: str) -> PendingRequest:
            body = type("Body", (), {"prompt": prompt, "kv_transfer_params": None})()
            return PendingRequest([body], {}, RequestMetadata(f"q{n}", f"i{n}"))

        held = [request(n, f"doc {n}: what is it about?") for n in range(serve_tasks + 2)]
        routings = [asyncio.ensure_future(router._choose_replica_for_request(r)) for r in held]
        await asyncio.sleep(0.5)
        assert router._holding == len(held) and not any(t.done() for t in routings)
        other = await asyncio.wait_for(router._choose_replica_for_request(request(99, "hello")), 5.0)
        assert other.replica_id.unique_id in ("r1", "r2") and router.expired_holds == 0
        policy.landed_now = True
        placed = await asyncio.wait_for(asyncio.gather(*routings), 5.0)
        assert len(placed) == len(held) and router._holding == 0
        assert all(router.recent[f"q{n}"]["held_ms"] > 0 for n in range(len(held)))
        assert router.max_num_routing_tasks == serve_tasks  # nothing held any more

    asyncio.run(scenario())
