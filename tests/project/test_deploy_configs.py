"""The `deploy/` files pass Ray's own schema check (a misspelt key fails here, not at `ray up`),
the cluster config loads, and every tiered-cache command in them is one the CLI has."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")
from ray.autoscaler._private.util import prepare_config, validate_config

from tiered_cache.cli.main import build_parser
from tiered_cache.workers.config import ClusterConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RAY_UP = ["cluster.yaml", "cluster-local.yaml", "fake-multinode.yaml"]


def checked(config: dict) -> None:
    """What `ray up` does before it touches a machine: defaults merged in, then the schema. The
    fake multinode provider ships no defaults file, so its config is complete and checked as is."""
    if config["provider"]["type"] != "fake_multinode":
        config = prepare_config(copy.deepcopy(config))
    validate_config(config)


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


@pytest.mark.parametrize("name", RAY_UP)
def test_ray_up_configs_pass_rays_schema(name):
    checked(load(name))


@pytest.mark.parametrize("name", RAY_UP)
def test_a_misspelt_key_is_rejected(name):
    import jsonschema

    config = load(name)
    config["max_worker"] = config.pop("max_workers", 2)
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        checked(config)
    config = load(name)
    node_type = next(iter(config.get("available_node_types", {})), None)
    if node_type is not None:
        config["available_node_types"][node_type]["resource"] = {"CPU": 1}
        with pytest.raises(jsonschema.ValidationError, match="resource"):
            checked(config)


def test_the_cluster_config_loads_with_the_documented_keys():
    data = load("tiered-cache-cluster.yaml")
    assert set(data) == {"namespace", "shards", "workers", "start_timeout_s", "max_restarts", "engine", "shard",
                         "worker", "router", "vllm"}
    assert set(data["shard"]) == {"ram_capacity", "disk_path", "disk_capacity", "redis_url", "host", "token",
                                  "tls_cert", "tls_key", "tls_ca"}
    config = ClusterConfig.from_yaml(DEPLOY / "tiered-cache-cluster.yaml")
    assert (config.shards, config.workers, config.shard.host) == (2, 2, "auto")
    assert config.worker.num_gpus == 1 and config.worker.weights_dtype == "auto"  # a GPU each, bf16 there
    assert not config.shard.disk_path.startswith("/tmp")  # the node's disk, not a folder a reboot empties
    assert config.engine.value == "hf" and config.vllm.num_gpus == 1  # engine: vllm would take a GPU a replica


def test_the_fake_multinode_cluster_config_pins_actors_to_the_node_types_the_fake_nodes_advertise():
    nodes = load("fake-multinode.yaml")["available_node_types"]
    config = ClusterConfig.from_yaml(DEPLOY / "fake-multinode-cluster.yaml")
    shard_nodes, worker_nodes = nodes["shard_node"], nodes["worker_node"]
    assert set(config.shard.resources) <= set(shard_nodes["resources"])
    assert set(config.worker.resources) <= set(worker_nodes["resources"])
    assert config.shards <= shard_nodes["max_workers"] and config.workers <= worker_nodes["max_workers"]
    assert config.worker.num_gpus <= worker_nodes["resources"].get("GPU", 0) and config.worker.device == "cpu"


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-local.yaml"])
def test_ray_up_mounts_the_token_and_the_wheel_and_starts_ray_with_token_auth(name):
    """Ray's recipe for token auth under `ray up`: the token file at Ray's default path on every
    node, RAY_AUTH_MODE=token for `ray start` and in the login shells `ray exec` runs in. The
    project installs from the wheel `make wheel` built (mounted), after a pinned torch."""
    config = load(name)
    mounts = config["file_mounts"]
    assert mounts["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert mounts["~/tiered-cache-dist"] == "dist" and mounts["~/tiered-cache-cluster.yaml"].startswith("deploy/")
    setup = config["setup_commands"]
    assert any("export RAY_AUTH_MODE=token" in line and "~/.bashrc" in line for line in setup)
    torch_line = next(i for i, line in enumerate(setup) if "install -q torch" in line)
    wheel_line = next(i for i, line in enumerate(setup) if "~/tiered-cache-dist/tiered_cache-" in line)
    assert torch_line < wheel_line and "torch==2." in setup[torch_line]
    assert not any("git+" in line or "OWNER" in line for line in setup)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [line for line in config[key] if "ray start" in line]
        assert starts and all(line.startswith("RAY_AUTH_MODE=token ray start") for line in starts)
        # The cluster starts after `ray up`, with `ray exec`: not before the GPU nodes exist.
        assert not any("tiered-cache" in line for line in config[key])


def test_every_tiered_cache_command_the_launch_files_give_parses():
    """The steps in the `ray up` files' headers and deploy/README.md: each `tiered-cache ...`
    (inside `ray exec "..."` too) is a command the CLI has."""
    parser = build_parser()
    found = 0
    texts = [(DEPLOY / name).read_text() for name in RAY_UP] + [(DEPLOY / "README.md").read_text()]
    for text in texts:
        for line in text.splitlines():
            line = line.lstrip("# ").strip()
            if line.startswith("ray exec "):
                line = shlex.split(line.split("#")[0])[-1]
            words = shlex.split(line.split("  #")[0].split("&&")[0]) if line.startswith("tiered-cache ") else []
            if words:
                parser.parse_args(words[1:])  # SystemExit on an unknown command or flag
                found += 1
    assert found >= 6
    assert (DEPLOY / "tiered-cache-cluster.yaml").is_file()
