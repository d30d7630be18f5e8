"""`tiered-cache bench gpu` on the CPU with the tiny shape: every row reuses the whole prefix from
the tier it names, the copy limit ran on the same bytes the load moved, and the first token's
logits match recomputation's. The same code runs the 8B shape on a GPU (scripts/gpu_check.sh)."""

from __future__ import annotations

import json
import shutil
from dataclasses import fields

import pytest
from conftest import run_cli_here as run_cli

from tiered_cache.bench.gpu_args import REUSE_ROWS
from tiered_cache.bench.gpu_fit import DoesNotFit, GiB, layers_that_fit
from tiered_cache.bench.gpu_model import model_config
from tiered_cache.model.hf_config import read_hf_config
from tiered_cache.model.presets import get_preset

TOKENS = (64, 256)
TIER = {"device": "device", "host": "host", "disk": "disk", "store": "remote", "store-noshm": "remote",
        "redis": "redis"}


def run_bench(state: str) -> dict:
    result = run_cli("bench", "gpu", "--model", "tiny", "--device", "cpu", "--tokens", ",".join(map(str, TOKENS)),
                     "--rounds", "2", "--state", state, "--json")
    assert "recompute 2/2" in result.stderr and "store 2/2" in result.stderr  # progress goes to stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def warm() -> dict:
    return run_bench("warm")


@pytest.fixture(scope="module")
def serving() -> dict:
    return run_bench("serving")


@pytest.fixture(params=["warm", "serving"])
def bench(request: pytest.FixtureRequest) -> dict:
    return request.getfixturevalue(request.param)


@pytest.mark.long  # a benchmark run, not the cache's correctness: make test-long
def test_every_reuse_row_reuses_the_whole_prefix_from_its_tier(bench):
    setup, rows = bench["setup"], bench["rows"]
    assert (setup["layers"], setup["total_layers"], setup["dtype"]) == (2, 2, "fp32")
    assert setup["pool_prefixes"] == (8 if setup["state"] == "serving" else 1)
    # What checks the pages (the store rows' rate may hang on it), as this process runs it.
    from tiered_cache.wire import checksum

    assert setup["checks"].startswith(f"CRC-32C by {checksum.IMPLEMENTATION} on {checksum.checker_threads()} threads")
    expected = [r for r in REUSE_ROWS if r != "redis" or shutil.which("redis-server")]
    assert [(r["tokens"], r["row"]) for r in rows] == [(n, row) for n in TOKENS for row in ["recompute", *expected]]
    for row in rows:
        n = row["tokens"]
        assert len(row["ttft_s"]) == 2 and min(row["ttft_s"]) > 0
        if row["row"] == "recompute":
            assert row["reused_tokens"] == [0, 0] and row["sources"] == [{}, {}] and row["load_s"] == []
            continue
        assert row["reused_tokens"] == [n, n], row
        assert row["sources"] == [{TIER[row["row"]]: n}] * 2, row


@pytest.mark.long  # a benchmark run, not the cache's correctness: make test-long
def test_each_load_is_timed_beside_a_copy_of_the_same_bytes(bench):
    page = bench["setup"]["bytes_per_page"]
    assert page == 16 * 2 * 2 * 2 * 16 * 4  # 16 tokens x 2 layers x K,V x 2 kv heads x 16 dims x fp32
    for row in bench["rows"]:
        if row["row"] == "recompute":
            continue
        kv = row["tokens"] // 16 * page
        assert row["limit_name"] == "memcpy" and row["limit_bytes"] == kv and row["limit_s"] > 0
        assert len(row["load_s"]) == 2 and min(row["load_s"]) > 0
        # Device hits move nothing; every other row moves the whole prefix into the pool.
        assert row["load_bytes"] == ([0, 0] if row["row"] == "device" else [kv, kv]), row
        assert (row["load_GBps"] is None) == (row["row"] == "device")


@pytest.mark.long  # a benchmark run, not the cache's correctness: make test-long
def test_first_token_matches_recompute(bench):
    for row in bench["rows"]:
        if row["row"] == "recompute":
            assert row["max_abs_diff"] is None and row["margin"] > 0
            continue
        # fp32 KV reused as it was computed: only the summation order differs (~1e-7 here).
        assert row["max_abs_diff"] < 1e-3, row
        # The greedy token may differ only where recompute's top two logits are closer than that.
        assert row["greedy_agrees"] or row["margin"] < 10 * row["max_abs_diff"], row


@pytest.mark.long  # a benchmark run, not the cache's correctness: make test-long
def test_the_table_names_each_rows_tier_and_flags_a_row_that_reused_less(bench):
    from tiered_cache.bench.gpu_rows import GpuRow
    from tiered_cache.bench.gpu_table import render

    names = {f.name for f in fields(GpuRow)}
    rows = [GpuRow(**{k: v for k, v in r.items() if k in names}) for r in bench["rows"]]
    table = render(bench["setup"], rows)
    assert "256 remote" in table and "256 host" in table and "no copy" in table and "!!" not in table
    rows[-1].sources[1] = {"host": 256}  # as if a round found the prefix above the tier it measures
    assert "UNEXPECTED" in render(bench["setup"], rows) and f"!! {rows[-1].row} at 256" in render(bench["setup"], rows)


def test_shipped_shapes_are_the_presets():
    for name in ("llama-3.1-8b", "llama-3-70b"):
        shipped, preset = read_hf_config(model_config(name)), get_preset(name).config
        for field in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size"):
            assert getattr(shipped, field) == getattr(preset, field), (name, field)
    tiny = read_hf_config(model_config("tiny"))
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_kv_heads, tiny.vocab_size) == (2, 64, 2, 512)


