"""The event router's policy (Ray-free) over real caches publishing real KV events: it keys a
prompt as the workers do (SmolLM2's tokenizer and chat template, their namespace and model), sends
it to the worker whose device holds it, weighs host RAM, the store, recompute and a worker's
queue by expected TTFT, learns a restarted cache from the replay, and falls back to the prefix
policy, counting it, when a worker's events stop."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("zmq")

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.integrations.hf_models import encode_prompt, load_tokenizer
from tiered_cache.model.spec import KVSpec
from tiered_cache.workers.routing import PrefixAwarePolicy
from tiered_cache.workers.routing.event_index import ClusterEvents
from tiered_cache.workers.routing.event_policy import ArrivalRate, EventRoutingPolicy

SPEC = KVSpec("event-routing-test", 2, 1, 8, page_size=16)
DOCS = [f"Document {d}: " + " ".join(f"word{d}x{i}" for i in range(120)) for d in range(3)]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


def _cache(**config) -> TieredCache:
    return TieredCache(SPEC, CacheConfig(pool_capacity="1MiB", kv_events_endpoint="tcp://127.0.0.1:0", **config))


def _info(cache: TieredCache, namespace: str = "") -> dict:
    publisher = cache.events.publisher
    return {"address": f"{publisher.endpoint} {publisher.replay_endpoint} x", "model": "smollm2",
            "fingerprint": SPEC.fingerprint, "namespace": namespace, "page_size": SPEC.page_size}


def _prefill(cache: TieredCache, tokenizer, text: str, namespace: str | None = None) -> int:
    ids = encode_prompt(tokenizer, text)
    cache.put(ids, torch.randn(SPEC.kv_shape(len(ids))).half(), namespace=namespace)
    return len(ids)


def _policy(stale_after_s: float = 3.0, batching: bool = False) -> EventRoutingPolicy:
    return EventRoutingPolicy(PrefixAwarePolicy(), ClusterEvents(stale_after_s), batching=batching)


def _until(predicate, what: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def _join(policy: EventRoutingPolicy, a: TieredCache, b: TieredCache) -> None:
    for name, cache in (("a", a), ("b", b)):
        policy.add_worker(name)
        policy.join(name, _info(cache))


def _pages(policy: EventRoutingPolicy, worker: str) -> int:
    return policy.events.stats()[worker]["pages"]


def test_a_prompt_goes_to_the_worker_whose_device_holds_it(tokenizer):
    with _cache() as a, _cache() as b:
        policy = _policy()
        try:
            _join(policy, a, b)
            _prefill(a, tokenizer, DOCS[0])
            n = _prefill(b, tokenizer, DOCS[1])
            _until(lambda: _pages(policy, "a") and _pages(policy, "b"), "both workers' events")
            loads = {"a": 0, "b": 0}
            first = policy.choose(DOCS[0], loads, DOCS[0])
            second = policy.choose(DOCS[1], loads, DOCS[1])
            assert (first.worker, first.reason) == ("a", "events") and (second.worker, second.reason) == ("b", "events")
            # The cached tokens it expects there, counted as tokens.
            assert second.matched == n // SPEC.page_size * SPEC.page_size and second.unit == "tokens"
            assert second.expected == (second.matched, 0, 0)  # all of them on b's device
            # Every worker weighed, the chosen one first: a's device holds only the chat template's
            # opening page of it, so its own TTFT there is nearly a whole prefill, more than b's.
            chosen, passed_over = second.considered
            assert (chosen.worker, chosen.expected) == ("b", second.expected) and passed_over.worker == "a"
            assert passed_over.expected[0] <= SPEC.page_size < chosen.expected[0]
            assert passed_over.ttft_s > chosen.ttft_s
            assert passed_over.score_s >= chosen.score_s and chosen.wait_s == second.wait_s
            # Evicted to host RAM, a prompt still goes where it is cheapest to load: a's host, not b's recompute.
            a.evict()
            _until(lambda: policy.events.holdings("a", _keys(tokenizer, DOCS[0])).host, "a's host pages")
            assert policy.choose(DOCS[0], loads, DOCS[0]).worker == "a"
            # A busy worker's queue costs more than recomputing on an idle one.
            assert policy.choose(DOCS[0], {"a": 12, "b": 0}, DOCS[0]).worker == "b"
            assert policy.fallbacks == 0
        finally:
            policy.close()


def _keys(tokenizer, text: str, namespace: str = "") -> list[bytes]:
    from tiered_cache.index.keys import PageKeyer

    return PageKeyer(SPEC, namespace).keys(encode_prompt(tokenizer, text))


def test_another_namespace_s_pages_do_not_count(tokenizer):
    with _cache(namespace="tenant-a") as a, _cache() as b:
        policy = _policy()
        try:
            policy.join("a", _info(a, "tenant-a"))
            policy.join("b", _info(b))
            _prefill(b, tokenizer, DOCS[2])
            _prefill(a, tokenizer, DOCS[2])  # the same text, in a's namespace
            _until(lambda: _pages(policy, "a") and _pages(policy, "b"), "both workers' events")
            held = policy.events.holdings("a", _keys(tokenizer, DOCS[2]))
            assert held.device == 0  # keyed in b's namespace, a holds none of it
            assert policy.events.holdings("a", _keys(tokenizer, DOCS[2], "tenant-a")).device > 0
        finally:
            policy.close()


def test_a_request_under_a_cache_salt_counts_only_the_pages_under_it(tokenizer):
    """vLLM's cache salt is the connector's namespace for that request: the router keys the prompt
    under it, so pages another tenant (or no salt) left count for nothing."""
    with _cache() as a, _cache() as b:
        policy = _policy()
        try:
            _join(policy, a, b)
            _prefill(a, tokenizer, DOCS[2], namespace="salt-x")
            _until(lambda: _pages(policy, "a"), "a's events")
            loads = {"a": 0, "b": 0}
            under = policy.choose(DOCS[2], loads, DOCS[2], namespace="salt-x")
            assert under.worker == "a" and under.expected[0] == under.matched > 0
            for other in (None, "salt-y"):
                assert policy.choose(DOCS[2], loads, DOCS[2], namespace=other).matched == 0
        finally:
            policy.close()


def _ready(policy: EventRoutingPolicy, a, b) -> None:
    """`policy` joined to `a` and `b`, both workers' events fresh."""
    _join(policy, a, b)
    _until(lambda: policy.events.fresh("a") and policy.events.fresh("b"), "both workers' heartbeats")


