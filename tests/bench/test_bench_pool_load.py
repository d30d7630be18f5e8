"""`tiered-cache bench pool-load`, run small: every path's serving, first-load and warm figures
beside a limit that really ran, each load having placed the whole prefix (checked byte for byte
inside the bench, which raises otherwise; no timing asserts: this machine is shared and noisy)."""

import json

import pytest
from conftest import run_cli_here as run_cli

from tiered_cache.bench.pool_load.bench import bench_pool_load
from tiered_cache.bench.pool_load.prefixes import Prefixes
from tiered_cache.bench.pool_load.sites import PATHS
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.wire.codec import raw_blob_size

SPEC = KVSpec("pool-load-bench-test", 4, 2, 64, dtype=DType.FP16, page_size=8)  # 16 KiB pages


@pytest.mark.long  # a benchmark run, not the cache's correctness: make test-long
def test_every_path_loads_new_prefixes_into_a_full_pool_beside_its_limit(tmp_path, redis_server):
    rows = bench_pool_load(SPEC, mib=1, rounds=2, paths=PATHS, folder=str(tmp_path), redis_url=redis_server.url,
                         pool_prefixes=3, settle_s=0.2)
    assert [r.path for r in rows] == list(PATHS)
    blobs = (2**20 // SPEC.bytes_per_page) * raw_blob_size(SPEC)
    # What each limit's last call returned: memcpy the KV bytes; the tiers' raw reads the blobs.
    assert [r.serving.baseline_work for r in rows] == [2**20, 2**20, blobs, blobs, 2**20]
    for row in rows:
        for timed in (row.serving, row.warm):
            assert timed.work == row.nbytes == 2**20 and timed.seconds > 0 and timed.baseline_seconds > 0, row
        assert row.serving.rounds == 2
        first = row.first  # the reader process: a first load and three steady ones, and memcpy's
        assert first is not None and first.first_seconds > 0 and len(first.steady_seconds) == 3
        assert first.memcpy_first_seconds > 0 and len(first.memcpy_steady_seconds) == 3
        assert len(first.limit_seconds) == 4 and first.limit_first_over_steady > 0  # the limit after the pause
        assert isinstance(first.ready, bool)
        built = row.just_built  # a reader loading right after it is built, beside copies into fresh memory
        assert built is not None and built.settle_s == 0 and built.first_seconds > 0
        assert len(built.steady_seconds) == 1 and len(built.fresh_copy_seconds) == 3
        assert all(s > 0 for s in built.fresh_copy_seconds) and built.fresh_over_first > 0
        assert len(built.fresh_pool_seconds) == 3 and built.fresh_pool_over_first > 0
    # Into a pool, the engines' way (match -> prefetch -> load) is the headline and match -> load
    # is timed beside it on prefixes of its own; the tensor API has one way.
    for row in rows:
        direct = row.direct
        if row.path == "tensor":
            assert direct is None
        else:
            assert direct is not None and direct.work == row.nbytes and direct.rounds == 2 and direct.seconds > 0
    assert rows[0].demotion is not None and rows[0].demotion.work == 2**20
    assert all(r.demotion is None for r in rows[1:])
    assert rows[1].label == "host RAM -> tensor (get())"  # the tensor API: KV handed back, checked whole
    assert list(tmp_path.iterdir()) == []  # the disk tier's folder is gone


def test_prefixes_never_share_a_key_and_differ_page_for_page():
    prefixes = Prefixes(SPEC, 0.25)
    a, b = prefixes[0], prefixes[1]
    assert not set(a.keys) & set(b.keys) and len(a.tokens) == len(b.tokens)
    assert not any(bool((pa == pb).all()) for pa, pb in zip(a.pages, b.pages, strict=True))
    again = Prefixes(SPEC, 0.25)[1]  # another process rebuilds the same prefix
    assert again.keys == b.keys and bool((again.pages == b.pages).all())


def test_bench_pool_load_cli_prints_rows_and_refuses_bad_arguments():
    args = ("bench", "pool-load", "--model", "smollm2-135m", "--page-size", "4", "--mib", "1", "--rounds", "1",
            "--paths", "host", "--pool-prefixes", "2", "--settle", "0", "--no-first")
    data = json.loads(run_cli(*args, "--json").stdout)
    assert [r["path"] for r in data] == ["host"] and data[0]["first"] is None
    assert data[0]["serving"]["work"] == data[0]["nbytes"] and data[0]["warm"]["baseline_gb_per_s"] > 0
    assert data[0]["direct"]["work"] == data[0]["nbytes"] and data[0]["direct"]["rounds"] == 1
    table = run_cli(*args).stdout
    assert "memcpy" in table and "vs limit" in table and "full pool of 2 prefixes" in table
    assert "match -> load: vs limit" in table and "match -> prefetch -> load as engines call it" in table
    bad = run_cli("bench", "pool-load", "--paths", "tape", check=False)
    assert bad.returncode != 0 and "--paths takes some of host,tensor,disk,redis,remote" in bad.stderr
    bad = run_cli("bench", "pool-load", "--pool-prefixes", "1", check=False)
    assert bad.returncode != 0 and "--pool-prefixes at least 2" in bad.stderr


def test_the_old_name_still_runs_and_says_the_new_one():
    old = run_cli("bench", "promote", "--paths", "tape", check=False)
    assert "`bench promote` is now `bench pool-load`" in old.stderr
    assert old.returncode != 0 and "--paths takes some of host,tensor,disk,redis,remote" in old.stderr
