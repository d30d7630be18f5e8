import json
import os
import subprocess
import sys

import torch
from conftest import REPO
from conftest import run_cli_here as run_cli

from tiered_cache.bench.codec_bench import _pages_from_kv, measure
from tiered_cache.bench.tiers_bench import bench_disk, bench_host, bench_redis
from tiered_cache.model.presets import preset_spec
from tiered_cache.wire.codec import encode_page

SPEC = preset_spec("smollm2-135m", page_size=4)


def test_tier_benches_compare_with_their_baselines(tmp_path, redis_server):
    rows = bench_host(SPEC, 8) + bench_disk(SPEC, 4, str(tmp_path)) + bench_redis(SPEC, 4, redis_server.url)
    assert [r.operation for r in rows] == ["host put", "host get", "disk put (atomic + fsync)",
                                           "disk get (verified)", "redis put", "redis get (verified)"]
    blob_bytes = 4 * len(encode_page(torch.zeros(SPEC.staging_shape(1)[1:], dtype=SPEC.dtype.torch), SPEC,
                                     bytes(32)))
    asked = [8 * SPEC.bytes_per_page] * 2 + [blob_bytes] * 4  # host: 8 pages; disk, redis: 4 blobs
    for row, size in zip(rows, asked, strict=True):
        assert row.value > 0 and row.baseline > 0 and row.unit == "GiB/s"
        # Each side's last timed call moved every byte asked (read back from its results).
        assert row.work == row.baseline_work == size, row


def test_bench_cli_host_json_and_redis_with_its_own_server(tmp_path):
    data = json.loads(run_cli("bench", "host", "--model", "smollm2-135m", "--page-size", "2", "--pages", "4",
                              "--json").stdout)
    assert {r["operation"] for r in data} == {"host put", "host get"}
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where its Redis keeps its folder
    table = subprocess.run([sys.executable, "-m", "tiered_cache.cli.main", "bench", "redis", "--model",
                            "smollm2-135m", "--page-size", "2", "--pages", "4"], capture_output=True, text=True,
                           env=env, cwd=REPO, timeout=300, check=True).stdout
    assert "redis-py MGET" in table and "speed vs baseline" in table
    assert list(tmp_path.iterdir()) == []  # nothing left behind, not even an empty folder


def test_bench_redis_at_a_dead_url_is_one_line():
    result = run_cli("bench", "redis", "--url", "redis://127.0.0.1:1/0", "--pages", "4", check=False)
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(errors) == 1 and "Redis at 127.0.0.1:1/0 is not reachable" in errors[0]


def test_codec_measure_reports_ratio_and_error():
    kv = torch.randn(SPEC.kv_shape(10)).half()
    pages = _pages_from_kv(kv, SPEC)
    assert pages.shape == SPEC.staging_shape(2)
    assert torch.equal(pages[1, :, :, 1], kv[:, :, 5])  # page 1 holds tokens 4..7
    rows = {r.codec: r for r in measure(pages, SPEC, "random")}
    assert rows["raw"].ratio < 1 and rows["raw"].max_rel_error == 0  # header + CRC: a bit larger
    assert all(rows[c].max_rel_error == 0 for c in ("lz4", "lz4-shuffle", "blosc2"))  # lossless
    assert 1.8 < rows["int8"].ratio < 2 and 0 < rows["int8"].max_rel_error < 0.01


def test_remote_bench_rows():
    from tiered_cache.bench.remote_bench import bench_get, bench_lookup

    rows = bench_get(SPEC, 8) + bench_lookup(num_tokens=512, repeat=3)
    assert [r.baseline_name for r in rows] == ["memcpy of the same bytes", "memcpy of the same bytes",
                                               "bare gRPC stream, kept", "bare gRPC stream, dropped",
                                               "raw Redis MGET", "bare gRPC unary, same bytes"]
    assert [r.operation for r in rows[:2]] == ["remote get_into pages, same host (arena, verified)",
                                               "remote get as bytes, same host (arena, verified)"]
    assert all(r.value > 0 and r.baseline > 0 for r in rows)
    got = rows[0].work  # every page arrived, each row moved the same blobs as its baseline
    assert got > 8 * SPEC.bytes_per_page and all(r.work == r.baseline_work == got for r in rows[:5])


def test_remote_put_bench_rows():
    from tiered_cache.bench.remote_bench import bench_put

    rows = bench_put(SPEC, 8, repeat=2)
    assert [r.baseline_name for r in rows] == ["remote put as bytes (gRPC stream)", "bare gRPC client stream"]
    assert all(r.value > 0 and r.baseline > 0 for r in rows)
    # Every put stored all 8 pages (fresh ones each time); the bare stream took the same bytes.
    assert rows[0].work == rows[0].baseline_work == rows[1].work == rows[1].baseline_work
