"""A cache follows the store servers' address file (`remote_addresses_file`): a shard that moved
(its old port gone, a new one listed) is read and written at its new address without a restart;
a file that is missing, empty or wrong leaves the ring as it was."""

from __future__ import annotations

import torch

from tiered_cache.cache import TieredCache
from tiered_cache.cache.address_file import AddressFile, read_addresses, write_addresses
from tiered_cache.client.store_client import StoreClient
from tiered_cache.config import CacheConfig
from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.server.process import StoreProcess

SPEC = KVSpec(model_id="address-file-test", num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)


def config(address: str, listed) -> CacheConfig:
    return CacheConfig(pool_capacity=64 * SPEC.bytes_per_page, host_capacity=64 * SPEC.bytes_per_page,
                       lower_tiers=["remote"], remote_addresses=[address], remote_addresses_file=str(listed),
                       write_policy="write_through", remote_timeout_s=2.0)


def test_a_cache_follows_a_shard_to_its_new_address(tmp_path):
    listed = tmp_path / "shards" / "list"
    tokens, later = list(range(80)), list(range(1000, 1080))
    kv = torch.randn(2, 2, 80, 2, 8).to(SPEC.dtype.torch)
    with StoreProcess(["--no-disk"]) as old, StoreProcess(["--no-disk"]) as new:
        assert write_addresses(listed, [old.address]) and not write_addresses(listed, [old.address])
        assert (listed.parent.stat().st_mode & 0o777) == 0o700  # it says where the store is
        with TieredCache(SPEC, config(old.address, listed)) as cache:
            assert cache.address_file is not None and cache.address_file.changes == 0  # the list it had
            assert cache.put(tokens, kv) == 80
            cache.flush()
            assert StoreClient(old.address).lookup(PageKeyer(SPEC).keys(tokens)).leading == 20
            write_addresses(listed, [new.address])  # the shard moved
            assert cache.address_file.check() and cache.address_file.changes == 1
            assert cache.put(later, kv) == 80
            cache.flush()
            # What it wrote since, and what its host RAM held, are at the new address.
            for prefix in (tokens, later):
                assert StoreClient(new.address).lookup(PageKeyer(SPEC).keys(prefix)).leading == 20
            assert StoreClient(old.address).lookup(PageKeyer(SPEC).keys(later)).leading == 0
        # A cache started with the old list reads the file at start: a miss nowhere.
        with TieredCache(SPEC, config(old.address, listed)) as fresh:
            assert fresh.lookup(later) == 80


def test_a_file_that_is_missing_empty_or_wrong_leaves_the_ring(tmp_path):
    listed = tmp_path / "list"
    seen: list[list[str]] = []
    follower = AddressFile(listed, seen.append, every_s=60)
    assert not follower.check() and follower.bad_reads == 1  # missing
    listed.write_text("# no shard yet\n\n")
    assert not follower.check() and follower.bad_reads == 2
    listed.write_text("127.0.0.1:1\nhttp://127.0.0.1:2\n")
    assert not follower.check() and follower.bad_reads == 3 and seen == []
    listed.write_text("127.0.0.1:7001  # shard-0\n127.0.0.1\n")
    assert follower.check() and seen == [["127.0.0.1:7001", read_addresses(listed)[1]]]
    assert not follower.check()  # unchanged: not applied again
    follower.close()
