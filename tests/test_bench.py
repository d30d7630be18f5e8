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
