"""The HiCache backend against SGLang's own storage contract, with SGLang's real host pools and a
real store server, no SGLang server (in .venv-sglang: `make test` runs it): pages round-trip byte
for byte through both interfaces and both layouts, only the leading run counts, a corrupt page or a
dead store is a miss (never an exception, never None), and another model, layout or TP split reads
nothing of a page."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from sglang_pools import PAGE, host_pool, mla_pool, page_bytes, slots  # first: the stand-ins SGLang's CPU engine needs

sglang_storage = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from tiered_cache.bench.redis_process import free_port  # noqa: E402
from tiered_cache.client.store_client import StoreClient  # noqa: E402
from tiered_cache.server.process import StoreProcess  # noqa: E402
from tiered_cache.tiers.remote_servers import owner  # noqa: E402

MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["mla:layer_first", "mla:page_first", "mla:page_first_direct"]


def any_pool(layout: str) -> Any:
    return mla_pool(layout.removeprefix("mla:")) if layout.startswith("mla:") else host_pool(layout)


def backend(address: str, pool: Any, model: str = "model-a", tp_rank: int = 0, tp_size: int = 1, **extra: Any) -> Any:
    """Our backend as SGLang builds it, `model` its `model_id` (no local checkpoint here)."""
    from tiered_cache.integrations.sglang.backend import TieredCacheStorage

    mla = "MLA" in type(pool).__name__
    config = sglang_storage.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=True, is_page_first_layout=pool.layout == "page_first", model_name="served-name",
        extra_config={"backend_name": "tiered-cache", "module_path": "tiered_cache.integrations.sglang.backend",
                      "class_name": "TieredCacheStorage", "interface_v1": 1, "remote_timeout_s": 1.0,
                      "model_id": model, **({"remote_addresses": address} if address else {}), **extra})
    storage = TieredCacheStorage(config, {})
    assert isinstance(storage, sglang_storage.HiCacheStorage)
    storage.register_mem_pool_host(pool)
    return storage


@pytest.fixture(scope="module")
def store():
    with StoreProcess(["--no-disk", "--ram", "64MiB"]) as server:
        yield server


def keys(tag: str, n: int) -> list[str]:
    return [f"{tag}-{i:04d}" for i in range(n)]


@pytest.mark.parametrize("layout", MHA_LAYOUTS + MLA_LAYOUTS)
def test_v1_pages_round_trip_into_another_instance_pool(store, layout):
    writer, reader = any_pool(layout), any_pool(layout)
    a, b = backend(store.address, writer), backend(store.address, reader)
    names = keys(f"v1-{layout}", 4)
    assert b.batch_exists(names) == 0
    assert a.batch_set_v1(names, slots([3, 1, 7, 2])) == [True] * 4
    assert b.batch_exists(names) == 4 and b.batch_exists([*names[:2], "never-stored", names[3]]) == 2
    assert b.batch_get_v1(names, slots([10, 11, 12, 13])) == [True] * 4
    for src, dst in zip([3, 1, 7, 2], [10, 11, 12, 13], strict=True):
        assert page_bytes(reader, dst) == page_bytes(writer, src)
    metrics = b.get_stats()
    assert sum(metrics.prefetch_pgs) == 4 and metrics.prefetch_bandwidth and b.get_stats().prefetch_pgs == []
    assert sum(a.get_stats().backup_pgs) == 4


def test_our_metrics_endpoint_shows_the_backend_s_store_tier(store):
    import urllib.request

    pool = host_pool()
    storage = backend(store.address, pool, metrics_port=0)
    try:
        assert storage.batch_set_v1(keys("metrics", 2), slots([1, 2])) == [True, True]
        assert storage.batch_get_v1(keys("metrics", 3), slots([3, 4, 5])) == [True, True, False]
        text = urllib.request.urlopen(storage._metrics_server.url, timeout=10).read().decode()
    finally:
        storage.close()
    hits = [line for line in text.splitlines()
            if line.startswith("tiered_cache_tier_hits_total") and 'engine="sglang"' in line]
    assert hits and float(hits[0].split()[-1]) == 2


@pytest.mark.parametrize("layout", MHA_LAYOUTS + MLA_LAYOUTS)
def test_generic_and_v1_pages_are_the_same_blobs(store, layout):
    """A page set through the generic calls (a flat page SGLang copied out) reads back through v1,
    and a page set through v1 comes back through the generic calls into the pool as SGLang puts it
    there (`set_from_flat_data_page`): an instance on either interface shares with one on the other."""
    pool, other = any_pool(layout), any_pool(layout)
    a, b = backend(store.address, pool), backend(store.address, other)
    flat = [pool.get_data_page(p * PAGE, flat=True).clone() for p in (5, 6)]
    assert a.batch_set(keys(f"generic-{layout}", 2), flat) is True
    assert b.batch_get_v1(keys(f"generic-{layout}", 2), slots([20, 21])) == [True, True]
    assert [page_bytes(other, 20), page_bytes(other, 21)] == [page_bytes(pool, 5), page_bytes(pool, 6)]
    assert a.batch_set_v1(keys(f"v1to-{layout}", 2), slots([8, 9])) == [True, True]
    got = b.batch_get(keys(f"v1to-{layout}", 2) + ["absent"], [other.get_dummy_flat_data_page() for _ in range(3)])
    assert got[2] is None
    for page, flat_page in zip((22, 23), got[:2], strict=True):
        other.set_from_flat_data_page(page * PAGE, flat_page)  # what SGLang's generic prefetch does with it
    assert [page_bytes(other, 22), page_bytes(other, 23)] == [page_bytes(pool, 8), page_bytes(pool, 9)]
    one = b.get(keys(f"v1to-{layout}", 2)[0], other.get_dummy_flat_data_page())
    assert one is not None and torch.equal(one.view(torch.uint8), pool.get_data_page(8 * PAGE).view(torch.uint8))
    assert b.exists(keys(f"v1to-{layout}", 2)[1]) and not b.exists("absent")


def test_a_page_is_read_only_by_its_own_model_layout_and_rank(store):
    pool = host_pool()
    writer = backend(store.address, pool, model="model-a", tp_rank=0, tp_size=2)
    names = keys("identity", 2)
    assert writer.batch_set_v1(names, slots([1, 2])) == [True, True]
    before = page_bytes(pool, 30)
    for reader in (backend(store.address, host_pool(), model="model-b", tp_rank=0, tp_size=2),
                   backend(store.address, host_pool(), model="model-a", tp_rank=1, tp_size=2),
                   backend(store.address, host_pool(), model="model-a", tp_rank=0, tp_size=1),
                   backend(store.address, host_pool("page_first"), model="model-a", tp_rank=0, tp_size=2),
                   backend(store.address, host_pool(dtype=torch.bfloat16), model="model-a", tp_rank=0, tp_size=2),
                   backend(store.address, host_pool(heads=1), model="model-a", tp_rank=0, tp_size=2),
                   backend(store.address, host_pool(), model="model-a", tp_rank=0, tp_size=2,
                           remote_namespace="tenant-b")):
        assert reader.batch_exists(names) == 0
        assert reader.batch_get_v1(names, slots([30, 31])) == [False, False]
    assert page_bytes(pool, 30) == before
    twin = backend(store.address, host_pool(), model="model-a", tp_rank=0, tp_size=2)
    assert twin.batch_exists(names) == 2


def test_a_corrupt_page_ends_the_run_and_is_never_served(tmp_path):
    disk = tmp_path / "store"
    pool, other = host_pool(), host_pool()
    names = keys("corrupt", 4)
    with StoreProcess(["--disk", str(disk), "--write-through"]) as server:
        a = backend(server.address, pool)
        assert a.batch_set_v1(names, slots([1, 2, 3, 4])) == [True] * 4
        target = a.format.key(names[1]).hex()
    files = [p for p in disk.rglob(target)]
    assert len(files) == 1
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[0].write_bytes(bytes(data))
    with StoreProcess(["--disk", str(disk)]) as server:  # RAM empty: pages come from the disk files
        b = backend(server.address, other)
        assert b.batch_get_v1(names, slots([10, 11, 12, 13])) == [True, False, False, False]
        assert page_bytes(other, 10) == page_bytes(pool, 1)
        assert b.batch_exists(names) == 1  # the server dropped the page it refused
        assert sum(t.corrupt for t in StoreClient(server.address).stats().tiers) == 1


def test_a_dead_store_is_a_bounded_miss_and_reuse_comes_back_with_it(tmp_path):
    port = free_port()
    pool = host_pool()
    names = keys("outage", 3)
    with StoreProcess(["--port", str(port), "--disk", str(tmp_path / "s"), "--write-through"]) as server:
        b = backend(server.address, pool)
        assert b.batch_set_v1(names, slots([1, 2, 3])) == [True] * 3
        server.kill()
        start = time.monotonic()
        assert b.batch_exists(names) == 0
        assert b.batch_get_v1(names, slots([4, 5, 6])) == [False] * 3
        assert b.batch_set_v1(keys("outage-new", 1), slots([7])) == [False]
        assert b.batch_get(names, [pool.get_dummy_flat_data_page() for _ in names]) == [None] * 3
        assert time.monotonic() - start < 30, "a dead store must answer misses within the tier's deadlines"
        assert b.stats()["tier"]["errors"] >= 1
    with StoreProcess(["--port", str(port), "--disk", str(tmp_path / "s")]):
        deadline = time.monotonic() + 60
        while b.batch_exists(names) != 3 and time.monotonic() < deadline:
            time.sleep(0.5)  # the breaker half-opens after its cool-down
        # The first read after a restart may miss (the client still maps the old server's arena,
        # whose pages it then refuses): reuse is back once a read of the whole prefix succeeds.
        while (got := b.batch_get_v1(names, slots([4, 5, 6]))) != [True] * 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert got == [True] * 3
        assert page_bytes(pool, 4) == page_bytes(pool, 1)
        assert b.batch_set_v1(keys("outage-new", 1), slots([7])) == [True]
    b.close()  # its breaker says nothing into the next test


def test_tenants_tokens_and_several_servers_through_the_extra_config(tmp_path):
    """Pages spread over two servers that require tokens scoped to namespaces; the settings come
    from a YAML file the extra config names (`config`) and inline keys: the tenant reads its pages
    back, another tenant and a wrong token read nothing, and a refused call is a miss, not an error."""
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-a tenant-a\ntok-b tenant-b\nops *\n")
    with StoreProcess(["--no-disk", "--token-file", str(tokens)]) as one, \
            StoreProcess(["--no-disk", "--token-file", str(tokens)]) as two:
        yaml = tmp_path / "cache.yaml"
        yaml.write_text(f"remote_addresses: [{one.address}, {two.address}]\nremote_token: tok-a\n")
        pool, other = host_pool(), host_pool()
        writer = backend("", pool, config=str(yaml), remote_namespace="tenant-a")
        # Twelve pages that rendezvous hashing spreads over both servers (any 12 land on one of
        # two in 1 of 2,048 pairs of ports), each server holding exactly the pages it owns.
        ring = sorted([one.address, two.address])
        owners = {name: ring[owner(writer._format().key(name), ring)] for name in keys("tenant", 64)}
        first, *rest = owners
        names = [first, *rest[:10], next(n for n in rest[10:] if owners[n] != owners[first])]
        assert writer.batch_set_v1(names, slots(list(range(1, 13)))) == [True] * 12
        held = [StoreClient(s.address, token="ops").stats().tiers[0].pages for s in (one, two)]
        assert held == [sum(owners[n] == s.address for n in names) for s in (one, two)] and min(held) > 0, held
        reader = backend("", other, config=str(yaml), remote_namespace="tenant-a")
        assert reader.batch_exists(names) == 12
        assert reader.batch_get_v1(names, slots(list(range(20, 32)))) == [True] * 12
        assert all(page_bytes(other, 19 + i) == page_bytes(pool, i) for i in range(1, 13))
        other_tenant = backend(f"{one.address},{two.address}", host_pool(), remote_token="tok-b",
                               remote_namespace="tenant-b")
        assert other_tenant.batch_exists(names) == 0 and other_tenant.batch_get_v1(names[:2], slots([1, 2])) == [
            False, False]
        stranger = backend(f"{one.address},{two.address}", host_pool(), remote_token="wrong-token",
                           remote_namespace="tenant-a")
        assert stranger.batch_exists(names) == 0 and stranger.batch_get_v1(names[:2], slots([1, 2])) == [False, False]
        assert stranger.stats()["tier"]["errors"] >= 1


def test_hybrid_model_calls_answer_misses_without_raising(store):
    storage = backend(store.address, host_pool())
    transfer = sglang_storage.PoolTransfer(name=sglang_storage.PoolName.MAMBA, keys=["k1", "k2"])
    assert storage.batch_exists_v2(["k1", "k2"], [transfer]).kv_hit_pages == 0
    assert storage.batch_get_v2([transfer]) == {transfer.name: [False, False]}
    assert storage.batch_set_v2([transfer]) == {transfer.name: [False, False]}


def test_the_model_identity_is_the_checkpoint_or_model_id_never_a_bare_name(tmp_path):
    from tiered_cache.integrations.sglang.settings import model_identity

    with pytest.raises(ValueError, match="set model_id in the extra config"):
        model_identity("meta-llama/Llama-3.1-8B-Instruct", None)
    assert model_identity("meta-llama/Llama-3.1-8B-Instruct", "llama@abc123") == "llama@abc123"
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(len(b"{}").to_bytes(8, "little") + b"{}" + b"\0" * 64)
    plain = model_identity(str(checkpoint), None)
    tagged = model_identity(f"{checkpoint}-unified-token-major", None)  # SGLang's page-format tag
    assert "weights:" in plain and tagged.startswith(plain) and tagged != plain


def test_calls_before_the_pool_is_registered_and_bad_configs():
    from tiered_cache.integrations.sglang.backend import TieredCacheStorage

    def config(**extra: Any) -> Any:
        return sglang_storage.HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=False, model_name="m",
            extra_config={"model_id": "m", **extra})

    with pytest.raises(ValueError, match="remote_addresses"):
        TieredCacheStorage(config(backend_name="x"), {})
    with pytest.raises(ValueError, match=r"remote_adresses \(did you mean remote_addresses\?\)"):
        TieredCacheStorage(config(remote_adresses="127.0.0.1:1"), {})
    # A misspelt key of the backend's own: named, the closest key offered, the backend's keys listed,
    # and said to be ours (inside SGLang's traceback).
    with pytest.raises(ValueError, match=r"^tiered-cache: unknown key\(s\) in SGLang's extra config: modelid "
                                         r"\(did you mean model_id\?\); the backend's own: config, model_id; "):
        TieredCacheStorage(config(remote_addresses="127.0.0.1:1", modelid="m"), {})
    early = TieredCacheStorage(config(remote_addresses="127.0.0.1:1", remote_timeout_s=0.5), {})
    assert early.batch_exists(["k"]) == 0 and early.batch_get_v1(["k"], slots([0])) == [False]
    assert early.stats()["faults"] == 2
