"""Tenants over the wire: a store server with a token file, each token scoped to its namespaces.
A client of tenant A can neither read nor overwrite tenant B's pages, also knowing their keys;
an operator's token ('*') reaches every namespace; a token asking for a namespace it may not use
is refused with a message naming it. Same-host shared memory is not scoped, so it is offered only
in the empty namespace. All against a real server process."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from service_helpers import FINGERPRINT, large_items, make_items

from tiered_cache.client.store_client import StoreClient
from tiered_cache.config import CacheConfig
from tiered_cache.server.config import ServerConfig
from tiered_cache.server.process import StoreProcess
from tiered_cache.server.tenants import Grants
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.wire.auth import TOKEN_ENV, TOKEN_FILE_ENV
from tiered_cache.wire.codec import read_header

TOKENS = """\
# token        namespaces
token-a        team-a
token-b        team-b, team-b-eval   # two
token-op       *
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tenants")
    (folder / "tokens").write_text(TOKENS)
    with StoreProcess(["--disk", str(folder / "disk"), "--token-file", str(folder / "tokens")]) as proc:
        yield proc


def client(store, token, namespace=None, shm=True):
    return StoreClient(store.address, token=token, namespace=namespace, shm=shm)


def blobs(result):
    return {bytes(b.key): bytes(b.blob) for b in result.blobs}


def test_a_tenant_cannot_read_or_overwrite_another_tenants_pages_knowing_their_keys(store):
    page_of_a = make_items(3, seed=1)
    forged = [(key, blob) for (key, _), (_, blob) in zip(page_of_a, make_items(3, seed=2), strict=True)]
    with client(store, "token-a") as a, client(store, "token-b") as b:
        assert a.put(page_of_a, FINGERPRINT).stored == 3
        keys = [k for k, _ in page_of_a]
        assert b.lookup(keys).leading == 0  # B asks for A's keys: nothing there
        found = b.get_whole(keys, FINGERPRINT)
        assert found.error is None and found.blobs == []
        # B puts other pages under A's keys (valid blobs, right keys): they go into B's space.
        assert b.put(forged, FINGERPRINT).stored == 3
        assert blobs(a.get_whole(keys, FINGERPRINT)) == dict(page_of_a)
        assert blobs(b.get_whole(keys, FINGERPRINT)) == dict(forged)
        for key, blob in blobs(b.get_whole(keys, FINGERPRINT)).items():
            assert read_header(blob).key == key  # blobs carry the key the client sent


def test_a_token_with_several_namespaces_uses_each_apart_and_its_first_by_default(store):
    items = make_items(2, start=1000, seed=3)
    keys = [k for k, _ in items]
    with client(store, "token-b", "team-b-eval") as eval_, client(store, "token-b") as default, \
            client(store, "token-b", "team-b") as named:
        assert eval_.put(items, FINGERPRINT).stored == 2
        assert default.lookup(keys).leading == 0 and named.lookup(keys).leading == 0
        assert default.put(items[:1], FINGERPRINT).stored == 1
        assert named.lookup(keys).leading == 1  # the default is the first listed: team-b


def test_the_operators_token_reaches_every_namespace(store):
    items = make_items(2, start=2000, seed=4)
    keys = [k for k, _ in items]
    with client(store, "token-a") as a, client(store, "token-op", "team-a") as op_in_a, \
            client(store, "token-op") as op_shared:
        assert a.put(items, FINGERPRINT).stored == 2
        assert blobs(op_in_a.get_whole(keys, FINGERPRINT)) == dict(items)
        assert op_shared.lookup(keys).leading == 0  # the operator's default: the empty namespace


def test_a_namespace_the_token_may_not_use_is_refused_with_its_name(store):
    keys = [k for k, _ in make_items(1, seed=5)]
    with client(store, "token-a", "team-b") as intruder:
        with pytest.raises(grpc.RpcError) as caught:
            intruder.lookup(keys)
        assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "'team-b'" in caught.value.details() and "'team-a'" in caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:
            intruder.put(make_items(1, seed=5), FINGERPRINT, timeout_s=10)
        assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
    with client(store, "no-such-token") as stranger, pytest.raises(grpc.RpcError) as caught:
        stranger.lookup(keys)
    assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_only_the_operators_token_sees_the_server_wide_figures(store):
    with client(store, "token-op") as operator, client(store, "token-a") as tenant:
        assert operator.stats().server.requests > 0
        with pytest.raises(grpc.RpcError) as caught:
            tenant.stats()
        assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "Stats" in caught.value.details() and "'*'" in caught.value.details()
    # As `tiered-cache stats` says it: refused (the server answers, and says no), not unreachable.
    from tiered_cache.client.stats import server_stats
    from tiered_cache.report.stats import render_stats

    line = render_stats(server_stats(store.address, "token-a", None, 10.0))
    assert line.startswith(f"{store.address}: refused (PERMISSION_DENIED") and "'*'" in line