@pytest.mark.parametrize("batching", [False, True])
def test_a_batching_engine_holds_a_request_up_only_with_the_prefills_ahead_of_it(tokenizer, batching):
    """One at a time (our HF workers), a request waits for the whole of every request sent there
    before it. A batching engine (vLLM) runs it beside the others' decoding: it waits for the
    prefills ahead only, each until its first token."""
    with _cache() as a, _cache() as b:
        policy = _policy(batching=batching)
        try:
            _ready(policy, a, b)
            first = policy.choose(DOCS[1], {"a": 0, "b": 0}, DOCS[1])
            busy = {first.worker: 1, ("b" if first.worker == "a" else "a"): 0}
            question = DOCS[1] + " A question?"
            second = policy.choose(question, busy, question)
            assert second.worker == first.worker and second.wait_s > 0.5  # behind the document's prefill
            policy.finished(second.worker, second)
            policy.first_token(first.worker, first)
            third = policy.choose(question, busy, question)
            assert third.worker == first.worker and (third.wait_s == 0) == batching
            for done in (first, third):
                policy.finished(done.worker, done)
            idle = {first.worker: 0, ("b" if first.worker == "a" else "a"): 0}
            assert policy.choose(question, idle, question).wait_s == 0  # nothing ahead any more
        finally:
            policy.close()


def test_the_wait_behind_a_prefill_shrinks_as_it_runs_and_an_overdue_one_still_counts_a_share(tokenizer):
    """What has run since a prefill was sent is not waited for again: a request behind it waits
    until it was expected to end. Past that (the worker slower than the rates say) how much is
    left cannot be told: it counts a share of its cost, not nothing and not all of it."""
    with _cache() as a, _cache() as b:
        policy = _policy(batching=True)
        try:
            _ready(policy, a, b)
            doc = DOCS[2] * 4
            policy.estimate.prefill_s_per_token = 1.0 / len(encode_prompt(tokenizer, doc))  # its prefill: ~1 s
            first = policy.choose(doc, {"a": 0, "b": 0}, doc)
            cost = first.considered[0].ttft_s - first.wait_s
            loads = {"a": 0, "b": 0, first.worker: 1}

            def wait_there() -> float:
                question = doc + " A question?"
                decision = policy.choose(question, loads, question)
                policy.finished(decision.worker, decision)  # only the document's prefill stays ahead
                return next(c.wait_s for c in decision.considered if c.worker == first.worker)

            time.sleep(0.3)
            assert 0 < wait_there() <= cost - 0.3  # less the time it has run
            time.sleep(cost)
            assert wait_there() == pytest.approx(0.25 * cost)  # overdue: a share of it
            policy.first_token(first.worker, first)
            assert wait_there() == 0  # its first token came: nothing ahead
        finally:
            policy.close()


