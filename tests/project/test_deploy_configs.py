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
from workers.config import ClusterConfig

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
    assert set(data) == {"namespace", "shards", "workers", "shard", "worker", "router"}
    assert set(data["shard"]) == {"ram_capacity", "disk_path", "disk_capacity", "redis_url", "host", "token",
                                  "tls_cert", "tls_key", "tls_ca"}
    config = ClusterConfig.from_yaml(DEPLOY / "tiered-cache-cluster.yaml")
    assert (config.shards, config.workers, config.shard.host) == (2, 2, "auto")


def test_every_tiered_cache_command_in_the_start_commands_parses():
    parser = build_parser()
    found = 0
    for name in RAY_UP:
        config = load(name)
        for key in ("head_start_ray_commands", "worker_start_ray_commands", "setup_commands"):
            for line in config.get(key, []):
                words = shlex.split(line)
                if words and words[0] == "tiered-cache":
                    parser.parse_args(words[1:])  # SystemExit on an unknown command or flag
                    found += 1
        assert all("RAY_AUTH_MODE=token" in line for line in config.get("head_start_ray_commands", [])
                   if "ray start" in line)
    assert found == 2  # cluster.yaml and cluster-local.yaml start the cluster on the head
    assert (DEPLOY / "tiered-cache-cluster.yaml").is_file()
