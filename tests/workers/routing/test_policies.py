"""The router's prefix tree and policies (Ray-free), against brute force and by behaviour."""

from __future__ import annotations

import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_cache.workers.routing import Decision, PrefixAwarePolicy, RoundRobinPolicy, make_policy
from tiered_cache.workers.routing.prefix_tree import ApproxPrefixTree

WORKERS = ["w0", "w1", "w2"]
texts = st.text(alphabet="ab", min_size=0, max_size=12)


def common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=examples(150))
@given(st.lists(st.tuples(texts, st.sampled_from(WORKERS)), max_size=25), texts)
def test_matches_equal_the_brute_force_longest_common_prefix(inserts, query):
    tree = ApproxPrefixTree()
    for text, worker in inserts:
        tree.insert(text, worker)
    per_worker = {w: max((common(t, query) for t, x in inserts if x == w), default=0) for w in WORKERS}
    for worker in WORKERS:
        assert tree.matched_chars(query, worker) == per_worker[worker]
    worker, length = tree.longest_match(query)
    assert length == max(per_worker.values())
    if length:
        assert per_worker[worker] == length
    for worker in WORKERS:  # chars: the distinct prefixes' characters recorded per worker
        mine = {t[:i] for t, x in inserts if x == worker for i in range(1, len(t) + 1)}
        assert tree.chars(worker) == len(mine)


@settings(max_examples=examples(50))
@given(st.lists(st.tuples(texts, st.sampled_from(WORKERS)), min_size=1, max_size=30), st.integers(0, 20))
def test_eviction_keeps_each_worker_within_budget_and_the_newest_text_whole(inserts, budget):
    tree = ApproxPrefixTree()
    for text, worker in inserts:
        tree.insert(text, worker)
    last_text, last_worker = inserts[-1]
    tree.evict(budget)
    for worker in WORKERS:
        assert tree.chars(worker) <= budget
    if len(last_text) <= budget:
        assert tree.matched_chars(last_text, last_worker) == len(last_text)
    # What is left is still exact for what remains recorded: never more than was inserted.
    for worker in WORKERS:
        for text, _ in inserts:
            assert tree.matched_chars(text, worker) <= max(
                (common(t, text) for t, x in inserts if x == worker), default=0)


def test_remove_worker_forgets_all_of_it():
    tree = ApproxPrefixTree()
    tree.insert("shared document, question one", "a")
    tree.insert("shared document, question two", "b")
    tree.remove_worker("a")
    assert tree.matched_chars("shared document, question one", "a") == 0 and tree.chars("a") == 0
    assert tree.longest_match("shared document, question one") == ("b", len("shared document, question "))
    assert tree.workers() == ["b"]


def test_a_repeat_and_a_shared_document_go_where_the_prefix_is():
    policy = PrefixAwarePolicy()
    doc = "The lighthouse was built in 1870 by a Scottish engineer. " * 20
    loads = {"a": 0, "b": 0}
    first = policy.choose(doc + "When was it built?", loads)
    assert first.reason == "least_cached"
    again = policy.choose(doc + "When was it built?", loads)
    assert again == Decision(first.worker, "prefix", len(doc + "When was it built?"))
    other = policy.choose(doc + "Who built it?", loads)
    assert other.worker == first.worker and other.reason == "prefix"
    assert other.matched >= len(doc) and other.unit == "chars"


def test_new_documents_spread_over_workers():
    policy = PrefixAwarePolicy()
    loads = {"a": 0, "b": 0, "c": 0}
    chosen = [policy.choose(f"document {i}: " + "x" * (100 + i), loads).worker for i in range(3)]
    assert sorted(chosen) == ["a", "b", "c"]


def test_a_hot_prefix_under_heavy_imbalance_goes_to_the_least_loaded():
    policy = PrefixAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    prompt = "hot system prompt " * 30
    owner = policy.choose(prompt, {"a": 0, "b": 0}).worker
    idle = "b" if owner == "a" else "a"
    assert policy.choose(prompt, {owner: 3, idle: 0}).worker == owner  # within the thresholds: stays
    busy = policy.choose(prompt, {owner: 10, idle: 0})
    assert busy.worker == idle and busy.reason == "balance"


def test_only_live_workers_are_chosen_and_none_is_an_error():
    policy = PrefixAwarePolicy()
    policy.observe("gone", ["a prompt the gone worker held"])
    assert policy.choose("a prompt the gone worker held", {"alive": 0}).worker == "alive"
    for p in (policy, RoundRobinPolicy()):
        with pytest.raises(LookupError, match="no live workers"):
            p.choose("x", {})


def test_observe_seeds_the_tree_from_a_workers_summary():
    policy = PrefixAwarePolicy()
    policy.observe("b", ["document one, question one"])
    decision = policy.choose("document one, question two", {"a": 0, "b": 0})
    assert decision.worker == "b" and decision.reason == "prefix"


def test_round_robin_cycles_in_name_order():
    policy = make_policy("round_robin")
    picks = [policy.choose("same prompt", {"b": 0, "a": 0, "c": 9}).worker for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_make_policy_refuses_unknown_names_and_settings():
    with pytest.raises(ValueError, match="known: prefix, round_robin"):
        make_policy("random")
    with pytest.raises(ValueError, match="no settings"):
        make_policy("round_robin", cache_threshold=0.5)
    assert isinstance(make_policy("prefix", cache_threshold=0.9), PrefixAwarePolicy)