def _piled(policy: EventRoutingPolicy, doc: str) -> tuple:
    """A new document sent to a worker of two ("a", "b", both idle), and three questions on it
    that wait for it there: (its decision, the workers' loads, the questions' decisions)."""
    first = policy.choose(doc, {"a": 0, "b": 0}, doc)
    loads = {"a": 0, "b": 0, first.worker: 1}
    piled = []
    for i in range(3):  # the first questions wait for the document where it is computed
        question = f"{doc} Question {i}?"
        piled.append(policy.choose(question, loads, question))
        assert piled[-1].worker == first.worker
        loads[first.worker] += 1
    return first, loads, piled


def test_a_question_on_a_document_being_computed_waits_for_the_store_on_the_idle_worker(tokenizer):
    """Engines that write what they compute through to the store (vLLM with our connector): a
    question on a document whose prefill is under way on a worker with questions piled behind it
    goes to the idle worker, held back until the document's pages land in the store (then loaded
    there), rather than piled on too or computed a second time. Without write-through it is
    never held."""
    with _cache() as a, _cache() as b:
        policy = _policy(batching=True)
        try:
            _ready(policy, a, b)
            doc = DOCS[2] * 4
            first, loads, _ = _piled(policy, doc)
            holder, idle = first.worker, "b" if first.worker == "a" else "a"
            question = f"{doc} Question 9?"
            assert policy.choose(question, loads, question, hold=False).hold_s == 0  # the caller says: never
            policy.store_follows = True
            held = policy.choose(question, loads, question)
            assert (held.worker, held.reason) == (idle, "events") and held.hold_s > 0 and policy.holds == 1
            assert held.expected[2] >= len(encode_prompt(tokenizer, doc)) - 2 * SPEC.page_size  # from the store
            assert held.awaits == (holder, first.ticket) and policy.source_ended(held) is None  # still computing
            assert not policy.landed(held)  # nothing in the store yet
            # A held request brings its pages nowhere until they land: the next question does not
            # expect them on the idle worker's device (it would compute them there unheld).
            question = f"{doc} Question 10?"
            after = policy.choose(question, {**loads, idle: 1}, question)
            assert after.worker == holder or (after.awaits, after.expected[0]) == (held.awaits, 0)
            policy.first_token(holder, first)
            assert policy.source_ended(held) is not None  # computed: its pages are on their way
            # The holder's engine computed the document and wrote it through: the store holds it.
            (a if holder == "a" else b).events.chain_changed(_keys(tokenizer, doc), True)
            _until(lambda: policy.landed(held), "the document's pages in the store")
        finally:
            policy.close()


def test_a_request_held_for_the_store_is_not_ahead_of_new_work_there_but_waits_for_it(tokenizer):
    """A question held in the router for a document the busy worker is computing is not in the idle
    worker's engine yet: a short request sent there waits for nothing, and a new document sent
    there would run first and the question, let in as the document lands, would wait for its
    whole prefill. Under load, a new document longer than the busy worker's prefill left goes
    to the busy worker (it waits no longer than it takes), not to the idle one's engine ahead of
    the held question."""
    with _cache() as a, _cache() as b:
        arrivals = ArrivalRate()
        policy = EventRoutingPolicy(PrefixAwarePolicy(), ClusterEvents(3.0), batching=True, arrivals=arrivals)
        try:
            _ready(policy, a, b)
            doc = DOCS[2] * 4
            first, loads, piled = _piled(policy, doc)
            holder, idle = first.worker, "b" if first.worker == "a" else "a"
            policy.store_follows = True
            now = time.monotonic()
            for i in range(31):  # ten a second lately
                arrivals.record(now - 3.1 + i / 10)
            question = f"{doc} Question 9?"
            held = policy.choose(question, loads, question)
            assert held.worker == idle and held.hold_s > 0
            loads[idle] += 1
            short = policy.choose("Hi", loads, "Hi")
            assert short.worker == idle and short.wait_s == 0  # nothing in that engine ahead of it
            policy.finished(idle, short)
            for decision in piled:  # say they got their first tokens already: only the document prefills there
                policy.first_token(holder, decision)
            longer = policy.choose(DOCS[0] * 6, loads, DOCS[0] * 6)
            assert longer.worker == holder, longer.considered
        finally:
            policy.close()


