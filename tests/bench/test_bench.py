import json

import pytest
import torch
from conftest import run_cli as run_program
from conftest import run_cli_here as run_cli

from tiered_cache.bench.keys_bench import bench_keys
from tiered_cache.bench.radix_bench import bench_radix, build_tree


def test_radix_bench_measures_each_operation_beside_a_baseline():
    rows = bench_radix(300, ops=200)
    assert [r.operation for r in rows] == ["match", "insert", "evict 1 leaf"]
    for row in rows:
        assert row.value > 0 and row.baseline > 0 and row.unit == "µs/op" and not row.higher_is_better
    # Both sides of "match" found the same pages: a broken tree or a skipped baseline would not.
    assert rows[0].work == rows[0].baseline_work > 200


def test_bench_tree_reaches_the_requested_size():
    import random

    tree, sequences = build_tree(500, random.Random(1))
    assert tree.num_nodes >= 500
    tree.check_integrity()
    assert all(tree.match_prefix(s).num_pages == len(s) for s in sequences[:50])


def test_keys_bench_and_cli_json():
    rows = bench_keys(num_tokens=4096, page_sizes=(16,))
    assert rows[0].value > 0 and rows[0].work == rows[0].baseline_work == 4096  # every token keyed and hashed
    data = json.loads(run_program("bench", "keys", "--tokens", "2048", "--json").stdout)
    assert [r["operation"] for r in data] == [f"page keys, {p}-token pages" for p in (1, 16, 64, 256)]
    table = run_program("bench", "radix", "--nodes", "200", "--ops", "100").stdout
    assert "heap rebuilt per call" in table and "speed vs baseline" in table


TENSOR_ROWS = ["PagePool.write (pages in order)", "PagePool.read_tokens (out=)", "PagePool.read_tokens (new tensor)",
               "TieredCache.put (new prefix)", "TieredCache.get (device hit)", "TieredCache.get (device hit, out=)",
               "match + load + release (from host RAM)"]


def test_tensor_bench_reports_each_path_beside_memcpy(tmp_path):
    png = tmp_path / "tensor.png"
    data = json.loads(run_cli("bench", "tensor", "--model", "smollm2-135m", "--tokens", "64", "--repeat", "2",
                              "--json", "--plot", str(png)).stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["operation"] for r in data] == TENSOR_ROWS
    assert {r["baseline_name"] for r in data} == {"memcpy (torch copy_)"}
    assert data[0]["baseline"] > 0 and all(r["baseline"] == data[0]["baseline"] for r in data)  # one memcpy run
    assert all(r["value"] > 0 and r["unit"] == "GiB/s" and r["scale"] == "64 tokens, 1 MiB" for r in data)
    refused = run_cli("bench", "tensor", "--model", "smollm2-135m", "--tokens", "60", check=False)
    assert refused.returncode != 0 and "multiple of the page size (16)" in refused.stderr


def test_engine_bench_runs_every_configuration_beside_host_only():
    data = json.loads(run_cli("bench", "engine", "--pages", "4", "--requests", "12", "--gap-ms", "1", "--rounds", "2",
                              "--json").stdout)
    assert [r["below"] for r in data] == ["host only", "redis", "remote"]
    # 2 rounds of 12 requests each, 4 warm-up requests of each turn left out
    assert all(r["requests"] == 16 and r["pages_per_request"] == 4 for r in data)
    assert all(0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] for r in data)
    assert all(r["baseline_p99_ms"] == data[0]["p99_ms"] for r in data)  # host only is the baseline


def test_engine_bench_below_and_device_options():
    data = json.loads(run_cli("bench", "engine", "--pages", "2", "--requests", "6", "--gap-ms", "0", "--below", "none",
                              "--device", "cpu", "--rounds", "1", "--json").stdout)
    assert [r["below"] for r in data] == ["host only"] and data[0]["requests"] == 2
    bad = run_cli("bench", "engine", "--below", "memcached", "--requests", "6", check=False)
    assert bad.returncode == 2 and "memcached" in bad.stderr and "Traceback" not in bad.stderr
    no_rounds = run_cli("bench", "engine", "--rounds", "0", "--requests", "6", check=False)
    assert no_rounds.returncode == 2 and "rounds must be at least 1" in no_rounds.stderr
    if not torch.cuda.is_available():
        gpu = run_cli("bench", "engine", "--device", "cuda", "--requests", "6", check=False)
        assert gpu.returncode == 2 and "sees no CUDA device" in gpu.stderr and "Traceback" not in gpu.stderr