def test_shared_memory_is_offered_only_in_the_empty_namespace(store):
    items = make_items(2, start=3000, seed=6)
    keys = [k for k, _ in items]
    with client(store, "token-a") as scoped, client(store, "token-op") as operator:
        scoped.put(items, FINGERPRINT)
        assert scoped.attach() is None  # the arena shows every namespace's pages
        assert blobs(scoped.get_whole(keys, FINGERPRINT)) == dict(items)  # as bytes
        assert operator.attach() is not None


def test_a_cache_names_its_namespace_and_reads_only_there(store):
    items = make_items(2, start=4000, seed=7)
    keys = [k for k, _ in items]
    config = CacheConfig(remote_addresses=(store.address,), remote_token="token-b", remote_namespace="team-b-eval")
    assert config.remote_namespace == "team-b-eval"
    tier = RemoteTier([store.address], token="token-b", namespace="team-b-eval")
    try:
        tier.put(items)
        with client(store, "token-b", "team-b-eval") as same, client(store, "token-b") as other:
            assert same.lookup(keys).leading == 2 and other.lookup(keys).leading == 0
    finally:
        tier.close()
    with pytest.raises(ValueError, match="remote_namespace"):
        CacheConfig(remote_namespace="two words")


@pytest.mark.parametrize("text, what", [
    ("token-a\n", "expected 'TOKEN NAMESPACE"),
    ("token-a team-a\ntoken-a team-b\n", "listed twice"),
    ("token-a *, team-a\n", "list it alone"),
    ("token-a team a\n", "not a namespace"),
    ("# only comments\n\n", "lists no token"),
])
def test_a_token_file_mistake_is_one_line_naming_the_line(tmp_path, text, what):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(ValueError, match=what) as caught:
        Grants.from_file(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_token_file_settings_are_checked_before_the_server_starts(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("token-a team-a\n")
    with pytest.raises(ValueError, match="not both"):
        ServerConfig(token="x", token_file=str(path))
    with pytest.raises(ValueError, match="every namespace"):
        ServerConfig(token_file=str(path), metrics_port=0)
    with pytest.raises(ValueError, match="No such file"):
        ServerConfig(token_file=str(tmp_path / "missing"))


def test_serve_takes_the_token_file_from_the_environment_and_warns_about_a_token_flag(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("token-a team-a\n")
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    args = [sys.executable, "-m", "tiered_cache.cli.main", "serve", "--no-disk", "--port", "0"]
    flagged = subprocess.run(args + ["--token", "s3cret", "--token-file", str(path)], capture_output=True,
                             text=True, env=env, timeout=60)
    assert flagged.returncode == 2 and "visible to every local user" in flagged.stderr
    assert "not both" in flagged.stderr
    env[TOKEN_FILE_ENV] = str(tmp_path / "missing")
    from_env = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    assert from_env.returncode == 2 and "missing" in from_env.stderr and "listening" not in from_env.stdout


def test_a_tenants_pages_evicted_to_disk_come_back_whole_and_apart(tmp_path):
    """Below RAM every tier checks the key a blob carries: a namespace's page is stored carrying
    the namespace's key, and comes back to its client carrying the key it asked for, byte-exact."""
    (tmp_path / "tokens").write_text(TOKENS)
    items = large_items(12)  # 3 MiB of 256 KiB pages: most of it evicted from a 1 MiB RAM tier
    keys = [k for k, _ in items]
    args = ["--disk", str(tmp_path / "disk"), "--ram", "1MiB", "--shm", "off", "--token-file", str(tmp_path / "tokens")]
    with StoreProcess(args) as proc, client(proc, "token-a") as a, client(proc, "token-b") as b, \
            client(proc, "token-op") as op:
        assert a.put(items).stored == 12
        tiers = {t.name: t for t in op.stats().tiers}
        assert tiers["disk"].pages > 0 and tiers["ram"].evictions > 0
        assert blobs(a.get_whole(keys)) == dict(items)
        assert b.lookup(keys).leading == 0 and blobs(b.get_whole(keys)) == {}
        assert all(t.corrupt == 0 for t in op.stats().tiers), op.stats().tiers