def test_requests_held_for_pages_that_land_after_new_work_would_end_do_not_keep_it_off_their_worker(tokenizer):
    """Three questions are held for a document the busy worker computes for 10 s more; they will
    go into the idle worker's engine when it lands. A new, shorter document sent to the idle
    worker ends before that: they wait for none of it, so it goes there, not behind the busy
    worker's 10 s. (Counted as if they waited for all of it, the idle worker looked dearer.)"""
    with _cache() as a, _cache() as b:
        policy = _policy(batching=True)
        try:
            _ready(policy, a, b)
            doc, new = DOCS[2] * 4, DOCS[0] * 2
            policy.estimate.prefill_s_per_token = 10.0 / len(encode_prompt(tokenizer, doc))  # its prefill: ~10 s
            assert policy.estimate.compute_s(len(encode_prompt(tokenizer, new)), 0) < 6.0
            first, loads, piled = _piled(policy, doc)
            holder, idle = first.worker, "b" if first.worker == "a" else "a"
            policy.store_follows = True
            for i in range(3):
                question = f"{doc} Question {10 + i}?"
                held = policy.choose(question, loads, question)
                assert held.worker == idle and held.hold_s > 0
                loads[idle] += 1
            for decision in piled:  # only the document prefills on the busy worker
                policy.first_token(holder, decision)
            assert policy.choose(new, loads, new).worker == idle
        finally:
            policy.close()


def test_on_a_loaded_cluster_a_long_prefill_goes_where_long_work_is_and_a_short_one_to_the_free_worker(tokenizer):
    """Batching engines under load: a request arriving while every worker prefills waits for the
    first to finish. Quiet, a new long prompt takes the free worker; arriving ten a second, it
    queues behind the long work already under way (shorter than itself: it waits no longer than it
    takes) and the free worker stays free for the short requests, which go there."""
    with _cache() as a, _cache() as b:
        arrivals = ArrivalRate()
        policy = EventRoutingPolicy(PrefixAwarePolicy(), ClusterEvents(3.0), batching=True, arrivals=arrivals)
        try:
            _ready(policy, a, b)
            long = [DOCS[d] * n for d, n in enumerate((3, 4, 5))]  # the third longer than the work ahead
            first = policy.choose(long[0], {"a": 0, "b": 0}, long[0])
            free = "b" if first.worker == "a" else "a"
            loads = {first.worker: 1, free: 0}
            quiet = policy.choose(long[1], loads, long[1])
            assert quiet.worker == free and policy.stats()["arrivals_per_s"] == 0  # too few arrivals to tell
            policy.finished(quiet.worker, quiet)
            now = time.monotonic()
            for i in range(31):
                arrivals.record(now - 3.1 + i / 10)
            busy = policy.choose(long[2], loads, long[2])
            assert busy.worker == first.worker and busy.wait_s > 0
            assert policy.stats()["arrivals_per_s"] > 5
            short = policy.choose("Hi", loads, "Hi")
            assert short.worker == free and short.wait_s == 0
            # Behind more work than it takes itself, a long prompt takes the free worker after all.
            again = long[1] + " Once more."
            assert policy.choose(again, {first.worker: 2, free: 1}, again).worker == free
        finally:
            policy.close()


def test_a_new_document_goes_to_the_free_worker_rather_than_behind_a_prefill_as_long_as_its_own(tokenizer):
    """Requests arriving steadily, one worker prefilling a new document, the other only decoding:
    a second new document of the same length waits the first's whole prefill on the busy worker,
    or keeps the free one busy as long for whoever arrives next. Those two weigh the same; its own
    wait is certain, the others' expected: it takes the free worker."""
    with _cache() as a, _cache() as b:
        arrivals = ArrivalRate()
        policy = EventRoutingPolicy(PrefixAwarePolicy(), ClusterEvents(3.0), batching=True, arrivals=arrivals)
        try:
            _ready(policy, a, b)
            now = time.monotonic()
            for i in range(20):  # 1.5 a second lately
                arrivals.record(now - 19 / 1.5 + i / 1.5)
            first_doc, second_doc = list(range(1000, 2000)), list(range(3000, 4000))  # token ids, as engines take
            first = policy.choose("first", {"a": 0, "b": 0}, first_doc)
            free = "b" if first.worker == "a" else "a"
            chat = policy.choose("Hi", {first.worker: 1, free: 0}, "Hi")
            assert chat.worker == free
            policy.first_token(free, chat)  # decoding now: nothing ahead of a prefill there
            second = policy.choose("second", {"a": 1, "b": 1}, second_doc)
            assert second.worker == free and second.wait_s == 0
        finally:
            policy.close()


