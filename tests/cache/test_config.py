import pytest

from tiered_cache.config import CacheConfig, WritePolicy
from tiered_cache.index.eviction_queue import EvictionPolicy
from tiered_cache.tiers.base import Tier
from tiered_cache.wire.codec import Codec


def test_defaults_are_embedded_and_need_nothing():
    cfg = CacheConfig()
    assert cfg.lower_tiers == () and cfg.codec is Codec.RAW and cfg.write_policy is WritePolicy.WRITE_BACK


def test_yaml_then_environment(tmp_path):
    path = tmp_path / "cache.yaml"
    path.write_text("pool_capacity: 64MiB\nhost_capacity: 1.5GiB\nlower_tiers: [disk, redis]\n"
                    f"disk_path: {tmp_path}/d\nwrite_policy: write_through\ncodec: lz4-shuffle\n")
    env = {"TIERED_CACHE_POOL_CAPACITY": "128MiB", "TIERED_CACHE_EVICTION_POLICY": "lfu",
           "TIERED_CACHE_DISK_FSYNC": "false", "TIERED_CACHE_REDIS_TTL_S": "30", "OTHER": "x"}
    cfg = CacheConfig.load(path, environ=env)
    assert cfg.pool_capacity == 128 * 2**20  # the environment wins over the file
    assert cfg.host_capacity == 3 * 2**29
    assert cfg.lower_tiers == (Tier.DISK, Tier.REDIS)
    assert cfg.write_policy is WritePolicy.WRITE_THROUGH and cfg.codec is Codec.LZ4_SHUFFLE
    assert cfg.eviction_policy is EvictionPolicy.LFU and cfg.disk_fsync is False and cfg.redis_ttl_s == 30.0
    assert CacheConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("data, message", [
    ({"pool_capacty": "1GiB"}, "unknown config key.*pool_capacty .did you mean pool_capacity"),
    ({"pool_capacity": "lots"}, "bad value for pool_capacity"),
    ({"codec": "zstd"}, "bad value for codec.*unknown codec 'zstd'"),
    ({"write_policy": "sometimes"}, "write_policy: expected one of 'write_back', 'write_through', got 'sometimes'"),
    ({"eviction_policy": "mru"}, "eviction_policy: expected one of .*'lru'.*got 'mru'"),
    ({"lower_tiers": ["disk"]}, "disk_path is not set"),
    ({"lower_tiers": ["tape"]}, "lower_tiers: expected one of 'disk', 'redis', 'remote', got 'tape'"),
    ({"lower_tiers": "disk,host"}, "lower_tiers: expected one of 'disk', 'redis', 'remote', got 'host'"),
    ({"demotion_queue": "lots"}, "demotion_queue: expected an integer, got 'lots'"),
    ({"high_watermark": "high"}, "high_watermark: expected a number, got 'high'"),
    ({"redis_ttl_s": True}, "redis_ttl_s: expected a number, got True"),
    ({"lower_tiers": "redis,redis"}, "lists a tier twice"),
    ({"disk_fsync": "maybe"}, "bad value for disk_fsync"),
    ({"codec_min_saving": 1.5}, "codec_min_saving must be in"),
])
def test_bad_settings_get_clear_errors(data, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig.from_dict(data)


def test_bad_yaml_and_env_name_their_source(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        CacheConfig.from_yaml(path)
    path.write_text("pool_capacity: [1\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        CacheConfig.from_yaml(path)
    with pytest.raises(ValueError, match=r"environment \(TIERED_CACHE_\*\).*unknown config key.*typo"):
        CacheConfig.from_env(environ={"TIERED_CACHE_TYPO": "1"})


def test_the_example_config_in_deploy_loads():
    from conftest import REPO

    cfg = CacheConfig.from_yaml(REPO / "deploy" / "cache.example.yaml")
    assert cfg.lower_tiers == (Tier.DISK, Tier.REDIS) and cfg.disk_capacity == 20 * 2**30


def test_remote_addresses_get_serves_port_and_urls_or_bad_ports_are_refused():
    from tiered_cache.wire.options import DEFAULT_PORT

    config = CacheConfig(remote_addresses="localhost, 127.0.0.1:7000")
    assert config.remote_addresses == (f"localhost:{DEFAULT_PORT}", "127.0.0.1:7000")
    for bad, reason in (("127.0.0.1:abc", "must be a number"), ("http://127.0.0.1:50551", "not a URL"),
                        ("host:70000", "must be a number")):
        with pytest.raises(ValueError, match=reason):
            CacheConfig(remote_addresses=[bad])


def test_the_readme_s_environment_block_gives_a_remote_tier_and_a_refusal_is_one_line_on_stderr():
    """README "A shared store": the variables it exports reach `CacheConfig.from_env()`, and a
    server that refuses the cache's token is said on stderr in one line naming the setting."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from tiered_cache.server.process import StoreProcess

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"export TIERED_CACHE_LOWER_TIERS=remote.*?\n(.*?)\n```", readme, re.S)
    assert block is not None
    with StoreProcess(["--no-disk", "--token", "right-token-0123456789"]) as store:
        env = {**os.environ, "TIERED_CACHE_LOWER_TIERS": "remote", "TIERED_CACHE_REMOTE_ADDRESSES": store.address,
               "TIERED_CACHE_REMOTE_TOKEN": "wrong-token-0123456789", "TIERED_CACHE_WRITE_POLICY": "write_through"}
        script = ("from tiered_cache import CacheConfig, TieredCache, preset_spec\n"
                  "cfg = CacheConfig.from_env(); print(cfg.remote_addresses)\n"
                  "with TieredCache(preset_spec('smollm2-135m'), cfg) as cache:\n"
                  "    for _ in range(4): cache.lookup(list(range(64)))\n")
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert store.address in run.stdout
    refusals = [line for line in run.stderr.splitlines() if "refuses this client's token" in line]
    assert refusals and "remote_token" in refusals[0]