@pytest.mark.long  # a benchmark run, not the cache's correctness: make test-long
def test_remote_clients_rows_for_each_count_through_the_cli():
    data = json.loads(run_cli("bench", "remote", "--clients", "2", "--pages", "8", "--duration", "1",
                              "--lookup-tokens", "2048", "--json").stdout)
    one, two = "1 client, 8 × 1.00 MiB", "2 clients, 8 × 1.00 MiB"  # 1 is measured though not asked for
    assert [(r["scale"], r["baseline_name"]) for r in data] == [
        (one, "bare gRPC stream × 1, kept"), (one, "lookup p50, store idle"), (one, "lookup p99, store idle"),
        (two, "bare gRPC stream × 2, kept"), (two, "lookup p50, store idle"), (two, "lookup p99, store idle"),
        (two, "remote get, 1 client")]
    assert all(r["value"] > 0 and r["baseline"] > 0 and 0 < r["ratio"] < 100 for r in data)
    assert [r["unit"] for r in data] == ["GiB/s", "ms", "ms"] * 2 + ["GiB/s"]
    assert data[-1]["baseline"] == data[0]["value"] and data[-1]["value"] == data[3]["value"]
    for p50, p99 in ((data[1], data[2]), (data[4], data[5])):
        assert p50["value"] <= p99["value"] and p50["baseline"] <= p99["baseline"]
    assert data[1]["baseline"] == data[4]["baseline"]  # one idle measurement for every count
    refused = run_cli("bench", "remote", "--clients", "4,0", check=False)
    assert refused.returncode != 0 and "positive counts" in refused.stderr


def test_remote_long_prefix_arrives_whole_on_default_settings():
    data = json.loads(run_cli("bench", "remote", "--long-prefix", "0.05", "--json").stdout)
    assert [(r["scale"], r["operation"], r["baseline_name"]) for r in data] == [
        ("0.05 GiB, 51 × 1.00 MiB", "remote get, defaults (51/51 pages whole, verified)", "bare gRPC stream, kept")]
    assert data[0]["value"] > 0 and data[0]["baseline"] > 0 and data[0]["unit"] == "GiB/s"


def test_remote_bench_pages_are_checked_byte_for_byte(tmp_path):
    import pickle

    import pytest

    from tiered_cache.bench.remote_clients import MappedBlobs, verify_pages

    blobs = [bytes([i]) * (100 + i) for i in range(4)]
    mapped = pickle.loads(pickle.dumps(MappedBlobs.write(tmp_path / "blobs", blobs)))  # as a client gets it
    assert list(mapped) == blobs and verify_pages(blobs, mapped, "c") == sum(map(len, blobs))
    with pytest.raises(RuntimeError, match=r"1 of 4 pages missing \(first: page 2\)"):
        verify_pages([*blobs[:2], None, blobs[3]], mapped, "c")
    flipped = bytearray(blobs[3])
    flipped[50] ^= 1
    with pytest.raises(RuntimeError, match="page 3 differs"):
        verify_pages([*blobs[:3], bytes(flipped)], mapped, "c")


class _DiesAtStart:
    """A client process that exits before it can report (as a crash in a client would)."""

    def __init__(self) -> None:
        import os

        os._exit(3)


def test_remote_clients_failure_is_raised_with_its_cause():
    import pytest

    from tiered_cache.bench.remote_bench import _RawServer
    from tiered_cache.bench.remote_clients import RawStreamClient, run_together

    with _RawServer() as raw_addr:
        reports = run_together([(RawStreamClient, (raw_addr, 4, 1024, "ok"))] * 2, 0.3)
        assert all(r.nbytes % 4096 == 0 and r.nbytes > 0 and r.ended > r.started for r in reports)
        # A client that cannot connect breaks the release: its error is raised, not the other's.
        with pytest.raises(RuntimeError, match=r"client 1 of 2 \(RawStreamClient\) failed") as failed:
            run_together([(RawStreamClient, (raw_addr, 4, 1024, "ok")),
                          (RawStreamClient, ("127.0.0.1:1", 4, 1024, "unreachable"))], 0.3)
        assert "UNAVAILABLE" in str(failed.value)
        with pytest.raises(RuntimeError, match=r"client processes \[1\] never reported \(exit codes \[.*, 3\]\)"):
            run_together([(RawStreamClient, (raw_addr, 4, 1024, "ok")), (_DiesAtStart, ())], 0.3)


def test_every_bench_says_what_it_measures_and_every_option_its_default():
    import argparse

    from tiered_cache.cli.main import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bench = commands.choices["bench"]
    which = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    assert len(which.choices) >= 13
    for name, sub in which.choices.items():
        text = sub.format_help()
        assert f"tiered-cache bench {name}: " in text, name  # a description, not only usage
        for action in sub._actions:
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                help_text = sub.formatter_class(prog="x")._get_help_string(action)
                assert "default" in help_text, (name, action.option_strings)