def test_a_batching_engine_s_waiting_prefills_are_not_held_up_by_a_long_one_that_can_go_elsewhere(tokenizer):
    """vLLM prefills the requests waiting on it together: a short prompt waiting behind a long
    prefill would get its first token only when a long prompt sent after it is prefilled too.
    The long one goes to the worker where nothing waits, though it is busy a little longer."""
    with _cache() as a, _cache() as b:
        policy = EventRoutingPolicy(PrefixAwarePolicy(), ClusterEvents(3.0), batching=True,
                                    arrivals=ArrivalRate(least=1000))  # no rate: only those waiting count
        try:
            _ready(policy, a, b)
            first = policy.choose(DOCS[0] * 2, {"a": 0, "b": 0}, DOCS[0] * 2)
            free = "b" if first.worker == "a" else "a"
            longer = policy.choose(DOCS[1] * 3, {first.worker: 1, free: 0}, DOCS[1] * 3)
            short = policy.choose("Hi", {first.worker: 1, free: 1}, "Hi")
            assert (longer.worker, short.worker) == (free, first.worker)  # the short one waits least there
            late = policy.choose(DOCS[2] * 2, {first.worker: 2, free: 1}, DOCS[2] * 2)
            assert late.worker == free and late.wait_s > short.wait_s
        finally:
            policy.close()


def test_a_router_that_starts_late_learns_from_the_replay_and_one_whose_events_stop_falls_back(tokenizer):
    a, b = _cache(), _cache()
    try:
        _prefill(a, tokenizer, DOCS[0])  # before any router
        policy = _policy(stale_after_s=1.5)
        try:
            _join(policy, a, b)
            _until(lambda: _pages(policy, "a") and policy.events.fresh("b"), "a's pages from the replay")
            assert policy.choose(DOCS[0], {"a": 0, "b": 0}, DOCS[0]).worker == "a" and policy.fallbacks == 0
            a.close()  # its events stop: cleared, then no heartbeat
            _until(lambda: not policy.events.fresh("a"), "a's events to go stale")
            decision = policy.choose(DOCS[0], {"a": 0, "b": 0}, DOCS[0])
            assert decision.reason != "events" and policy.fallbacks == 1
            assert policy.stats()["sources"]["a"]["fresh"] is False
        finally:
            policy.close()
    finally:
        a.close()
        b.close()


def test_answers_teach_the_estimate():
    """Recomputed answers teach the prefill rate; answers found on the device what a cached token
    costs against a computed one (the rest of the prompt attends over it); answers from the store
    the load per token on top of that."""
    from tiered_cache.workers.routing.ttft_estimate import TTFTEstimate

    estimate = TTFTEstimate()
    on_device = 20 / 500 + 480 * 0.25 / 500  # 20 tokens computed, 480 cached at a quarter of the cost
    from_store = on_device + 480 * 1e-4  # and each loaded from the store in 0.1 ms
    for _ in range(30):
        estimate.observe({"ttft_s": 1.0, "prompt_tokens": 500, "reused_tokens": 0, "sources": {}}, 1.2)
        estimate.observe({"ttft_s": on_device, "prompt_tokens": 500, "reused_tokens": 480, "sources": {}}, 0.4)
        estimate.observe({"ttft_s": from_store, "prompt_tokens": 500, "reused_tokens": 480,
                          "sources": {"remote": 480}}, 0.5)
    assert estimate.prefill_s_per_token == pytest.approx(1.0 / 500, rel=0.05)
    assert estimate.cached_share == pytest.approx(0.25, rel=0.1)
    assert estimate.store_s_per_token == pytest.approx(1e-4, rel=0.1)
    assert estimate.seconds(500, 480, 0, 0) == pytest.approx(on_device, rel=0.1)
    assert estimate.seconds(500, 0, 0, 480) == pytest.approx(from_store, rel=0.1)
    # Wherever the cached tokens were, they cost less than recomputing them, and the store's load on top.
    assert estimate.seconds(500, 480, 0, 0) < estimate.seconds(500, 0, 0, 480) < estimate.seconds(500, 0, 0, 0)


