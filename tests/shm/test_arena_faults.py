"""The arena under faults, against real processes: a server killed while a client reads its arena,
a client killed while holding leases, a page written over under a reader, and a hostile process
of the same user handed the arena's path. Never a crash (SIGBUS), never a wrong page."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

from tests.cache.test_get_into import SPEC as INTO_SPEC
from tests.cache.test_get_into import assert_pages, destinations
from tests.cache.test_get_into import items as into_items
from tests.shm.test_arena import HOSTILE
from tests.shm.test_arena_transport import pages
from tiered_cache.client.store_client import StoreClient
from tiered_cache.server.process import StoreProcess
from tiered_cache.shm.arena_map import ArenaViews
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.v1 import cache_pb2 as pb


def test_a_server_killed_while_a_client_reads_its_arena_costs_misses_never_a_fault_or_a_wrong_page():
    items = pages(6, seed=40)
    keys = [k for k, _ in items]
    store = StoreProcess(["--no-disk"])
    store.start()
    tier = RemoteTier([store.address], timeout_s=2)
    try:
        tier.put(items)
        tier.warm()
        views = ArenaViews()
        lent = tier.get(keys[:3], lease=views)  # views into the arena, held across the kill
        assert all(tier.contains(keys))  # refs for the rest, remembered for the next get
        os.kill(store.proc.pid, signal.SIGKILL)
        store.proc.wait(10)
        # The map outlives the server: reading it is safe (no SIGBUS) and nobody can write it now.
        assert [bytes(b) for b in lent] == [b for _, b in items[:3]] and not views.lost()
        # Refs from the Lookup before the kill: read in place, verified, exact.
        assert tier.get(keys) == [b for _, b in items]
        assert tier.get(keys) == [None] * len(keys)  # refs used up; the server is gone: misses
        assert tier.stats().corrupt == 0
    finally:
        tier.close()
        store.stop()


_LEASE_HOLDER = """
import sys, time
from tiered_cache.client.store_client import StoreClient
client = StoreClient(sys.argv[1])
client.get_whole([])  # maps the arena
keys = [bytes.fromhex(k) for k in sys.argv[2:]]
reply = client.lookup(keys, arena=client.arena_map)
print("leased" if all(reply.shm_lengths) else "not leased", flush=True)
time.sleep(600)
"""


def _tiers(address: str, keys: list[bytes]) -> list[int]:
    with StoreClient(address) as client:
        return list(client.lookup(keys).tiers)


def test_a_client_killed_while_holding_leases_holds_nothing_past_the_lease(tmp_path):
    """A 2 MiB arena of 7 pages, all leased for 1 s by a client that is then killed. New pages
    cannot pass the leased ones (they go to disk) until the lease ends by itself; then they do."""
    items = pages(7, seed=41)
    keys = [k for k, _ in items]
    with StoreProcess(["--disk", str(tmp_path), "--ram", "2MiB", "--arena-lease", "1"]) as store:
        with StoreClient(store.address) as client:
            client.put(items)
        holder = subprocess.Popen([sys.executable, "-c", _LEASE_HOLDER, store.address, *(k.hex() for k in keys)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "leased"
        finally:
            holder.kill()
            holder.wait(10)
        leased_at = time.monotonic()
        early, late = pages(2, seed=42), pages(2, seed=43)
        with StoreClient(store.address) as client:
            client.put(early)
            if time.monotonic() - leased_at < 0.9:  # still inside the lease: nothing passed it
                assert _tiers(store.address, keys) == [pb.TIER_RAM] * len(keys)
                assert _tiers(store.address, [k for k, _ in early]) == [pb.TIER_DISK] * 2
            time.sleep(max(0.0, 1.2 - (time.monotonic() - leased_at)))  # past the lease's bound
            client.put(late)
        assert _tiers(store.address, [k for k, _ in late]) == [pb.TIER_RAM] * 2
        # The two oldest went to make room (read once, by the dead client's Lookup: a second
        # chance each, then out): disk holds every page, RAM the newest.
        assert all(t != pb.TIER_NONE for t in _tiers(store.address, keys))


def test_a_page_written_over_under_a_reader_is_read_again_exactly(tmp_path):
    """get_into (the load path) with refs from a Lookup, then another client's Puts come round the
    arena over those pages (to disk): each page is read again, the bytes exact, none refused."""
    good = into_items(6)
    keys = [k for k, _ in good]
    filler = pages(10, seed=44)
    with StoreProcess(["--disk", str(tmp_path), "--ram", "2MiB", "--arena-lease", "0"]) as store:
        tier = RemoteTier([store.address])
        try:
            tier.put(good)
            tier.warm()
            assert all(tier.contains(keys))  # refs remembered
            with StoreClient(store.address) as other:
                other.put(filler)  # over them
            dests, _ = destinations("pool")
            assert_pages(dests, tier.get_into(keys, dests, INTO_SPEC), [True] * len(keys))
            assert tier.pages_from_lookup < len(keys) and tier.stats().corrupt == 0
        finally:
            tier.close()


def test_a_hostile_process_given_the_arena_path_can_neither_write_nor_shrink_it():
    items = pages(4, seed=45)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk"]) as store, StoreClient(store.address) as client:
        client.put(items)
        reply = client.stub.Attach(pb.AttachRequest(), timeout=5)
        hostile = subprocess.run([sys.executable, "-c", HOSTILE, reply.path, str(reply.size)],
                                 capture_output=True, text=True, timeout=60, check=True)
        assert hostile.stdout.strip() == "", f"the hostile process could: {hostile.stdout.strip()}"
        got = client.get_whole(keys)
        assert got.error is None and {r.key: bytes(r.blob) for r in got.blobs} == dict(items)
        assert client.uses_shm and np.all([r.shm is None for r in got.blobs])
