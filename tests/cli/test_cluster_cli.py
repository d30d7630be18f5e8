"""The README's local walk, command for command, against the session's 3-node Ray cluster:
`cluster start`, `cluster status`, `cluster generate` (twice: the repeat reuses the prefix),
`stats --ray` (totals are the sums of the rows), `cluster stop` (nothing left behind).

The commands run through `tiered-cache`'s own entry point in this process (conftest
`run_cli_here`), one Ray connection for the whole walk: each in a fresh interpreter spent ~3 s
importing and joining Ray, a dozen times over."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli_here as run_cli

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow
NAMESPACE = "walk"


def test_the_cluster_commands_start_use_report_and_stop(ray_cluster, tmp_path):
    where = ["--address", ray_cluster.address, "--namespace", NAMESPACE]
    ray.shutdown()  # the commands join the cluster themselves, in the walk's namespace
    try:
        _walk(ray_cluster, where, tmp_path)
    finally:
        ray.shutdown()


def _walk(ray_cluster, where: list[str], tmp_path) -> None:
    # Two workers holding one GPU each (the session's nodes 1 and 2 advertise one; the work runs on
    # the CPU, as `--device cpu` asks), two shards one per node.
    started = run_cli("cluster", "start", *where, "--shards", "2", "--workers", "2", "--gpus", "1", "--device", "cpu",
                      "--disk", str(tmp_path))
    assert started.stdout.count("cpu (GPU 0)") == 2
    assert "2 store shard(s): one per node" in started.stderr
    try:
        status = json.loads(run_cli("cluster", "status", *where, "--json").stdout)
        shards = [a for a in status["actors"] if a["kind"] == "shard"]
        assert len(shards) == 2 and len({s["node_id"] for s in shards}) == 2  # one per node
        workers = [a for a in status["actors"] if a["kind"] == "worker"]
        assert len(workers) == 2 and len({w["node_id"] for w in workers}) == 2  # a GPU node each
        assert all(w["gpu_ids"] == ["0"] and w["device"] == "cpu" for w in workers)
        assert all(w["weights_dtype"] == "float32" and w["kv_dtype"] == "float16" for w in workers)  # CPU defaults
        table = run_cli("cluster", "status", *where).stdout
        assert "shard-0" in table and "shard-1" in table and "worker-1" in table
        assert table.count("cpu (GPU 0)") == 2

        prompt = "Tiered KV caches keep hot pages on the GPU and cold ones below. " * 12 + "Summarise."
        first = json.loads(run_cli("cluster", "generate", *where, prompt, "--max-new-tokens", "6", "--json").stdout)
        again = json.loads(run_cli("cluster", "generate", *where, prompt, "--max-new-tokens", "6", "--json").stdout)
        assert first["reused_tokens"] == 0 and again["reused_tokens"] > 0 and again["tokens"] == first["tokens"]
        served = first["worker"]
        assert again["route"] == {"worker": served, "reason": "prefix", "matched_chars": len(prompt)}
        text = run_cli("cluster", "generate", *where, prompt, "--max-new-tokens", "6").stdout
        assert served in text and "reused" in text
        trees = json.loads(run_cli("tree", "--ray", ray_cluster.address, "--namespace", NAMESPACE, "--json").stdout)
        assert [t["worker"] for t in trees] == ["worker-0", "worker-1"]
        (tree,) = [t for t in trees if t["worker"] == served]
        (branch,) = tree["namespaces"][0]["children"]  # one prompt, asked three times: one node
        assert branch["hits"] >= 2 and "Tiered KV caches keep hot pages" in branch["head_text"] + branch["tail_text"]

        figures = json.loads(run_cli("stats", "--ray", ray_cluster.address, "--namespace", NAMESPACE,
                                     "--json").stdout)
        for name, total in figures["totals"].items():
            rows = [t for a in figures["actors"] for t in (a["tiers"] if a["kind"] == "shard"
                                                            else a["cache"]["tiers"]) if t["name"] == name]
            for key in ("pages", "used_bytes", "hits", "misses", "bytes_in"):
                assert total[key] == sum(int(r[key]) for r in rows), (name, key)
        assert figures["totals"]["ram"]["pages"] > 0  # the worker wrote its pages through to the shards
        assert "cluster total" in run_cli("stats", "--ray", ray_cluster.address, "--namespace", NAMESPACE).stdout
    finally:
        stopped = run_cli("cluster", "stop", *where, "--json")
    assert sorted(json.loads(stopped.stdout)["stopped"]) == ["directory", "router", "shard-0", "shard-1", "worker-0",
                                                             "worker-1"]
    assert ray.get_runtime_context().namespace == NAMESPACE  # the connection the commands made
    assert ray.util.list_named_actors() == []
    from ray.util.placement_group import get_placement_group

    with pytest.raises(ValueError):
        get_placement_group(f"{NAMESPACE}-shards")
    empty = run_cli("cluster", "status", *where, "--json", check=False)
    assert empty.returncode == 1 and json.loads(empty.stdout)["actors"] == []


def test_a_bad_cluster_config_is_refused_before_connecting(tmp_path):
    bad = tmp_path / "cluster.yaml"
    bad.write_text("shards: 2\nworker:\n  modle: smollm2\n")
    result = run_cli("cluster", "start", "--address", "127.0.0.1:1", "--config", str(bad), check=False)
    assert result.returncode == 2 and "worker.modle" in result.stderr
