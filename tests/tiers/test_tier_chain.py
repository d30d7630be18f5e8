"""`TierChain` over real tiers (RAM blob tier, disk on tmp_path): demotion, residency, locking.

Torch-free: blobs are encoded from numpy pages, as the store server (which never imports torch)
would receive them.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
from tier_helpers import HeldDisk

from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.tiers.chain import TierChain
from tiered_cache.tiers.disk import DiskTier
from tiered_cache.tiers.ram import RamTier, entry_cost
from tiered_cache.wire.codec import encode_page

SPEC = KVSpec("chain-test", 2, 2, 16, page_size=4)  # 1 KiB pages


def make_blobs(n: int, start: int = 0, seed: int = 0) -> list[tuple[bytes, bytes]]:
    keys = PageKeyer(SPEC, "chain").keys(list(range(start * SPEC.page_size, (start + n) * SPEC.page_size)))
    rng = np.random.default_rng(seed)
    pages = rng.integers(0, 256, size=(n, SPEC.bytes_per_page), dtype=np.uint8)
    return [(k, encode_page(p, SPEC, k)) for k, p in zip(keys, pages, strict=True)]


BLOB = entry_cost(make_blobs(1)[0][1])  # what one blob costs the RAM tier


class Counting:
    """Mixed into a real tier: records what it is asked (`contains` calls, keys put)."""

    contains_calls: list[list[bytes]]
    put_keys: list[bytes]

    def contains(self, keys):
        self.contains_calls.append(list(keys))
        return super().contains(keys)

    def put(self, items):
        self.put_keys += [k for k, _ in items]
        return super().put(items)


class CountingRam(Counting, RamTier):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.contains_calls, self.put_keys = [], []


class CountingDisk(Counting, DiskTier):
    def __init__(self, path, capacity) -> None:
        super().__init__(path, capacity, fsync=False)
        self.contains_calls, self.put_keys = [], []


def test_eviction_from_ram_demotes_into_disk_and_residency_follows(tmp_path):
    ram, disk = RamTier(3 * BLOB), DiskTier(tmp_path, 100 * BLOB, fsync=False)
    chain = TierChain([ram, disk])
    items = make_blobs(5)
    keys = [k for k, _ in items]
    assert chain.put(items, 0) == 5
    assert ram.contains(keys) == [False, False, True, True, True]
    assert disk.contains(keys) == [True, True, False, False, False]
    assert [chain.known_in(k, 0) for k in keys] == [False, False, True, True, True]
    assert [chain.known_in(k, 1) for k in keys] == [True, True, False, False, False]
    assert chain.locate(keys) == [1, 1, 0, 0, 0]
    ram_st, disk_st = chain.stats()
    assert (ram_st.evictions, disk_st.demotions, disk_st.pages) == (2, 2, 2)
    assert chain.get(keys) == [b for _, b in items]  # byte-identical from either tier
    assert chain.get(keys[:1], load=True) == [items[0][1]]  # disk -> RAM, evicting keys[2]
    assert chain.locate(keys) == [0, 1, 1, 0, 0]
    assert chain.known_in(keys[0], 1)  # still on disk too
    ram_st, disk_st = chain.stats()
    assert disk_st.loads == 3 and disk_st.demotions == 3  # 2 + 1 got; keys[2] demoted


def test_pages_written_through_then_evicted_count_as_demoted_where_they_are(tmp_path):
    """Written to both tiers (write-through), then pushed out of RAM: the disk held them already,
    yet RAM's evictions and the disk's demotions agree on what moved where."""
    ram, disk = RamTier(3 * BLOB), DiskTier(tmp_path, 100 * BLOB, fsync=False)
    chain = TierChain([ram, disk])
    items = make_blobs(6)
    chain.put(items, 1)  # write-through: below first
    chain.put(items, 0)
    ram_st, disk_st = chain.stats()
    assert ram_st.evictions == disk_st.demotions == 3 and disk_st.pages == 6


def test_a_blob_too_big_for_ram_goes_straight_to_disk(tmp_path):
    ram, disk = RamTier(BLOB // 2), DiskTier(tmp_path, 10 * BLOB, fsync=False)
    chain = TierChain([ram, disk])
    (key, blob), = make_blobs(1)
    assert chain.put([(key, blob)], 0) == 0
    assert not chain.known_in(key, 0) and chain.known_in(key, 1)
    assert chain.locate([key]) == [1] and chain.get([key]) == [blob]


def test_a_batch_larger_than_ram_leaves_residency_right(tmp_path):
    ram, disk = RamTier(2 * BLOB), DiskTier(tmp_path, 10 * BLOB, fsync=False)
    chain = TierChain([ram, disk])
    items = make_blobs(4)
    keys = [k for k, _ in items]
    chain.put(items, 0)  # the first two are evicted by the same call that stored them
    assert [chain.known_in(k, 0) for k in keys] == ram.contains(keys) == [False, False, True, True]
    assert chain.get(keys) == [b for _, b in items]


def test_put_skips_keys_known_held(tmp_path):
    ram, disk = CountingRam(100 * BLOB), CountingDisk(tmp_path, 100 * BLOB)
    chain = TierChain([ram, disk])
    items = make_blobs(4)
    assert chain.put(items, 0) == 4 and chain.put(items[:3], 1) == 3
    assert chain.skipped_puts == 0
    assert chain.put(items, 0) == 0 and chain.put(items[:3], 1) == 0
    assert chain.skipped_puts == 7
    assert ram.put_keys == [k for k, _ in items]  # each key put into each tier once
    assert disk.put_keys == [k for k, _ in items[:3]]
    assert chain.put(items, 1) == 1 and disk.put_keys[-1:] == [items[3][0]]  # only the new one
    assert chain.skipped_puts == 10


def test_locate_asks_each_tier_at_most_once_per_call(tmp_path):
    ram, disk = CountingRam(100 * BLOB), CountingDisk(tmp_path, 100 * BLOB)
    items = make_blobs(6)
    keys = [k for k, _ in items]
    ram.put([items[0], items[3]])  # behind the chain's back: it knows nothing yet
    disk.put([items[1], items[3], items[5]])
    chain = TierChain([ram, disk])
    assert chain.locate(keys) == [0, 1, None, 0, None, 1]
    assert ram.contains_calls == [keys]
    assert disk.contains_calls == [[keys[i] for i in (1, 2, 4, 5)]]  # only what RAM lacks

    assert chain.locate(keys) == [0, 1, None, 0, None, 1]  # known keys are not asked about again
    assert ram.contains_calls[1:] == [[keys[2], keys[4]]] and disk.contains_calls[1:] == [[keys[2], keys[4]]]
    assert chain.locate([keys[0], keys[1], keys[3]]) == [0, 1, 0]
    assert len(ram.contains_calls) == len(disk.contains_calls) == 2  # all known: no tier asked

    assert chain.locate(keys, leading=True) == [0, 1, None, None, None, None]  # cut at the first miss
    assert chain.locate(keys[3:], leading=True) == [0, None, None]
    assert chain.locate([], leading=True) == []


def test_a_blob_deleted_behind_the_chains_back_is_a_miss_and_forgotten(tmp_path):
    ram, disk = CountingRam(100 * BLOB), CountingDisk(tmp_path, 100 * BLOB)
    chain = TierChain([ram, disk])
    items = make_blobs(3)
    keys = [k for k, _ in items]
    chain.put(items, 1)
    disk.delete(keys[:1])  # e.g. another process, or Redis evicting by itself
    assert chain.locate(keys) == [1, 1, 1]  # stale knowledge, answered without asking disk
    assert disk.contains_calls == []
    assert chain.get(keys) == [None, items[1][1], items[2][1]]  # a miss, never wrong bytes
    assert not chain.known_in(keys[0], 1)
    assert chain.locate(keys) == [None, 1, 1]
    assert disk.contains_calls == [[keys[0]]]  # forgotten: disk is asked again, about it alone

    chain.put(items[:1], 0)
    ram.delete(keys[:1])
    assert chain.get(keys[:1], load=True) == [None] and not chain.known_in(keys[0], 0)
    assert chain.put(items[:1], 0) == 1  # forgotten, so it is put again


def test_concurrent_gets_and_puts_return_only_what_was_put(tmp_path):
    """8 threads put and get (loading into the first tier) through a RAM tier small enough to evict all the
    time; every blob that comes back is the one put for its key, and nothing is lost."""
    ram, disk = RamTier(8 * BLOB), DiskTier(tmp_path, 1000 * BLOB, fsync=False)
    chain = TierChain([ram, disk])
    items = make_blobs(96, seed=3)
    expected = dict(items)
    wrong: list[str] = []
    errors: list[BaseException] = []
    ever_put: set[bytes] = set()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                batch = rng.sample(items, rng.randint(1, 6))
                keys = [k for k, _ in batch]
                if rng.random() < 0.4:
                    chain.put(batch, rng.choice((0, 0, 1)))
                    ever_put.update(keys)
                else:
                    where = chain.locate(keys, leading=rng.random() < 0.3)
                    for key, blob in zip(keys, chain.get(keys, where, load=rng.random() < 0.7), strict=True):
                        if blob is not None and blob != expected[key]:
                            wrong.append(key.hex())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a worker is stuck (deadlock?)"
    assert not errors, errors
    assert not wrong
    ram_st, disk_st = chain.stats()
    assert ram_st.evictions > 0 and disk_st.demotions > 0 and disk_st.loads > 0
    put_once = [(k, b) for k, b in items if k in ever_put]
    assert chain.get([k for k, _ in put_once]) == [b for _, b in put_once]  # nothing put was lost
    # Every key the chain knows in a tier is really there.
    for index, tier in enumerate(chain.tiers):
        known = [k for k, _ in items if chain.known_in(k, index)]
        assert all(tier.contains(known))


def test_a_held_disk_get_does_not_block_ram(tmp_path):
    ram, disk = RamTier(100 * BLOB), HeldDisk(tmp_path, 100 * BLOB)
    chain = TierChain([ram, disk])
    on_disk, in_ram, new = make_blobs(3, 0), make_blobs(3, 3), make_blobs(2, 6)
    chain.put(on_disk, 1)
    chain.put(in_ram, 0)
    slow: list = []
    getter = threading.Thread(target=lambda: slow.append(chain.get([k for k, _ in on_disk], load=True)))
    getter.start()
    try:
        assert disk.entered.wait(30)
        done: list = []

        def ram_work() -> None:
            keys = [k for k, _ in in_ram]
            done.append(chain.locate(keys))
            done.append(chain.locate(keys, leading=True))
            done.append(chain.get(keys))
            done.append(chain.put(new, 0))
            done.append(chain.contains([k for k, _ in new], 0))

        other = threading.Thread(target=ram_work)
        other.start()
        other.join(30)
        assert not other.is_alive(), "RAM calls waited behind the disk get"
        assert done == [[0, 0, 0], [0, 0, 0], [b for _, b in in_ram], 2, [True, True]]
        assert getter.is_alive()  # the disk get was held all along
    finally:
        disk.release.set()
        getter.join(30)
    assert slow == [[b for _, b in on_disk]]
    assert chain.locate([k for k, _ in on_disk]) == [0, 0, 0]  # loaded into RAM


if __name__ == "__main__":
    pytest.main([__file__, "-q"])


def test_get_observers_see_blob_bytes_or_pages_as_they_asked(tmp_path):
    # Compressed blobs are smaller than the pages they hold; the reuse policy prices pages, so it
    # asks for a count of pages; the metrics ask for the bytes that came.
    keys = PageKeyer(SPEC, "observed").keys(list(range(3 * SPEC.page_size)))
    zeros = np.zeros(SPEC.bytes_per_page, dtype=np.uint8)  # compresses well
    items = [(k, encode_page(zeros, SPEC, k, "lz4")) for k in keys]
    assert all(len(blob) < SPEC.bytes_per_page for _, blob in items)
    chain = TierChain([DiskTier(tmp_path, 1 << 20, fsync=False)])
    seen_bytes, seen_pages = [], []
    chain.observe_gets(lambda tier, seconds, n: seen_bytes.append((tier, n)))
    chain.observe_gets(lambda tier, seconds, n: seen_pages.append((tier, n)), pages=True)
    chain.put(items, 0)
    blobs = chain.get(keys + [b"\0" * 32])  # three pages and one the tier does not hold
    assert [b is not None for b in blobs] == [True, True, True, False]
    assert seen_bytes == [("disk", sum(len(b) for _, b in items))] and seen_pages == [("disk", 3)]
