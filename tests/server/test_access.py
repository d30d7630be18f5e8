"""Access: tokens are real secrets on every path, a client without one learns nothing, and
what the cache writes to disk is its owner's alone."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import grpc
import pytest
from service_helpers import FINGERPRINT, make_items
from tier_helpers import blobs_for

from tiered_cache.client.store_client import StoreClient
from tiered_cache.config import CacheConfig
from tiered_cache.server.config import ServerConfig
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.disk import DiskTier
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.v1 import cache_pb2 as pb
from tiered_cache.wire.auth import TOKEN_ENV, check_token, token_from
from tiered_cache.workers.config import ShardSettings

BLANK = ["", " ", "\t", "  \n "]


@pytest.mark.parametrize("token", BLANK)
def test_blank_tokens_are_refused_on_every_config_path(token, tmp_path):
    with pytest.raises(ValueError, match="empty or blank"):
        ServerConfig(token=token)
    yaml_file = tmp_path / "serve.yaml"
    yaml_file.write_text(f"token: {json.dumps(token)}\n")
    with pytest.raises(ValueError, match="empty or blank"):
        ServerConfig.from_yaml(yaml_file)
    with pytest.raises(ValueError, match="remote_token"):
        CacheConfig(remote_token=token)
    with pytest.raises(ValueError, match="remote_token"):
        CacheConfig.from_env(environ={"TIERED_CACHE_REMOTE_TOKEN": token})
    with pytest.raises(ValueError, match=r"shard\.token"):
        ShardSettings(token=token)
    with pytest.raises(ValueError, match="empty or blank"):
        StoreClient("127.0.0.1:1", token=token)
    with pytest.raises(ValueError, match="--token"):
        token_from(token, {})
    with pytest.raises(ValueError, match=TOKEN_ENV):
        token_from(None, {TOKEN_ENV: token})


def test_token_checks_name_what_is_wrong():
    assert check_token(None) is None
    assert check_token("s3cret-Token_1") == "s3cret-Token_1"
    with pytest.raises(ValueError, match="whitespace"):
        check_token(" s3cret")
    with pytest.raises(ValueError, match="printable ASCII"):
        check_token("s3cr\u00e9t")
    assert token_from(None, {}) is None
    assert token_from(None, {TOKEN_ENV: "abc"}) == "abc"
    assert token_from("flag", {TOKEN_ENV: "env"}) == "flag"


@pytest.mark.parametrize("how", ["flag", "env", "blank-env"])
def test_serve_refuses_an_empty_token_before_listening(how):
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    args = [sys.executable, "-m", "tiered_cache.cli.main", "serve", "--no-disk", "--port", "0"]
    if how == "flag":
        args += ["--token", ""]
    else:
        env[TOKEN_ENV] = "" if how == "env" else "   "
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "listening" not in result.stdout
    assert "empty or blank" in result.stderr


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    with StoreProcess(["--disk", str(tmp_path_factory.mktemp("guarded")), "--token", "s3cret"]) as proc:
        yield proc


def _every_call(client: StoreClient, keys: list[bytes], items: list[tuple[bytes, bytes]]) -> dict[str, grpc.RpcError]:
    """Each method of the service, as the client would call it; the error each one raised."""
    calls = {
        "Lookup": lambda: client.lookup(keys),
        "Get": lambda: list(client.get(keys, FINGERPRINT)),
        "Put": lambda: client.put(items, FINGERPRINT),
        "Stats": lambda: client.stats(),
        "Attach": lambda: client.stub.Attach(pb.AttachRequest(), timeout=5, metadata=client.metadata),
        "Offer": lambda: client.stub.Offer(pb.OfferRequest(), timeout=5, metadata=client.metadata),
        "PutOffered": lambda: client.stub.PutOffered(pb.PutOfferedRequest(segment=b"s" * 16, pages=[
            pb.OfferedPage(key=k, position=0, length=len(b)) for k, b in items]), timeout=5, metadata=client.metadata),
    }
    errors = {}
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        errors[name] = info.value
    return errors


def test_without_the_token_every_method_is_refused_and_reveals_nothing(guarded):
    held, missing = make_items(2, start=500), make_items(2, start=900)
    with StoreClient(guarded.address, token="s3cret") as owner:
        assert owner.put(held, FINGERPRINT).stored == 2
        before = owner.stats().server.unauthenticated
    for token in (None, "wrong", "s3cret-but-longer"):
        with StoreClient(guarded.address, token=token) as stranger:
            on_held = _every_call(stranger, [k for k, _ in held], held)
            on_missing = _every_call(stranger, [k for k, _ in missing], missing)
            for name in on_held:
                assert on_held[name].code() == grpc.StatusCode.UNAUTHENTICATED, name
                # The same answer whether the key is held or not: nothing to probe with.
                assert on_held[name].details() == on_missing[name].details(), name
            # The bulk path (aio channel) is refused too, and yields no blob; the shared-memory ring
            # it asks for first (Attach) is not revealed either.
            result = stranger.get_whole([k for k, _ in held], FINGERPRINT)
            assert result.error is not None and result.error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert not stranger.uses_shm
            assert stranger.health() == "SERVING"
    with StoreClient(guarded.address, token="s3cret") as owner:
        stats = owner.stats()
        # Per stranger: 7 methods x (held, missing) + the bulk Get and the Attach before it + the
        # Attach its first Put asks (is the server on this host?).
        assert stats.server.unauthenticated == before + 3 * (14 + 2 + 1)
        # The strangers' Puts stored nothing: the owner's two pages are all there is.
        assert sum(t.pages for t in stats.tiers if t.name == "ram") == 2
        assert [g.key for g in owner.get([k for k, _ in missing])] == []


def test_disk_tier_files_and_folders_are_owner_only(tmp_path):
    old = os.umask(0o022)  # a typical umask would leave them world-readable
    try:
        root = tmp_path / "a" / "b" / "pages"
        tier = DiskTier(root, "1MiB")
        assert tier.put(blobs_for(3)) == 3
        tier.close()
    finally:
        os.umask(old)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", root):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    files = list(root.iterdir())
    assert len(files) == 4  # three pages and the lock
    for file in files:
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file


def test_two_namespaces_with_the_same_tokens_never_share_a_page_on_any_tier(tmp_path, redis_server, redis_prefix):
    """Tenant A's pages go down every tier (device, host, disk, Redis, a store server); tenant B
    asks for the very same tokens and finds nothing on any of them, while A finds all."""
    import torch

    from tiered_cache.cache import TieredCache
    from tiered_cache.index.keys import PageKeyer
    from tiered_cache.model.spec import KVSpec
    from tiered_cache.tiers.disk import DiskTier as Disk
    from tiered_cache.tiers.redis import RedisTier

    spec = KVSpec("isolation", 2, 2, 32, page_size=4)
    tokens = list(range(40))  # 10 pages
    kv = torch.randn(spec.kv_shape(len(tokens)), generator=torch.Generator().manual_seed(1)).half()

    with StoreProcess(["--no-disk"]) as store:
        def cache(namespace: str, folder: str) -> TieredCache:
            return TieredCache(spec, CacheConfig(
                namespace=namespace, pool_capacity=16 * spec.bytes_per_page, host_capacity=16 * spec.bytes_per_page,
                lower_tiers=["disk", "redis", "remote"], disk_path=str(tmp_path / folder), redis_url=redis_server.url,
                redis_prefix=redis_prefix, remote_addresses=[store.address], write_policy="write_through"))

        writer = cache("tenant-a", "disk-a")
        assert writer.put(tokens, kv) == len(tokens)
        assert writer.flush(timeout=30)
        assert writer.lookup(tokens, namespace="tenant-b") == 0  # the same instance, another tenant
        writer.close()
        keys = {ns: PageKeyer(spec, ns).keys(tokens) for ns in ("tenant-a", "tenant-b")}
        assert not set(keys["tenant-a"]) & set(keys["tenant-b"])
        held_by = {
            "disk": Disk(tmp_path / "disk-a", "1GiB"),
            "redis": RedisTier(redis_server.url, prefix=redis_prefix),
            "remote": RemoteTier([store.address]),
        }
        for name, tier in held_by.items():
            assert tier.contains_prefix(keys["tenant-a"]) == 10, name
            assert tier.contains_prefix(keys["tenant-b"]) == 0, name
            assert tier.get(keys["tenant-b"]) == [None] * 10, name
            tier.close()
        # Fresh instances reading through every tier: B sees nothing, A sees its own KV, exact.
        other = cache("tenant-b", "disk-b")
        assert other.lookup(tokens) == 0 and other.get(tokens)[0] == 0
        other.close()
        same = cache("tenant-a", "disk-a2")
        n, got = same.get(tokens)
        assert n == len(tokens) and torch.equal(got, kv)
        same.close()


def test_a_cache_with_a_wrong_token_is_told_the_server_refuses_it_not_that_it_is_down(guarded, caplog):
    import logging

    from tiered_cache.tiers.remote import RemoteTier

    tier = RemoteTier([guarded.address], token="not-the-token", fingerprint=FINGERPRINT)
    try:
        with caplog.at_level(logging.WARNING, logger="tiered_cache"):
            assert tier.get([k for k, _ in make_items(1, start=950)]) == [None]  # a miss, never an exception
    finally:
        tier.close()
    lines = [r.getMessage() for r in caplog.records if guarded.address in r.getMessage()]
    assert lines and "is up and refuses this client's token (UNAUTHENTICATED" in lines[0], lines
    assert "is down" not in lines[0]
