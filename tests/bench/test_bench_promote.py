"""`tiered-cache bench promote`, run small: every path's row beside a baseline that really ran,
each having moved the whole prefix (no timing asserts: this machine is shared and noisy)."""

import json

from conftest import run_cli_here as run_cli

from tiered_cache.bench.promote_bench import PATHS, bench_promote
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.wire.codec import raw_blob_size

SPEC = KVSpec("promote-bench-test", 4, 2, 64, dtype=DType.FP16, page_size=8)  # 16 KiB pages


def test_every_path_moves_the_whole_prefix_beside_its_baseline(tmp_path, redis_server):
    rows = bench_promote(SPEC, mib=1, rounds=2, paths=PATHS, folder=str(tmp_path), redis_url=redis_server.url)
    assert [r.path for r in rows] == ["host RAM -> pool (match + load)", "pool -> host RAM (evict)",
                                      "disk -> pool (match + load)", "Redis -> pool (match + load)",
                                      "same-host store server -> pool (match + prefetch + load)"]
    num_pages = 2**20 // SPEC.bytes_per_page
    blobs = num_pages * raw_blob_size(SPEC)
    # What each baseline's last call returned: memcpy the KV bytes; the tiers' raw reads the blobs.
    assert [r.baseline_work for r in rows] == [2**20, 2**20, blobs, blobs, 2**20]
    for row in rows:
        # The last timed load (or demotion) moved every page; the load's bytes were checked equal
        # to the prefix's inside the bench, which raises otherwise.
        assert row.nbytes == row.work == 2**20, row
        assert row.seconds > 0 and row.baseline_seconds > 0 and row.rounds == 2
    assert "redis-py + hiredis MGET" in rows[3].baseline_name and "memcpy" in rows[4].baseline_name
    assert list(tmp_path.iterdir()) == []  # the disk tier's folder is gone


def test_bench_promote_cli_prints_rows_and_refuses_unknown_paths():
    data = json.loads(run_cli("bench", "promote", "--model", "smollm2-135m", "--page-size", "4", "--mib", "1",
                              "--rounds", "1", "--paths", "host", "--json").stdout)
    assert [r["path"] for r in data] == ["host RAM -> pool (match + load)", "pool -> host RAM (evict)"]
    assert all(r["work"] == r["nbytes"] and r["baseline_gb_per_s"] > 0 for r in data)
    table = run_cli("bench", "promote", "--model", "smollm2-135m", "--page-size", "4", "--mib", "1", "--rounds", "1",
                    "--paths", "host").stdout
    assert "memcpy" in table and "vs baseline" in table and "median of 1 rounds" in table
    bad = run_cli("bench", "promote", "--paths", "tape", check=False)
    assert bad.returncode != 0 and "--paths takes some of host,disk,redis,remote" in bad.stderr
