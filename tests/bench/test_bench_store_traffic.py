"""`tiered-cache bench store-traffic`: its workload and checks in-process, and a short real run through the
CLI against a real store server small enough to evict."""

from __future__ import annotations

import json
import random
from collections import Counter

import grpc
import pytest
from conftest import run_cli

from tiered_cache.bench.store_traffic.client import compare_pages, error_kind
from tiered_cache.bench.store_traffic.rss import plateau, read_rss
from tiered_cache.bench.store_traffic.workload import Conversations, PagePayloads, Workload, Zipf
from tiered_cache.wire.codec import verify_blob
from tiered_cache.wire.deadline import StreamStalled

SMALL = Workload(page_kib=4, prompts=4, histories=4, max_turns=3, seed=7)


def test_zipf_favours_low_ranks():
    rng, zipf = random.Random(0), Zipf(8, 1.1)
    counts = Counter(zipf.sample(rng) for _ in range(20000))
    assert set(counts) == set(range(8))
    assert counts[0] > 1.8 * counts[1] and counts[1] > 3 * counts[7]  # weights 1, 1/2^1.1, 1/8^1.1


def test_conversations_chain_page_keys_from_shared_prompts():
    prompts = SMALL.prompt_keys()
    assert [len(p) for p in prompts] == [len(SMALL.prompt_tokens(i)) // 16 for i in range(4)]
    assert prompts == SMALL.prompt_keys() and prompts != Workload(page_kib=4, prompts=4, seed=8).prompt_keys()
    convs = Conversations(SMALL, 0, prompts)
    seen: list[list[bytes]] = []
    for _ in range(40):
        request = convs.next_request()
        assert 1 <= request.new_pages <= 4
        history = request.keys[:-request.new_pages]
        assert history in prompts or history in seen  # a first turn on a shared prompt, or the next turn
        seen.append(request.keys)
    assert all(any(s[:len(p)] == p for p in prompts) for s in seen)  # each opens with a shared prompt
    other = Conversations(SMALL, 1, prompts).next_request()
    assert not set(other.keys[-other.new_pages:]) & {k for s in seen for k in s}  # new pages are the client's own
    made = {k for s in seen for k in s} - {k for p in prompts for k in p}
    assert convs.new_pages == len(made)


def test_every_blob_is_a_function_of_its_key():
    payloads, keys = PagePayloads(SMALL), SMALL.prompt_keys()[0]
    assert payloads.blob(keys[0]) == PagePayloads(SMALL).blob(keys[0])  # another process computes the same
    assert payloads.blob(keys[0]) != payloads.blob(keys[1])
    assert verify_blob(payloads.blob(keys[1]), keys[1]).key == keys[1]
    assert len(payloads.blob(keys[0])) > SMALL.spec.bytes_per_page == 4096


def test_compare_pages_counts_wrong_bytes_and_the_leading_hit():
    payloads, keys = PagePayloads(SMALL), SMALL.prompt_keys()[1][:4]
    good = [(k, payloads.blob(k)) for k in keys]
    assert compare_pages(keys, good, payloads.blob) == (4, 0)
    assert compare_pages(keys, good[:1] + good[2:], payloads.blob) == (1, 0)  # page 1 evicted: 1 loadable
    flipped = bytearray(good[2][1])
    flipped[100] ^= 1
    assert compare_pages(keys, [*good[:2], (keys[2], bytes(flipped)), good[3]], payloads.blob) == (2, 1)
    assert compare_pages(keys, [good[1], good[0]], payloads.blob) == (0, 1)  # out of order
    assert compare_pages(keys[:2], [good[0], good[2]], payloads.blob) == (1, 1)  # a key not asked for


def test_error_kinds_are_grpc_status_names():
    assert error_kind(StreamStalled("Get", 1.0)) == "stalled"

    class Unavailable(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

    assert error_kind(Unavailable()) == "UNAVAILABLE"
    assert error_kind(ValueError("x")) == "ValueError"


def test_plateau_compares_the_last_third_with_the_middle():
    mib = 2**20
    flat = [(t, 100 * mib + (t < 3) * -50 * mib) for t in range(10)]
    verdict = plateau(flat, 0, 9)
    assert verdict and (verdict.middle_max, verdict.last_max, verdict.levelled_off) == (100 * mib, 100 * mib, True)
    growing = plateau([(t, (100 + 10 * t) * mib) for t in range(10)], 0, 9)
    assert growing and (growing.growth, growing.peak_growth) == (35 * mib, 40 * mib) and not growing.levelled_off
    # One brief peak in the last third (a long prompt's activations, given back) is not growth.
    spike = plateau([(t, (100 + 400 * (t == 7)) * mib) for t in range(10)], 0, 9)
    assert spike and spike.levelled_off and spike.growth == 0 and spike.peak_growth == 400 * mib
    assert plateau([(0, mib)], 0, 9) is None
    assert read_rss(-1) is None


def test_bench_store_traffic_smoke_through_the_cli(tmp_path):
    png = tmp_path / "store-traffic.png"
    result = run_cli("bench", "store-traffic", "--clients", "2", "--duration-s", "3", "--ram", "2MiB",
                     "--page-kib", "4", "--prompts", "4", "--plot", str(png), "--json")
    data = json.loads(result.stdout)
    assert [o["op"] for o in data["ops"]] == ["lookup", "get", "put"]
    assert all(o["calls"] > 0 and 0 < o["p50_ms"] <= o["p99_ms"] <= o["p999_ms"] for o in data["ops"])
    assert data["errors"] == {} and data["wrong_bytes"] == 0
    assert data["pages_compared"] > 0 and data["pages_put"] > 0
    ram = next(t for t in data["tiers"] if t["name"] == "ram")
    assert ram["capacity"] == 2 * 2**20 and ram["used"] <= ram["capacity"] and ram["evictions"] > 0
    assert data["distinct_pages"] * data["blob_bytes"] > ram["capacity"]  # the mix made more than RAM holds
    assert len(data["rss"]) >= 4 and all(0 < rss < 2**30 for _, rss in data["rss"])
    assert data["plateau"] is not None and data["plateau"]["middle_max"] > 0
    assert data["baseline"]["calls"] > 0 and data["baseline"]["p50_ms"] > 0  # the same-run floor ran
    assert {r["baseline_name"] for r in data["comparisons"]} >= {"1-key Lookups/s", "1-key Lookup p99"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mix" in result.stderr or "starting 2 client processes" in result.stderr


def test_bench_store_traffic_refuses_bad_settings():
    with pytest.raises(ValueError, match="must be positive"):
        Workload(prompts=0)
    refused = run_cli("bench", "store-traffic", "--clients", "0", check=False)
    assert refused.returncode != 0 and "--clients, --duration-s and --timeout-s must be positive" in refused.stderr
    old = run_cli("bench", "load", "--clients", "0", check=False)  # the old name still runs, saying the new one
    assert old.returncode != 0 and "`bench load` is now `bench store-traffic`" in old.stderr


def test_chat_conversations_share_prefixes_and_every_client_makes_the_same_prompts_again():
    from tiered_cache.bench.store_traffic.chat import ChatConversations, ChatWorkload

    chat = ChatWorkload(SMALL)
    assert len(chat.system_prompts) == SMALL.prompts and len(set(chat.system_prompts)) == SMALL.prompts
    one, again = ChatConversations(chat, 0), ChatConversations(ChatWorkload(SMALL), 0)
    prompts = [one.next_prompt() for _ in range(40)]
    assert prompts == [again.next_prompt() for _ in range(40)]  # seeded: a rerun asks the same
    assert prompts != [ChatConversations(chat, 1).next_prompt() for _ in range(40)]
    assert all(any(p.startswith(s) for s in chat.system_prompts) for p in prompts)
    # A later turn extends an earlier prompt of the same conversation: its prefix is cached.
    assert any(b.startswith(a) and len(b) > len(a) for a in prompts for b in prompts)
    assert max(p.count("Question:") for p in prompts) <= SMALL.max_turns


def _chat_report(phase: str, answers: dict[str, tuple[int, ...]], repeats: int = 0, conflicts: int = 0):
    from tiered_cache.bench.store_traffic.ray_client import ChatReport

    return ChatReport(phase, answers=dict(answers), repeats=repeats, conflicts=conflicts)


def test_every_answer_is_checked_against_the_recompute_answer_for_its_prompt():
    from tiered_cache.bench.store_traffic.report import check_answers

    recompute = _chat_report("recompute", {"a": (1, 2), "b": (3, 4)})
    right = _chat_report("cache", {"a": (1, 2), "b": (3, 4), "c": (5,)}, repeats=3)
    assert check_answers([recompute, right], {"c": (5,)}) == check_answers([recompute, right], {"c": (5,)})
    ok = check_answers([recompute, right], {"c": (5,)})
    assert (ok.prompts, ok.answers_compared, ok.recomputed, ok.wrong) == (3, 6, 3, 0)
    wrong = _chat_report("cache", {"a": (1, 9), "c": (6,), "d": (7,)}, repeats=1, conflicts=1)
    bad = check_answers([recompute, right, wrong], {"c": (5,)})
    # a: wrong vs recompute; c: wrong vs its recompute; d: no reference, first answer; 1 own conflict.
    assert (bad.answers_compared, bad.wrong) == (6 + 1 + 2, 3)
    # Without a recompute, two clients' answers for one prompt are compared with each other.
    split = check_answers([_chat_report("cache", {"x": (1,)}), _chat_report("cache", {"x": (2,)})], {})
    assert (split.answers_compared, split.wrong, split.recomputed) == (1, 1, 0)


def test_bench_store_traffic_ray_refuses_bad_settings_before_starting_anything():
    from tiered_cache.bench.store_traffic.through_ray import RayTrafficSettings

    with pytest.raises(ValueError, match="--clients, --workers and --max-new-tokens must be positive"):
        RayTrafficSettings(SMALL, workers=0)
    with pytest.raises(ValueError, match="size"):
        RayTrafficSettings(SMALL, worker_pool="lots")
    refused = run_cli("bench", "store-traffic", "--ray", "--server-pid", "1", check=False)
    assert refused.returncode != 0 and "drop --server-pid" in refused.stderr