def test_the_first_answers_replace_the_priors_and_later_ones_move_them_a_step():
    """The priors are a guess: a router on hardware four times slower than they say prices a
    prefill from its first answer on as that answer took, not a fifth of the way there; once it
    has seen enough, one odd answer moves the rate a step, not all the way. An answer that waited
    behind others (its wait taken out as the router expected it) moves a rate a step only."""
    from tiered_cache.workers.routing.ttft_estimate import TTFTEstimate

    waited = TTFTEstimate()
    prior = waited.prefill_s_per_token
    waited.observe({"ttft_s": 500 * 4 * prior + 0.1, "prompt_tokens": 500, "reused_tokens": 0, "ahead_s": 0.1}, 5)
    assert prior < waited.prefill_s_per_token < 2 * prior
    estimate = TTFTEstimate()
    slow = 4 * estimate.prefill_s_per_token
    estimate.observe({"ttft_s": 500 * slow, "prompt_tokens": 500, "reused_tokens": 0}, 500 * slow + 0.5)
    assert estimate.prefill_s_per_token == pytest.approx(slow)
    assert estimate.decode_s == pytest.approx(0.5)
    for _ in range(10):
        estimate.observe({"ttft_s": 500 * slow, "prompt_tokens": 500, "reused_tokens": 0}, 500 * slow + 0.5)
    estimate.observe({"ttft_s": 500 * slow * 3, "prompt_tokens": 500, "reused_tokens": 0}, 500 * slow * 3 + 0.5)
    assert slow * 1.2 < estimate.prefill_s_per_token < slow * 2


def test_a_load_never_teaches_that_the_store_costs_more_than_recomputing():
    """An answer loaded from the store whose TTFT holds a wait the router did not expect (it queued
    behind a prefill it did not know of) would teach a store token dearer than a computed one,
    and keep the router off the store from then on: a load is taught as at most a recompute, so
    a replica that loads a prefix still never scores worse than one that recomputes it."""
    from tiered_cache.workers.routing.ttft_estimate import TTFTEstimate

    estimate = TTFTEstimate()
    estimate.observe({"ttft_s": 1.0, "prompt_tokens": 500, "reused_tokens": 0}, 1.2)  # 2 ms a token
    queued = {"ttft_s": 6.0, "prompt_tokens": 1500, "reused_tokens": 1480, "sources": {"remote": 1480}}
    estimate.observe(queued, 6.5)
    assert estimate.store_s_per_token <= (1 - estimate.cached_share) * estimate.prefill_s_per_token
    assert estimate.seconds(1500, 0, 0, 1480) <= estimate.seconds(1500, 0, 0, 0) * 1.0001
    quick = {"ttft_s": 0.3, "prompt_tokens": 1500, "reused_tokens": 1480, "sources": {"remote": 1480}}
    for _ in range(10):
        estimate.observe(quick, 0.8)  # loads as fast as they are teach as much
    assert estimate.seconds(1500, 0, 0, 1480) < 0.5 * estimate.seconds(1500, 0, 0, 0)


def test_loads_the_engines_timed_price_the_store_and_a_ttft_s_unexplained_rest_no_longer_does():
    """Store hits whose TTFTs hold a wait the router did not expect taught a store token nearly as
    dear as a computed one. Once the engines time their own loads (the connector's `load_seconds`
    over its blocks), the store costs what they timed: the first timed figure replaces what TTFTs
    taught, later ones move it, and store hits' TTFTs teach it nothing more."""
    from tiered_cache.workers.routing.ttft_estimate import TTFTEstimate

    estimate = TTFTEstimate()
    estimate.observe({"ttft_s": 1.0, "prompt_tokens": 500, "reused_tokens": 0}, 1.2)  # 2 ms a token
    queued = {"ttft_s": 2.5, "prompt_tokens": 1500, "reused_tokens": 1480, "sources": {"remote": 1480}}
    estimate.observe(queued, 3.0)
    assert estimate.store_s_per_token > 1e-3 and not estimate.store_timed  # taught by the queued TTFT
    estimate.loads_timed(0.02, 1024)  # 20 ms waited for 1,024 tokens loaded
    assert estimate.store_timed and estimate.store_s_per_token == pytest.approx(0.02 / 1024)
    for _ in range(5):
        estimate.observe(queued, 3.0)
    assert estimate.store_s_per_token == pytest.approx(0.02 / 1024)
    estimate.loads_timed(0.06, 1024)
    assert 0.02 / 1024 < estimate.store_s_per_token < 0.06 / 1024
    before = estimate.to_dict()
    estimate.loads_timed(0.01, 0)  # no tokens loaded in the interval: nothing to learn
    assert estimate.to_dict() == before
    assert estimate.seconds(1500, 0, 0, 1480) < 0.2 * estimate.seconds(1500, 0, 0, 0)


