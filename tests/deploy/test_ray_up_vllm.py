"""`ray up deploy/cluster-local.yaml` for real with `engine: vllm`: the same SSH "node" on this
machine as test_ray_up.py (its fixtures), the cluster config edited as deploy/README.md tells a
user who serves with vLLM: `engine: vllm`, the model, one replica on vLLM's CPU build; then
`ray exec` runs `tiered-cache cluster start` (a store shard and a Ray Serve LLM application with
our connector, router and front end), `cluster generate` (through the front end, with its token;
without it a one-line refusal), `stats --ray` (the replica's connector figures), `cluster stop`,
and `ray down` leaves no process behind.

The node's Python sees this venv's packages (vLLM's CPU build and Ray Serve, as a machine image
for vLLM would hold them), so it runs from `.venv-vllm`: `make test-long` runs it there; in
`.venv` it is skipped. Ray's head is started with 8 logical CPUs: a 2-core node would leave the
replica's bundles pending (the README says so)."""

from __future__ import annotations

import subprocess
import time

import pytest
import yaml

pytest.importorskip("vllm")
pytest.importorskip("ray.serve.llm")

from tests.deploy.test_ray_up import (  # noqa: F401  (fixtures: pytest finds them in this module)
    DEPLOY,
    NODE_USER,
    REPO,
    STEP_TIMEOUT_S,
    launcher_env,
    node_config,
    node_processes,
    run,
    sshd,
)

pytestmark = [pytest.mark.long, pytest.mark.timeout(1500)]
HTTP_TOKEN = "deploy-test-http-token"
HTTP_PORT = 18311


@pytest.fixture(scope="module")
def launch(sshd, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("launcher-vllm")
    env = launcher_env(folder)
    cluster_config = yaml.safe_load((DEPLOY / "tiered-cache-cluster.yaml").read_text())
    cluster_config.update(engine="vllm", shards=1, start_timeout_s=300)
    cluster_config["shard"].update(ram_capacity="64MiB", disk_capacity="256MiB")
    cluster_config["vllm"].update(model="smollm2", replicas=1, max_replicas=1, num_gpus=0, host_capacity="64MiB",
                                  max_model_len=2048)
    (folder / "tiered-cache-cluster.yaml").write_text(yaml.safe_dump(cluster_config))

    path, _ = node_config(sshd, folder, " --num-cpus=8")
    return {"config": str(path), "env": env}


def ray(launch: dict, *args: str) -> str:
    return run(["ray", *args], env=launch["env"], cwd=REPO).stdout


def node(launch: dict, command: str) -> str:
    return ray(launch, "exec", launch["config"], command)


@pytest.fixture(scope="module")
def cluster(launch):
    run(["bash", "-c", "ray get-auth-token --generate > /dev/null"], env=launch["env"], cwd=REPO)
    run(["make", "wheel"], env=launch["env"], cwd=REPO)
    ray(launch, "up", "-y", launch["config"])
    yield
    if node_processes():
        subprocess.run(["ray", "down", "-y", launch["config"]], env=launch["env"], cwd=REPO,
                       capture_output=True, timeout=STEP_TIMEOUT_S)
        subprocess.run(["pkill", "-KILL", "-u", NODE_USER], capture_output=True)


def test_ray_up_with_engine_vllm_serves_answers_through_the_front_end(cluster, launch):
    started = node(launch, "tiered-cache cluster start --address auto --config ~/tiered-cache-cluster.yaml "
                           f"--http-port {HTTP_PORT} --http-token {HTTP_TOKEN}")
    assert "shard-0" in started and f"127.0.0.1:{HTTP_PORT}/v1" in started, started
    answer = node(launch, f"tiered-cache cluster generate --address auto --http-token {HTTP_TOKEN} "
                          "'What is a KV cache?'")
    assert answer.strip() and "tokens expected cached" in answer, answer
    refused = subprocess.run(["ray", "exec", launch["config"],
                              "tiered-cache cluster generate --address auto 'What is a KV cache?'"],
                             env=launch["env"], cwd=REPO, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    assert refused.returncode != 0 and "wants its token" in refused.stdout + refused.stderr
    deadline = time.monotonic() + 60  # Serve polls the replica's routing stats every 2 s
    while True:
        stats = node(launch, "tiered-cache stats --ray auto")
        if "replica" in stats or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert "vLLM application" in stats and "lookups" in stats, stats
    stopped = node(launch, "tiered-cache cluster stop --address auto")
    assert "actor(s) stopped" in stopped, stopped


def test_ray_down_leaves_no_process_behind(cluster, launch):
    ray(launch, "down", "-y", launch["config"])
    deadline = time.monotonic() + 60
    while node_processes() and time.monotonic() < deadline:
        time.sleep(1)
    assert node_processes() == []
