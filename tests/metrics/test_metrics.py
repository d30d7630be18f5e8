"""Prometheus metrics: a real `serve` and a cache in another process scraped over HTTP, the
exposition format parsed, and each figure checked against what the test did."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import run_cli
from prometheus_client.parser import text_string_to_metric_families
from tier_helpers import SPEC, blobs_for

from tiered_cache.client.store_client import StoreClient
from tiered_cache.metrics.families import PREFIX, TIER_FIELDS
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.base import TierStats

WORKER = Path(__file__).resolve().parents[1] / "instance_worker.py"


def scrape(url: str, token: str | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    request = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(PREFIX + name, tuple(sorted(labels.items())))]


def test_a_real_server_is_scraped_and_its_figures_match_what_was_done():
    fingerprint = bytes.fromhex(SPEC.fingerprint)
    items = blobs_for(8)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk", "--ram", "8MiB", "--metrics-port", "0"]) as store:
        assert store.metrics_url.startswith("http://127.0.0.1:")  # loopback by default
        assert any("metrics at" in line for line in store.output)
        with StoreClient(store.address) as client:
            client.put(items, fingerprint)
            got = list(client.get(keys[:5] + [bytes(32)], fingerprint))
            stats = client.stats()
        samples = scrape(store.metrics_url)
    ram = next(t for t in stats.tiers if t.name == "ram")
    assert len(got) == 5
    assert value(samples, "tier_pages", tier="ram") == ram.pages == 8
    assert value(samples, "tier_capacity_bytes", tier="ram") == 8 * 2**20
    assert value(samples, "tier_used_bytes", tier="ram") == ram.used_bytes > 0
    assert value(samples, "tier_hits_total", tier="ram") == ram.hits >= 5
    assert value(samples, "tier_read_bytes_total", tier="ram") == ram.bytes_out > 0
    assert 0 < value(samples, "tier_hit_ratio", tier="ram") <= 1
    assert value(samples, "server_requests_total") >= 3  # put, get, stats
    assert value(samples, "server_open_streams") == 0
    # Every TierStats figure is exported, counters with `_total`.
    for name, kind, _ in TIER_FIELDS.values():
        assert (PREFIX + name + ("_total" if kind == "counter" else ""), (("tier", "ram"),)) in samples


def test_with_a_token_a_scrape_without_it_is_refused():
    with StoreProcess(["--no-disk", "--token", "metrics-secret", "--metrics-port", "0"]) as store:
        with pytest.raises(urllib.error.HTTPError) as refused:
            scrape(store.metrics_url)
        assert refused.value.code == 401
        with pytest.raises(urllib.error.HTTPError):
            scrape(store.metrics_url, token="wrong")
        assert value(scrape(store.metrics_url, token="metrics-secret"), "tier_pages", tier="ram") == 0


def test_an_engine_cache_in_another_process_is_scraped_with_its_get_histograms(tmp_path):
    with StoreProcess(["--no-disk", "--metrics-port", "0"]) as store:
        put = subprocess.run([sys.executable, str(WORKER), "put", store.address, str(tmp_path)],
                             capture_output=True, text=True, timeout=120, check=True)
        assert json.loads(put.stdout.splitlines()[-1])["stored"] > 0
        child = subprocess.Popen([sys.executable, str(WORKER), "get-metrics", store.address, str(tmp_path)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            seen = json.loads(child.stdout.readline())
            samples = scrape(seen["metrics_url"])
            tree = json.loads(run_cli("tree", "--url", seen["metrics_url"], "--json").stdout)
            # One flag for "which server" (--address, as stats takes it), with or without a scheme.
            bare = seen["metrics_url"].removeprefix("http://").removesuffix("/metrics")
            drawn = run_cli("tree", "--address", bare).stdout
        finally:
            child.communicate(timeout=60)  # closes its stdin: it exits
        server = scrape(store.metrics_url)
    assert child.returncode == 0 and seen["identical"] and seen["remote_hits"] > 0
    assert value(samples, "tier_hits_total", tier="remote") == seen["remote_hits"]
    assert value(samples, "tier_pages", tier="device") == seen["device_pages"] > 0
    assert value(samples, "pool_pages", state="used") >= seen["device_pages"]
    assert value(samples, "tier_get_seconds_count", tier="remote") >= 1
    assert value(samples, "tier_get_bytes_sum", tier="remote") == seen["remote_bytes_out"] > 0
    assert value(samples, "queue_depth", queue="demoter") >= 0 and value(samples, "tree_nodes") >= 1
    assert 0 <= value(samples, "pool_fragmentation_ratio") < 1
    # `tiered-cache tree --url`: the one sequence B loaded, as one node, its pages also in the store.
    (node,) = tree["namespaces"][0]["children"]
    assert node["pages"] == seen["device_pages"] and node["where"] == ["device", "remote"]
    assert node["head_tokens"] == list(range(5000, 5016))  # instance_worker's tokens, remembered
    assert drawn.startswith("namespace (default): 1 branch") and f"{seen['device_pages']} pages" in drawn
    # The server saw the same pages leave its RAM tier.
    assert value(server, "tier_hits_total", tier="ram") >= seen["remote_hits"]


def test_the_families_carry_each_tier_figure_and_extra_labels():
    from tiered_cache.metrics.families import tier_families

    tier = TierStats("disk", capacity_bytes=100, used_bytes=40, pages=4, hits=3, misses=1, corrupt=2)
    families = {f.name: f for f in tier_families([tier], extra={"actor": "shard-0"})}
    sample = families[PREFIX + "tier_hits"].samples[0]
    assert sample.name == PREFIX + "tier_hits_total" and sample.value == 3
    assert sample.labels == {"tier": "disk", "actor": "shard-0"}
    assert families[PREFIX + "tier_checksum_failures"].samples[0].value == 2
    assert families[PREFIX + "tier_hit_ratio"].samples[0].value == 0.75


def test_bad_metrics_settings_are_refused_with_the_setting_named():
    from tiered_cache.config import CacheConfig
    from tiered_cache.server.config import ServerConfig

    with pytest.raises(ValueError, match="metrics_port"):
        ServerConfig(metrics_port=70000)
    with pytest.raises(ValueError, match="metrics_port"):
        CacheConfig(metrics_port="lots")
    with pytest.raises(ValueError, match="metrics_token"):
        CacheConfig(metrics_token=" ")
    assert CacheConfig(metrics_port="none").metrics_port is None
    assert CacheConfig(metrics_port="9100").metrics_port == 9100
