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
    ({"engine": "vlm"}, "engine must be one of hf, vllm, got 'vlm'"),
    ({"vllm": {"router": "random"}}, "vllm.router must be one of tiered-cache, prefix, pow2"),
    ({"vllm": {"replicas": 0}}, "vllm.replicas"),
    ({"vllm": {"replicas": 3, "max_replicas": 2}}, "vllm.max_replicas"),
    ({"vllm": {"events_port": 80}}, "vllm.events_port"),
    ({"vllm": {"replica": 2}}, "vllm.replica"),
    ({"vllm": {"block_size": 100}}, "vllm.block_size must be one of 8, 16, 32, 64, 128, 256, got 100"),
])
def test_bad_settings_are_errors_that_name_them(data, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict(data)


def test_the_vllm_engine_s_settings_parse_and_the_app_carries_them():
    from tiered_cache.workers.serve_llm.settings import ServeRouter

    config = ClusterConfig.from_dict({"engine": "vllm", "vllm": {"replicas": 2, "router": "prefix",
                                                                 "host_capacity": "64MiB", "max_replicas": None}})
    assert config.engine.value == "vllm" and config.vllm.max_replicas is None  # null: a fixed count
    assert config.vllm.router is ServeRouter.PREFIX and config.vllm.host_capacity == 64 * 2**20
    pytest.importorskip("ray.serve")
    from tiered_cache.workers.serve_llm.app import connector_config
    from tiered_cache.workers.serve_llm.shard_list import shard_list_path

    secured = config.replace(shard=config.shard.__class__(token="t0ken", tls_ca="/ca.pem"))
    extra = connector_config(secured, ["10.0.0.1:5000", "10.0.0.2:5000"])["kv_connector_extra_config"]
    assert extra == {"host_capacity": 64 * 2**20, "lower_tiers": ["remote"], "remote_token": "t0ken",
                     "remote_tls_ca": "/ca.pem", "remote_addresses": ["10.0.0.1:5000", "10.0.0.2:5000"],
                     # the list the replicas keep from the directory, followed when shards move
                     "remote_addresses_file": str(shard_list_path(config.namespace))}
    assert connector_config(config, [])["kv_connector_extra_config"]["lower_tiers"] == []  # no shards: RAM only


def test_a_cpu_replica_keeps_blocks_small_enough_that_a_cached_document_is_not_recomputed():
    """vLLM's CPU build would take 128-token blocks, and a prefix cache reuses whole blocks: the app
    asks for 32 there, leaves a GPU engine vLLM's own, and a block size set by the user wins."""
    pytest.importorskip("ray")
    from tiered_cache.workers.serve_llm.app import engine_args

    def block_size(vllm: dict) -> int | None:
        return engine_args(ClusterConfig.from_dict({"engine": "vllm", "vllm": vllm}), []).get("block_size")

    assert block_size({}) == 32
    assert block_size({"num_gpus": 1}) is None
    assert block_size({"block_size": 64}) == 64 and block_size({"num_gpus": 1, "block_size": 16}) == 16
    assert block_size({"engine_kwargs": {"block_size": 128}}) == 128  # vLLM's arguments as given, last


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


def test_kv_events_give_each_member_its_ports_and_the_events_policy_needs_them():
    from tiered_cache.workers.kv_events import member_endpoints

    config = ClusterConfig.from_dict({"kv_events": "tcp://127.0.0.1:5600", "router": {"policy": "events"}})
    assert config.router.policy is RoutingPolicyName.EVENTS
    assert member_endpoints(config.kv_events, 0, "10.0.0.7") == ("tcp://127.0.0.1:5600", "tcp://127.0.0.1:5601", False)
    assert member_endpoints(config.kv_events, 3, "10.0.0.7")[:2] == ("tcp://127.0.0.1:5606", "tcp://127.0.0.1:5607")
    # auto: each node's own IP, beyond loopback because it was asked for by name; port 0: free ports.
    assert member_endpoints("tcp://auto:0", 2, "10.0.0.7") == ("tcp://10.0.0.7:0", "tcp://10.0.0.7:0", True)
    with pytest.raises(ValueError, match="needs kv_events"):
        ClusterConfig.from_dict({"router": {"policy": "events"}})
    with pytest.raises(ValueError, match=r"beyond loopback.*HOST auto"):
        ClusterConfig(kv_events="tcp://10.0.0.7:5600")  # a fixed non-loopback address: say auto
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        ClusterConfig(kv_events="127.0.0.1:5600")


def test_cluster_start_s_kv_events_flag_turns_the_event_router_on():
    import argparse

    from tiered_cache.cli.cluster_cmd import _config

    def parsed(**flags) -> ClusterConfig:
        defaults = {"config": None, "namespace": None, "shards": None, "workers": None, "model": None, "gpus": None,
                    "device": None, "start_timeout": None, "disk": None, "kv_events": None, "policy": None}
        return _config(argparse.Namespace(**{**defaults, **flags}))

    events = parsed(kv_events="tcp://127.0.0.1:0")
    assert events.kv_events == "tcp://127.0.0.1:0" and events.router.policy is RoutingPolicyName.EVENTS
    prefix = parsed(kv_events="tcp://127.0.0.1:0", policy="prefix")
    assert prefix.kv_events and prefix.router.policy is RoutingPolicyName.PREFIX
    assert parsed().kv_events is None and parsed().router.policy is RoutingPolicyName.PREFIX
