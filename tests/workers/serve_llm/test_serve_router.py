"""Our router inside Serve's own routing loop (`RequestRouter`: its routing tasks, its pending
requests), over replicas that publish real KV events: what Serve's loop makes of a router that
holds requests and subscribes to replicas as they come."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray.serve.llm")
pytest.importorskip("zmq")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from tiered_cache.events.publisher import EventPublisher
from tiered_cache.workers.routing.policies import PrefixAwarePolicy
from tiered_cache.workers.routing.policy import Decision
from tiered_cache.workers.serve_llm import request_router
from tiered_cache.workers.serve_llm.request_router import TieredCacheRouter

DEPLOYMENT = DeploymentID("llm", "app")
DOCUMENT = "Document: " + " ".join(f"word{i}" for i in range(300))


class _Replica:
    """What Serve's routing loop reads of a replica: its id, queue and routing stats."""

    def __init__(self, name: str, routing_stats: dict | None = None, max_ongoing_requests: int = 1000) -> None:
        self.replica_id = ReplicaID(name, DEPLOYMENT)
        self.max_ongoing_requests = max_ongoing_requests
        self.node_id, self.availability_zone, self.multiplexed_model_ids = "", None, set()
        self.routing_stats = routing_stats or {}

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def _request(n: int, prompt: str) -> PendingRequest:
    body = type("Body", (), {"prompt": prompt, "kv_transfer_params": None})()
    return PendingRequest([body], {}, RequestMetadata(f"q{n}", f"i{n}"))


def _router(model: str = "") -> TieredCacheRouter:
    router = TieredCacheRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(model=model)
    return router


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


def test_requests_held_for_the_store_leave_serve_its_routing_tasks_for_every_other_request():
    """More requests held at once than Serve runs routing tasks (two per replica), and a question
    that needs no hold arriving behind them: every held request is held (none decided again
    without its hold for want of a task) and the other is routed at once; once the pages land,
    every held request is handed to its replica."""
    async def scenario() -> None:
        router = _router()
        router.policy = policy = _HoldsDocuments()
        router.update_replicas([_Replica("r1"), _Replica("r2")])
        serve_tasks = router.max_num_routing_tasks
        request = _request
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


