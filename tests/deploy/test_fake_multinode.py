"""deploy/README.md's "One machine, several nodes" block, run line by line: Ray's
`fake_multinode` provider (its nodes are extra raylets on this machine, started by the autoscaler;
the worker nodes advertise a GPU with none behind it), then `cluster start --config
deploy/fake-multinode-cluster.yaml`: the pending GPU workers make the autoscaler bring the second
worker node, each worker holds a GPU of a worker node and computes on the CPU on purpose, the
shards sit on two different shard nodes, a prompt is answered, and `cluster stop && ray stop`
leaves no Ray process.

What the test changes in the block: Ray's port (a Redis may hold 6379 here; the fake nodes then
need `gcs_address`, as deploy/fake-multinode.yaml's comment says) and the disk folder.
In `make test-long`: `ray stop` ends every Ray process of the user, so it must not meet the
suite's own Ray cluster (it skips when another Ray runs).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.long

REPO = Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_processes() -> list[str]:
    found = subprocess.run(["pgrep", "-fa", "raylet|gcs_server|ray::|default_worker"], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


def readme_block() -> list[str]:
    text = (REPO / "deploy" / "README.md").read_text()
    block = re.search(r"## One machine, several nodes\n\n```bash\n(.*?)```", text, re.S)
    assert block, "deploy/README.md has no 'One machine, several nodes' bash block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]


def run(line: str, env: dict[str, str]) -> str:
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=STEP_TIMEOUT_S, env=env,
                          cwd=REPO)
    assert done.returncode == 0, (f"{line!r} exited {done.returncode}\n{done.stdout[-3000:]}\n"
                                  f"{done.stderr[-3000:]}")
    return done.stdout


def test_the_readme_block_on_fake_gpu_nodes_places_workers_on_gpus_and_shards_apart(tmp_path):
    if ray_processes():
        pytest.skip("another Ray runs on this machine: `ray stop` here would end it")
    from ray._private.services import get_node_ip_address

    port = free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    lines = readme_block()
    assert [line.split()[:3] for line in lines] == [
        ["PORT=6380"], ["IP=$(python", "-c", "'import"], ["sed", '"s|^', "type:"],
        ["RAY_FAKE_CLUSTER=1", "ray", "start"], ["tiered-cache", "cluster", "start"],
        ["tiered-cache", "cluster", "status"], ["tiered-cache", "cluster", "generate"],
        ["tiered-cache", "cluster", "stop"]], lines
    # The first four lines share their variables: one shell, as a user's terminal runs them, with
    # a free port and a config copy of the test's own.
    head = "\n".join(lines[:4]).replace("PORT=6380", f"PORT={port}").replace("/tmp/fake-multinode.yaml",
                                                                             str(tmp_path / "fake.yaml"))
    ran = []
    try:
        run(head.replace("--autoscaling-config=", "--disable-usage-stats --autoscaling-config="), env)
        config = yaml.safe_load((tmp_path / "fake.yaml").read_text())
        assert config["provider"]["gcs_address"] == f"{get_node_ip_address()}:{port}"  # the sed did its job
        ran.extend(lines[:4])
        for line in lines[4:]:
            line = line.replace("--disk /tmp/tc", f"--disk {tmp_path / 'tc'}")
            out = run(line, env)
            ran.append(line)
            if " cluster status " in f" {line} ":
                actors = json.loads(run(line + " --json", env))["actors"]
                workers = [a for a in actors if a["kind"] == "worker"]
                shards = [a for a in actors if a["kind"] == "shard"]
                assert len(workers) == 2 and len(shards) == 2, actors
                assert all(w["gpu_ids"] and w["device"] == "cpu" for w in workers), workers
                assert len({w["node_id"] for w in workers}) == 2, workers  # one GPU each: two worker nodes
                assert len({s["node_id"] for s in shards}) == 2, shards  # one shard per shard node
                assert not {s["node_id"] for s in shards} & {w["node_id"] for w in workers}, actors
            if " cluster generate " in line:
                assert "reused" in out and "TTFT" in out, out
        assert len(ran) == len(lines)
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True, env=env, timeout=120)
    deadline = time.monotonic() + 30
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_processes(), ray_processes()
