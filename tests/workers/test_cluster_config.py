"""`ClusterConfig` (Ray-free): the shipped cluster config loads, unknown keys and bad values are
errors that name the setting, and YAML nulls mean "none" only where none is meaningful."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered_cache.workers.config import AUTO_HOST, ClusterConfig, RoutingPolicyName

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_a_small_cpu_cluster():
    config = ClusterConfig()
    assert (config.namespace, config.shards, config.workers) == ("tiered-cache", 2, 2)
    assert config.shard.host == AUTO_HOST and config.shard.token is None
    assert config.router.policy is RoutingPolicyName.PREFIX and config.worker.model == "smollm2"


def test_nested_settings_parse_sizes_and_enums():
    config = ClusterConfig.from_dict({"shards": 3, "shard": {"ram_capacity": "2GiB", "redis_url": None},
                                      "worker": {"pool_capacity": "64MiB"}, "router": {"policy": "round_robin"}})
    assert config.shards == 3 and config.shard.ram_capacity == 2 * 2**30 and config.shard.redis_url is None
    assert config.worker.pool_capacity == 64 * 2**20
    assert config.router.policy is RoutingPolicyName.ROUND_ROBIN


@pytest.mark.parametrize(("data", "message"), [
    ({"shard": {"ram": "1GiB"}}, "shard.ram"),
    ({"worker": {"modle": "x"}}, "worker.modle"),
    ({"sharsd": 2}, "sharsd"),
    ({"router": {"policy": "random"}}, "random"),
    ({"shards": -1}, "shards"),
    ({"shard": {"ram_capacity": "lots"}}, "lots"),
    ({"shard": {"token": ""}}, "token"),
    ({"worker": "big"}, "worker"),
])
def test_bad_settings_are_errors_that_name_them(data, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict(data)


def test_a_null_keeps_the_default_where_none_means_nothing():
    config = ClusterConfig.from_dict({"shard": {"ram_capacity": None, "disk_path": None}})
    assert config.shard.ram_capacity == 2**30  # null size: the default
    assert config.shard.disk_path is None  # null disk: no disk tier


def test_yaml_errors_name_the_file(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match=r"cluster\.yaml"):
        ClusterConfig.from_yaml(path)
    path.write_text("worker:\n  max_new_tokens: 0\n")
    with pytest.raises(ValueError, match=r"cluster\.yaml.*max_new_tokens"):
        ClusterConfig.from_yaml(path)
