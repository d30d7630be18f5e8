"""The load path (tiered_cache/cache/tier_loads.py) as an engine drives it: a prefix in host RAM
goes straight from its rows into device pages, also into a full pool, and nothing is staged."""

from __future__ import annotations

import pytest
import torch
from kv_oracle import token_kv

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.tiers.ram import RamTier

SPEC = KVSpec("tier-loads-test", 2, 2, 8, dtype=DType.FP32, page_size=4)
PAGE = SPEC.bytes_per_page


def make(pool_pages: int, host_pages: int, lower=None, **cfg) -> TieredCache:
    config = CacheConfig(pool_capacity=pool_pages * PAGE, host_capacity=host_pages * PAGE, malloc_tuning=False,
                         high_watermark=1.0, low_watermark=0.5, **cfg)
    return TieredCache(SPEC, config, lower=lower)


def count_staged(cache: TieredCache, monkeypatch) -> list[int]:
    """Calls of the staged path (a load into a staging buffer): the host path should need none."""
    calls: list[int] = []
    real = cache.loader.tier_loads.load
    monkeypatch.setattr(cache.loader.tier_loads, "load",
                        lambda keys, *a, **k: (calls.append(len(keys)), real(keys, *a, **k))[1])
    return calls


def test_a_host_hit_is_copied_straight_into_the_pool_and_prefetch_stages_nothing(monkeypatch):
    c = make(pool_pages=16, host_pages=16)
    tokens = list(range(32))  # 8 pages
    c.put(tokens, token_kv(SPEC, tokens))
    c.evict()
    staged = count_staged(c, monkeypatch)
    h = c.match(tokens)
    assert h.available_pages == 8 and h.num_device_pages == 0
    assert c.prefetch(h) is False  # nothing to stage: load copies the rows straight in
    pages = c.load(h)
    assert len(pages) == 8 and h.sources["host"] == 8 and staged == []
    assert torch.equal(c.pool.read_tokens(pages, 32), token_kv(SPEC, tokens))
    c.release(h)
    c.check_integrity()
    c.close()


WANTED, COLD = list(range(24)), list(range(1000, 1032))  # 6 pages, then 8 that fill the pool


def load_wanted_into_a_full_pool(c: TieredCache, monkeypatch) -> None:
    """WANTED only in host RAM, COLD filling the pool: loading WANTED goes straight from host RAM
    (nothing staged), every byte right; then COLD, which made way, is still found intact."""
    c.put(WANTED, token_kv(SPEC, WANTED))
    c.evict()  # the wanted pages now only in host RAM
    assert c.put(COLD, token_kv(SPEC, COLD)) == 32 and c.pool.num_free == 0
    staged = count_staged(c, monkeypatch)
    h = c.match(WANTED)
    pages = c.load(h)
    assert len(pages) == 6 and h.sources["host"] == 6 and staged == []
    assert torch.equal(c.pool.read_tokens(pages, 24), token_kv(SPEC, WANTED))
    c.release(h)
    c.flush()
    assert c.lookup(COLD) == 32
    n, kv = c.get(COLD)
    assert n == 32 and torch.equal(kv, token_kv(SPEC, COLD))
    c.check_integrity()
    c.close()


def test_a_host_hit_into_a_full_pool_demotes_cold_pages_first_and_keeps_the_wanted_ones(monkeypatch):
    # Host RAM holds 14: the 6 wanted pages plus room for the 8 cold ones demoted to make way (a
    # whole node goes), none pushed out; the cold pages are then in host RAM.
    load_wanted_into_a_full_pool(make(pool_pages=8, host_pages=14), monkeypatch)


def test_a_host_hit_into_a_full_pool_and_a_full_host_ram_still_loads_and_sends_the_cold_pages_below(monkeypatch):
    # Host RAM of 6 holds exactly the wanted pages: the cold pages demoted to make room on the
    # device cannot push them out; they go below instead, where they are found again.
    load_wanted_into_a_full_pool(make(pool_pages=8, host_pages=6, lower=[RamTier(1 << 20)]), monkeypatch)


def test_a_copy_into_host_ram_that_fails_indexes_no_row_and_leaks_nothing(monkeypatch):
    # Host RAM keeps no checksum: a row whose copy never happened must never be served as KV.
    # (A device copy that raises, e.g. out of device memory, cannot be caused on purpose here.)
    c = make(pool_pages=8, host_pages=8)
    tokens = list(range(16))
    c.put(tokens, token_kv(SPEC, tokens))

    def broken(*args, **kwargs):
        raise RuntimeError("the copy failed")

    monkeypatch.setattr(c.loader.tier_loads.copier, "from_pool", broken)
    with pytest.raises(RuntimeError, match="the copy failed"):
        c.evict()
    assert len(c.host.index) == 0 and c.host.rows.num_free == c.host.num_rows
    assert c.lookup(tokens) == 0  # a miss, never the unwritten rows
    c.check_integrity()
    monkeypatch.undo()
    c.put(tokens, token_kv(SPEC, tokens))  # and the cache still works
    c.evict()
    n, kv = c.get(tokens)
    assert n == 16 and torch.equal(kv, token_kv(SPEC, tokens))
    c.close()


def test_pages_held_out_of_host_ram_and_stored_again_meanwhile_keep_one_row():
    c = make(pool_pages=8, host_pages=8)
    tokens = list(range(16))
    c.put(tokens, token_kv(SPEC, tokens))
    c.evict()
    keys = list(c.host.index)
    held = c.host.hold(keys)
    assert not c.host.index
    c.host.put(keys, c.host.slab[torch.tensor([row for _, row in held])].clone())  # the same pages again
    c.host.unhold(held)
    assert len(c.host.index) == 4 and c.host.rows.num_free == c.host.num_rows - 4  # the spare rows freed
    n, kv = c.get(tokens)
    assert n == 16 and torch.equal(kv, token_kv(SPEC, tokens))
    c.close()


def test_every_host_slab_copy_goes_through_the_one_copier():
    """Loads out of host rows, staged loads and demotions into host rows share one `HostCopier`:
    on CUDA its one copy stream (and one chunk buffer) orders a load of a row before a demotion
    writes over it, and a second copier would hold a second chunk buffer on the device."""
    with make(4, 8) as c:
        assert c.core.host_loads.copier is c.loader.tier_loads.copier is c.demoter.copier