@pytest.fixture
def publishers():
    """Two replicas' event publishers (their engines publish nothing: the router subscribes)."""
    made = [EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") for _ in range(2)]
    yield made
    for p in made:
        p.close()


def _publishing(publishers: list[EventPublisher]) -> list[_Replica]:
    """Replicas whose routing stats say where `publishers` publish, as Serve's poll hands them over."""
    return [_Replica(f"r{i}", {"kv_event_metadata": {"endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint,
                                                     "block_size": 16}}) for i, p in enumerate(publishers)]


def test_a_new_deployment_s_first_requests_wait_for_its_replicas_events_rather_than_fall_back(publishers):
    """Two questions on one document arrive as a new deployment's router first hears of its
    replicas (Serve's `update_replicas`): it subscribes to them at once, and a request that
    arrives meanwhile waits for the subscriptions rather than fall back to the prefix policy,
    which knows nothing yet and would send the second question to compute the document again on
    the other replica."""
    async def scenario() -> None:
        router = _router("smollm2")
        try:
            router.update_replicas(_publishing(publishers))
            first = asyncio.ensure_future(router._choose_replica_for_request(
                _request(1, f"{DOCUMENT}\nQuestion: what is it about?")))
            await asyncio.sleep(0.05)
            second = await asyncio.wait_for(router._choose_replica_for_request(
                _request(2, f"{DOCUMENT}\nQuestion: who wrote it?")), 30.0)
            first = await asyncio.wait_for(first, 30.0)
            assert router.policy.fallbacks == 0
            assert [router.recent[q]["reason"] for q in ("q1", "q2")] == ["events", "events"]
            # Decided in their order of arrival: the second sees the first computing the document.
            assert router.recent["q1"]["expected_cached_tokens"] == 0
            assert router.recent["q2"]["expected_from"]["device"] > 0
            assert second.replica_id == first.replica_id  # where the document is being computed
        finally:
            router.policy.close()

    asyncio.run(scenario())


def test_a_new_deployment_s_first_request_before_serve_has_polled_the_replicas_waits_for_their_stats(publishers):
    """Serve polls the replicas' routing stats (their event endpoints) every few seconds: a new
    deployment's first request may come before the first poll. It waits for the stats, then for
    the subscriptions, and is decided by events, not by the prefix policy."""
    async def scenario() -> None:
        router = _router("smollm2")
        try:
            router.update_replicas([_Replica(f"r{i}", {"tiered_cache": {}}) for i in range(2)])  # not polled yet
            first = asyncio.ensure_future(router._choose_replica_for_request(
                _request(1, f"{DOCUMENT}\nQuestion: what is it about?")))
            await asyncio.sleep(0.5)
            assert not first.done()
            router.update_replicas(_publishing(publishers))
            await asyncio.wait_for(first, 30.0)
            assert router.policy.fallbacks == 0 and router.recent["q1"]["reason"] == "events"
        finally:
            router.policy.close()

    asyncio.run(scenario())


def test_time_held_for_the_store_is_not_charged_to_the_store_s_load():
    """A question held 8 s for its document to land (2 s expected), then loaded and answered in
    what the estimate expects: its TTFT as the front end timed it holds the hold, which the
    router takes out; the store's rate stays what the load took, not 8 s over 1,408 tokens."""
    from tiered_cache.workers.serve_llm.request_router import learn, route_report

    router = _router()
    estimate = router.policy.estimate
    prior = estimate.store_s_per_token
    decision = Decision("r1", "events", 1408, (0, 0, 1408), wait_s=2.0, ticket=1, held_s=8.0)
    router.recent["held-1"], router._routes["held-1"] = route_report(decision), decision
    own = estimate.seconds(1440, 0, 0, 1408)
    learn("held-1", {"ttft_s": 8.0 + own, "prompt_tokens": 1440, "reused_tokens": 1408}, 8.0 + own + 0.5)
    assert estimate.store_s_per_token == pytest.approx(prior, rel=0.05)
    assert estimate.decode_s == pytest.approx(0.5, rel=0.05)


def test_the_router_prices_the_store_by_the_loads_the_replicas_connectors_timed(monkeypatch):
    """Each replica's routing stats carry its connector's load totals (`load_seconds`,
    `blocks_loaded`, since its engine started): the router reads what they grew by since Serve
    last handed them over, over every replica, as the store's cost per token (blocks of the connector's page
    size); totals that did not grow teach nothing, and a replica whose totals start over (a new
    engine) counts from zero."""
    monkeypatch.setattr(request_router, "JOIN_WAIT_S", 0.2)  # no events here: the first route waits this long
    keying = {"fingerprint": "f" * 64, "namespace": "", "page_size": 32, "groups": 1}
    stats = [{"tiered_cache_keying": keying, "tiered_cache": {}} for _ in range(2)]

    async def scenario() -> None:
        router = _router()
        estimate = router.policy.estimate
        replicas = [_Replica(f"r{i}", s) for i, s in enumerate(stats)]
        asked = iter(range(100))

        async def route() -> None:  # Serve hands over the replicas' stats, then a request comes
            router.update_replicas(replicas)
            n = next(asked)
            await asyncio.wait_for(router._choose_replica_for_request(_request(n, f"question {n}")), 30.0)

        await route()
        assert not estimate.store_timed and router.keying["page_size"] == 32
        stats[0]["tiered_cache"] = {"load_seconds": 0.03, "blocks_loaded": 10}
        stats[1]["tiered_cache"] = {"load_seconds": 0.01, "blocks_loaded": 10}
        await route()
        first = 0.04 / (20 * 32)
        assert estimate.store_timed and estimate.store_s_per_token == pytest.approx(first)
        await route()  # the same totals: nothing new
        assert estimate.store_s_per_token == pytest.approx(first)
        stats[1]["tiered_cache"] = {"load_seconds": 0.002, "blocks_loaded": 2}  # a new engine's totals
        await route()
        assert estimate.store_s_per_token == pytest.approx((first + 0.002 / 64) / 2)

    asyncio.run(scenario())


def test_the_router_prices_prefills_by_what_each_replica_s_engine_timed_at_its_start(monkeypatch):
    """Each replica's routing stats say how long its engine took to prefill a probe at start and
    the same probe again with most of it cached (`tiered_cache_prefill`): the router takes each
    as a sample of the prefill's rate and of a cached token's share before any answer has come
    back, once per engine (the same figures handed over again teach nothing; a replica whose
    engine started again is read again), and a replica that says none is passed by."""
    monkeypatch.setattr(request_router, "JOIN_WAIT_S", 0.2)  # no events here: the first route waits this long
    stats = [{"tiered_cache_prefill": {"tokens": 1024, "seconds": 6.144, "cached_tokens": 992,
                                       "hit_seconds": 0.192 + 0.2976}},  # 32 new at 6 ms, 992 cached at 5%
             {"tiered_cache_prefill": None}]

    async def scenario() -> None:
        router = _router()
        estimate = router.policy.estimate
        replicas = [_Replica(f"r{i}", s) for i, s in enumerate(stats)]
        router.update_replicas(replicas)
        assert estimate.prefill_probes == 1 and estimate.prefill_s_per_token == pytest.approx(6e-3)
        assert estimate.cached_share == pytest.approx(0.05)
        router.update_replicas(replicas)
        stats[1]["tiered_cache_prefill"] = {"tokens": 1024, "seconds": 4.096}  # no hit timed there
        router.update_replicas(replicas)
        assert estimate.prefill_probes == 2 and estimate.prefill_s_per_token == pytest.approx(5e-3)
        assert estimate.cached_share == pytest.approx(0.05)
        stats[0]["tiered_cache_prefill"] = {"tokens": 1024, "seconds": 2.048}  # r0's engine started again
        router.update_replicas(replicas)
        assert estimate.prefill_probes == 3 and estimate.prefill_s_per_token == pytest.approx(4e-3)
        await asyncio.wait_for(router._choose_replica_for_request(_request(1, "a question")), 30.0)
        assert router.stats()["estimate"]["prefill_probes"] == 3

    asyncio.run(scenario())


def test_a_replica_with_as_many_requests_as_it_takes_is_passed_over_while_another_has_room():
    """The policy would send every request to r1 (its first replica), which takes two at a time:
    a third goes to r2 rather than be refused by r1 and asked for again after Serve's back-off;
    once every replica is full the policy decides among all (Serve queues it), and once r1 has
    room again it is r1's."""
    async def scenario() -> None:
        router = _router()
        router.policy = _HoldsDocuments()
        router.update_replicas([_Replica("r1", max_ongoing_requests=2), _Replica("r2", max_ongoing_requests=1)])

        async def route(n: int) -> str:
            chosen = await asyncio.wait_for(router._choose_replica_for_request(_request(n, f"hello {n}")), 5.0)
            return chosen.replica_id.unique_id

        assert [await route(1), await route(2)] == ["r1", "r1"]
        assert await route(3) == "r2" and router.full_passed == 1
        assert await route(4) == "r1" and router.full_passed == 1  # every replica full: the policy's choice
        for done in ("i1", "i2"):
            router.on_request_completed(ReplicaID("r1", DEPLOYMENT), done)
        assert await route(5) == "r1" and router.full_passed == 2  # r2 still full, r1 has room
        assert router.in_flight == {"r1": 2, "r2": 1} and router.stats()["asked_again"] == 0

    asyncio.run(scenario())