def test_ttft_figure_draws_recompute_and_each_tier(tmp_path):
    import matplotlib.image

    from tiered_cache.bench.plots import plot_ttft
    from tiered_cache.bench.ttft_bench import TtftRow

    rows = [TtftRow(n, n / 1000, {"host": n / 20000, "remote": n / 8000}, n * 23040) for n in (512, 1024, 2048)]
    path = plot_ttft(rows, tmp_path / "figures" / "ttft.png")
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 300 and image.shape[1] > 500  # a real figure, in a folder it made


def test_fork_bench_counts_pages_with_and_without_sharing():
    data = json.loads(run_cli("bench", "fork", "--prompt-tokens", "66", "--new-tokens", "20", "--samples", "1,4",
                              "--json").stdout)
    one, four = data
    # 66 tokens: 5 pages (the last holds 2); 20 new tokens each. Unshared: 86 tokens = 6 pages per sample.
    assert one["baseline"] == 6 and four["baseline"] == 24
    assert one["value"] == 6
    stored = (66 + 4 * 20) / 16  # pages' worth of tokens: the prompt once, each sample's own 20
    assert stored <= four["value"] < stored + 4  # waste under one page per sample
    assert "waste 0.7" in four["operation"]  # 12 pages for 9.125 pages of tokens: 0.72 per sample
    refused = run_cli("bench", "fork", "--samples", "4,-1", check=False)
    assert refused.returncode != 0 and "positive counts" in refused.stderr


@pytest.mark.long  # a benchmark run, not the cache's correctness: make test-long
def test_swap_bench_moves_the_request_and_recomputes_its_prefill():
    (row,) = json.loads(run_cli("bench", "swap", "--tokens", "40", "--repeat", "1", "--json").stdout)
    assert row["operation"] == "swap_out + swap_in" and row["baseline_name"] == "recompute the prefill"
    assert row["value"] > 0 and row["baseline"] > 0
    assert row["baseline_work"] == 40  # the prefill really ran over the request's 40 tokens
    # 3 pages of 16 tokens swapped out: SmolLM2's 30 layers x K/V x 3 heads x 64 dims, fp32.
    assert row["work"] == 3 * 16 * 30 * 2 * 3 * 64 * 4


@pytest.mark.slow
@pytest.mark.long  # a benchmark run, not the cache's correctness: make test-long
def test_retention_bench_holds_fewer_pages_under_a_window():
    pages, per_token = json.loads(run_cli("bench", "retention", "--tokens", "80", "--window", "8", "--json").stdout)
    assert pages["work"] == 4 + 8 and pages["baseline_work"] > 80  # live tokens at the end: sink + window vs all
    assert pages["value"] <= 4 < 6 <= pages["baseline"]  # the sink page and the window (<= 3 pages) vs 90+ tokens
    assert per_token["unit"] == "ms" and per_token["value"] > 0 and per_token["baseline"] > 0
    refused = run_cli("bench", "retention", "--window", "0", check=False)
    assert refused.returncode != 0 and "--window must be positive" in refused.stderr


def test_bench_vllm_takes_the_median_over_rounds_and_needs_every_rounds_tokens_to_match():
    import pytest

    from tiered_cache.bench.vllm_bench import _add_round, bench_vllm, render

    def results(latencies, tokens, hooks=(0.0, 0.0)):
        return [{"prompt_tokens": 800, "num_cached_tokens": c, "latency_s": t, "tokens": k, "connector_s": h}
                for t, c, k, h in zip(latencies, (0, 0), tokens, hooks, strict=True)]

    rows: dict = {}
    _add_round(rows, "recompute", results([0.5, 0.7], [[1], [2]]))
    _add_round(rows, "ours", results([0.1, 0.3], [[1], [2]], (0.004, 0.006)))
    _add_round(rows, "recompute", results([0.6, 0.9], [[1], [2]]))
    _add_round(rows, "ours", results([0.2, 0.5], [[1], [3]], (0.010, 0.020)))  # a round that answered otherwise
    base, ours = rows["recompute"], rows["ours"]
    assert base.latencies_s == [0.5, 0.7, 0.6, 0.9] and base.ttft_s == pytest.approx(0.65)
    assert ours.ttft_s == pytest.approx(0.25) and ours.mean_s == pytest.approx(0.275)
    assert base.hooks_s is None and ours.hooks_s == pytest.approx(0.008)  # median of the four requests
    assert base.same_answers(base) and not ours.same_answers(base)
    table = render([base, ours])
    assert "650 ms" in table and "2.60x" in table and "NO" in table and "2 rounds: median of 4" in table
    assert "8.0 ms" in table and "in connector" in table
    assert ours.to_dict(base)["connector_s"] == pytest.approx(0.008)
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        bench_vllm(rounds=0)
    with pytest.raises(ValueError, match=r"shm must be on or off"):
        bench_vllm(shm="512KiB")