def test_the_engines_own_prefills_at_start_replace_the_prior_and_answers_go_on_teaching():
    """A loaded cluster's first routes are decided before any answer: each engine's prefill timed
    at its start is a sample of the prefill's rate (the first replaces the prior, the next are
    averaged in), and answers that waited behind no one go on being averaged with them."""
    from tiered_cache.workers.routing.ttft_estimate import TTFTEstimate

    estimate = TTFTEstimate()
    prior = estimate.seconds(1500, 0, 0, 0)
    estimate.prefill_timed(3.0, 500)  # 6 ms a token, three times the prior
    assert estimate.prefill_s_per_token == pytest.approx(6e-3) and estimate.prefill_probes == 1
    assert estimate.seconds(1500, 0, 0, 0) == pytest.approx(3 * prior)
    estimate.prefill_timed(2.0, 500)
    assert estimate.prefill_s_per_token == pytest.approx(5e-3)
    estimate.prefill_timed(0.0, 500)  # nothing timed: nothing learned
    estimate.prefill_timed(1.0, 0)
    assert estimate.prefill_s_per_token == pytest.approx(5e-3) and estimate.prefill_probes == 2
    estimate.observe({"ttft_s": 4.0, "prompt_tokens": 1000, "reused_tokens": 0}, 4.5)  # 4 ms a token
    assert estimate.prefill_s_per_token == pytest.approx((6e-3 + 4e-3 + 4e-3) / 3)
    assert estimate.to_dict()["prefill_probes"] == 2
    # The same prompt again with 960 of its 1,000 tokens cached: what it took beyond its 40 new
    # tokens is what the cached ones cost (here 3% of computing them); the prior (10%) is replaced.
    estimate.observe({"ttft_s": 1.0, "prompt_tokens": 1000, "reused_tokens": 960}, 1.5)  # untimed: taught
    assert estimate.cached_share > 0.1
    estimate.prefill_timed(2.0, 1000, hit_seconds=40 * 2e-3 + 0.03 * 960 * 2e-3, cached=960)
    assert estimate.cached_share == pytest.approx(0.03)
    estimate.prefill_timed(2.0, 1000, hit_seconds=0.01, cached=960)  # faster than its new tokens: none
    assert estimate.cached_share == pytest.approx(0.015)
    # A device hit's TTFT that held a wait no one expected teaches the share nothing now.
    estimate.observe({"ttft_s": 2.0, "prompt_tokens": 1000, "reused_tokens": 960}, 2.5)
    assert estimate.cached_share == pytest.approx(0.015) and estimate.to_dict()["share_timed"]


def test_an_engine_that_queues_inside_teaches_its_rates_without_the_wait():
    """vLLM's TTFT holds its wait behind other prefills: the router takes out the work it
    expected ahead, and a TTFT that was mostly waiting teaches no rate (it would teach queueing)."""
    from tiered_cache.workers.routing.ttft_estimate import TTFTEstimate

    estimate = TTFTEstimate()
    for _ in range(30):
        estimate.observe({"ttft_s": 1.1, "prompt_tokens": 500, "reused_tokens": 0, "ahead_s": 0.1}, 1.5)
        estimate.observe({"ttft_s": 9.0, "prompt_tokens": 500, "reused_tokens": 0, "ahead_s": 8.0}, 9.5)
    assert estimate.prefill_s_per_token == pytest.approx(1.0 / 500, rel=0.05)


