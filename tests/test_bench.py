import json

from conftest import run_cli

from tiered_cache.bench.keys_bench import bench_keys
from tiered_cache.bench.radix_bench import bench_radix, build_tree


def test_radix_bench_measures_each_operation_beside_a_baseline():
    rows = bench_radix(300, ops=200)
    assert [r.operation for r in rows] == ["match", "insert", "evict 1 leaf"]
    for row in rows:
        assert row.value > 0 and row.baseline > 0 and row.unit == "µs/op" and not row.higher_is_better
        assert row.ratio == row.baseline / row.value


def test_bench_tree_reaches_the_requested_size():
    import random

    tree, sequences = build_tree(500, random.Random(1))
    assert tree.num_nodes >= 500
    tree.check_integrity()
    assert all(tree.match_prefix(s).num_pages == len(s) for s in sequences[:50])


def test_keys_bench_and_cli_json():
    rows = bench_keys(num_tokens=4096, page_sizes=(16,))
    assert rows[0].value > 0 and rows[0].ratio == rows[0].value / rows[0].baseline
    data = json.loads(run_cli("bench", "keys", "--tokens", "2048", "--json").stdout)
    assert [r["operation"] for r in data] == [f"page keys, {p}-token pages" for p in (1, 16, 64, 256)]
    table = run_cli("bench", "radix", "--nodes", "200", "--ops", "100").stdout
    assert "heap rebuilt per call" in table and "speed vs baseline" in table


TENSOR_ROWS = ["PagePool.store (pages in order)", "PagePool.read_tokens (out=)", "PagePool.read_tokens (new tensor)",
               "TieredCache.put (new prefix)", "TieredCache.get (device hit)", "TieredCache.get (device hit, out=)",
               "match + load + release (from host RAM)"]


def test_tensor_bench_reports_each_path_beside_memcpy():
    data = json.loads(run_cli("bench", "tensor", "--model", "smollm2-135m", "--tokens", "64", "--repeat", "2",
                              "--json").stdout)
    assert [r["operation"] for r in data] == TENSOR_ROWS
    assert {r["baseline_name"] for r in data} == {"memcpy (torch copy_)"}
    assert data[0]["baseline"] > 0 and all(r["baseline"] == data[0]["baseline"] for r in data)  # one memcpy run
    assert all(r["value"] > 0 and r["unit"] == "GiB/s" and r["scale"] == "64 tokens, 1 MiB" for r in data)
    refused = run_cli("bench", "tensor", "--model", "smollm2-135m", "--tokens", "60", check=False)
    assert refused.returncode != 0 and "multiple of the page size (16)" in refused.stderr


def test_engine_bench_runs_every_configuration_beside_host_only():
    data = json.loads(run_cli("bench", "engine", "--pages", "4", "--requests", "12", "--gap-ms", "1", "--json").stdout)
    assert [r["below"] for r in data] == ["host only", "redis", "remote"]
    assert all(r["requests"] == 8 and r["pages_per_request"] == 4 for r in data)  # 4 warm-up requests left out
    assert all(0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] for r in data)
    assert all(r["baseline_p99_ms"] == data[0]["p99_ms"] for r in data)  # host only is the baseline