def test_a_model_is_cut_to_the_layers_that_fit():
    eight, seventy = model_config("llama-3.1-8b"), model_config("llama-3-70b")
    # An 80 GB card holds all of the 8B with 32k tokens of KV; the 70B's 140 GB of weights do not fit.
    assert layers_that_fit(eight, 79 * GiB, 32776) == 32
    # The serving state's pool of 8 such prefixes leaves room for fewer layers on that card, all on a 141 GB one.
    assert layers_that_fit(eight, 79 * GiB, 32776, pool_prefixes=8) < 32 == layers_that_fit(eight, 139 * GiB, 32776,
                                                                                             pool_prefixes=8)
    on_h100, on_h200 = layers_that_fit(seventy, 79 * GiB, 8200), layers_that_fit(seventy, 139 * GiB, 8200)
    assert 20 < on_h100 < on_h200 < 80
    assert layers_that_fit(seventy, 139 * GiB, 32776) < on_h200  # a longer prompt leaves room for fewer
    with pytest.raises(DoesNotFit, match="fewer --tokens"):
        layers_that_fit(seventy, 4 * GiB, 8200)


def test_bad_tokens_are_refused_before_anything_is_built():
    result = run_cli("bench", "gpu", "--model", "tiny", "--device", "cpu", "--tokens", "100", check=False)
    assert result.returncode != 0 and "multiples of the page size (16)" in result.stderr
    result = run_cli("bench", "gpu", "--model", "tiny", "--device", "cpu", "--pool-prefixes", "0", check=False)
    assert result.returncode != 0 and "--pool-prefixes must be at least 1, got 0" in result.stderr


@pytest.mark.long  # a benchmark run, not the cache's correctness: make test-long
def test_serving_loads_a_new_prefix_per_round_into_a_full_pool(serving, warm):
    """Each round moved the whole prefix into the pool (a prefix read before would be a device
    hit: see test_each_load_is_timed_beside_a_copy_of_the_same_bytes) and matched its own
    prompt's recomputed logits; the pool was at its watermarks as every load began, where the
    warm state's cache had room."""
    for row in serving["rows"]:
        if row["row"] in ("recompute", "device"):
            continue
        assert len(row["pool_full"]) == 2 and min(row["pool_full"]) >= 0.6, row
    assert all(max(r["pool_full"]) < 0.5 for r in warm["rows"] if r["row"] not in ("recompute", "device"))
    assert "in the serving state: each round a prefix the reading cache never read" in run_cli(
        "bench", "gpu", "--model", "tiny", "--device", "cpu", "--tokens", "32", "--rounds", "1", "--rows", "host",
        "--pool-prefixes", "2").stdout


@pytest.mark.long  # a benchmark run, not the cache's correctness: make test-long
def test_the_host_row_times_the_demotion_that_put_the_prefix_there_beside_a_copy_back(warm):
    bench = warm
    page = bench["setup"]["bytes_per_page"]
    for row in bench["rows"]:
        if row["row"] != "host":
            assert row["evict_bytes"] == 0 and row["evict_s"] == []
            continue
        # every page of the prefix was copied device -> host RAM in each measured round
        assert row["evict_bytes"] == row["tokens"] // 16 * page and len(row["evict_s"]) == 2
        assert min(row["evict_s"]) > 0 and row["evict_limit_s"] > 0 and row["evict_GBps"] > 0


@pytest.mark.long  # a benchmark run, not the cache's correctness: make test-long
def test_a_store_row_says_how_its_pages_came_from_the_arena(bench):
    """On CUDA a store row's pages are DMA'd from the arena (`ArenaCopier`), and each round records
    what that took; on a CPU pool they come by `get_into`, with no copier, so no figures here."""
    from tiered_cache.bench.gpu_rows import GpuRow, arena_round, describe_arena
    from tiered_cache.bench.gpu_table import render

    assert all(r["arena"] == [] for r in bench["rows"])
    before = {"calls": 3, "copied": 24, "refused": 0, "lost": 1, "copy_s": 0.5, "check_s": 0.25, "call_s": 0.75,
              "checkers": 8, "registered": 1}
    after = {**before, "calls": 4, "copied": 32, "copy_s": 0.52, "check_s": 0.26, "call_s": 0.775}
    one = arena_round(before, after)
    assert (one["calls"], one["copied"], one["lost"], one["checkers"], one["registered"]) == (1, 8, 0, 8, 1)
    assert one["copy_s"] == pytest.approx(0.02) and one["check_s"] == pytest.approx(0.01)
    assert arena_round(None, after) == after and arena_round(before, None) is None
    line = describe_arena(one, 2**20)  # 8 MiB: copies in 20 ms, checks in 10 ms
    assert "arena DMA 8 pages in 1 call(s): copy stream 20.0 ms (0.4 GB/s), checks 10.0 ms (0.8 GB/s on 8" in line
    staged = describe_arena({**one, "staged": 8}, 2**20)  # a map the driver would not register
    assert "arena DMA 8 pages (8 staged through host chunks) in 1 call(s)" in staged
    names = {f.name for f in fields(GpuRow)}
    rows = [GpuRow(**{k: v for k, v in r.items() if k in names}) for r in bench["rows"]]
    store = next(r for r in rows if r.row == "store")
    store.arena = [one]
    assert f"store at {store.tokens:,} tokens, last round: arena DMA 8 pages" in render(bench["setup"], rows)