def test_an_engine_that_tells_only_its_cached_total_still_teaches_the_store_s_cost():
    """vLLM says how many prompt tokens came from any cache: what it reused beyond the tokens the
    router expected on the device, up to those it expected in the store, came from the store."""
    from tiered_cache.workers.routing.ttft_estimate import TTFTEstimate, with_store_share

    answer = {"ttft_s": 0.3, "prompt_tokens": 1000, "reused_tokens": 896}
    assert with_store_share(answer, (512, 0, 384))["sources"] == {"remote": 384}
    assert with_store_share(answer, (896, 0, 0))["sources"] == {}  # all on the device: no load
    assert with_store_share({**answer, "reused_tokens": 600}, (512, 0, 384))["sources"] == {"remote": 88}
    assert with_store_share({**answer, "reused_tokens": 100}, (512, 0, 384))["sources"] == {}  # evicted meanwhile
    estimate = TTFTEstimate()
    attend = 896 * estimate.cached_share * 2e-3  # the cached tokens' share, as on the device
    for _ in range(30):
        estimate.observe(with_store_share({"ttft_s": 0.05 + 104 * 2e-3 + attend, "prompt_tokens": 1000,
                                           "reused_tokens": 896}, (0, 0, 896)), 0.5)
    assert estimate.store_s_per_token == pytest.approx(0.05 / 896, rel=0.1)


def test_a_prompt_already_on_its_way_to_a_worker_counts_as_cached_there(tokenizer):
    """Two questions on one new document at once: nothing is cached anywhere yet, but the second
    waits behind the first on the worker it went to and finds its pages there: not recomputed elsewhere."""
    with _cache() as a, _cache() as b:
        policy = _policy()
        try:
            _ready(policy, a, b)
            first = policy.choose(DOCS[1], {"a": 0, "b": 0}, DOCS[1])
            busy = {first.worker: 1, ("b" if first.worker == "a" else "a"): 0}
            second = policy.choose(DOCS[1] + " Another question?", busy, DOCS[1] + " Another question?")
            assert second.worker == first.worker and second.matched > 0
            policy.finished(first.worker, first)
            policy.finished(second.worker, second)
            # Answered, and no event says its pages are there (nothing was stored here): the idle worker then.
            third = policy.choose(DOCS[1], {first.worker: 1, ("b" if first.worker == "a" else "a"): 0}, DOCS[1])
            assert third.worker != first.worker
        finally:
            policy.close()


def test_a_deployments_first_request_routed_before_events_are_fresh_still_counts_as_on_its_way(tokenizer,
                                                                                               monkeypatch):
    """The first request of a deployment goes by the prefix policy (no heartbeat yet); a second
    question on its document then finds it coming on that worker, as for a decision of ours."""
    with _cache() as a, _cache() as b:
        policy = _policy()
        try:
            _ready(policy, a, b)
            with monkeypatch.context() as starting:  # the moment before the first heartbeats came
                starting.setattr(policy.events, "fresh", lambda worker: False)
                first = policy.choose(DOCS[1], {"a": 0, "b": 0}, DOCS[1])
            assert first.reason != "events" and policy.fallbacks == 1
            other = "b" if first.worker == "a" else "a"
            second = policy.choose(DOCS[1] + " Another question?", {first.worker: 1, other: 0},
                                   DOCS[1] + " Another question?")
            assert second.reason == "events" and second.worker == first.worker and second.matched > 0
            policy.finished(first.worker, first)
            policy.finished(second.worker, second)
            third = policy.choose(DOCS[1], {first.worker: 1, other: 0}, DOCS[1])  # nothing stored: the idle one
            assert third.worker == other
        finally:
            policy.close()


@pytest.mark.parametrize("share", [0.1, 0.0])
def test_questions_piling_on_a_documents_holder_spill_to_the_idle_worker(tokenizer, share):
    """A batching engine: questions on one new document arrive faster than its prefill ends. The
    first few wait for it on the worker computing it (they find it there), but each costs that
    worker a step over the whole document, and those piled there wait for each other: once the
    pile costs more than prefilling the document on the idle worker, a question goes there. A
    router that took cached pages as free (`cached_share` 0) piles every one up."""
    with _cache() as a, _cache() as b:
        policy = EventRoutingPolicy(PrefixAwarePolicy(), ClusterEvents(3.0), batching=True,
                                    arrivals=ArrivalRate(least=1000))
        policy.estimate.cached_share = share
        try:
            _ready(policy, a, b)
            doc = DOCS[2] * 4
            first = policy.choose(doc, {"a": 0, "b": 0}, doc)
            idle = "b" if first.worker == "a" else "a"
            loads = {first.worker: 1, idle: 0}
            went = []
            for i in range(16):
                question = f"{doc} Question {i}?"
                decision = policy.choose(question, loads, question)
                went.append(decision.worker)
                loads[decision.worker] += 1
                if decision.worker == idle:
                    break
            assert went[0] == first.worker  # the first waits for the document where it is computed
            assert (idle in went) == (share > 0), went
        finally:
            policy.close()
