"""Pages from a same-host store server's arena straight into pool pages (device/arena_copy.py),
its CUDA logic (chunks, runs of adjacent blobs, payloads picked out of the chunk, checks beside
the copy, intact after) run on the CPU, against a real server process. The
GPU test runs the same on a device pool."""

from __future__ import annotations

import pytest
import torch

from tiered_cache.client.store_client import StoreClient
from tiered_cache.device.arena_copy import ArenaCopier, _adjacent_runs
from tiered_cache.device.pool import PagePool
from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.wire.codec import encode_page, raw_blob_size

SPEC = KVSpec("arena-copy", 3, 2, 16, page_size=8, dtype="bf16")
N = 12


def prefix(n: int = N, seed: int = 0, spec: KVSpec = SPEC
           ) -> tuple[list[bytes], torch.Tensor, list[tuple[bytes, bytes]]]:
    keys = PageKeyer(spec, f"copy-{seed}").keys(list(range(spec.page_size * n)))
    pages = torch.randn(spec.staging_shape(n), generator=torch.Generator().manual_seed(seed)).to(spec.dtype.torch)
    return keys, pages, [(k, encode_page(p, spec, k)) for k, p in zip(keys, pages, strict=True)]


def copier_and_pool(device: str = "cpu", chunk_pages: int = 5, direct: bool = True) -> tuple[ArenaCopier, PagePool]:
    pool = PagePool(SPEC, 4 * N, device=device)
    return ArenaCopier(pool, chunk_bytes=chunk_pages * raw_blob_size(SPEC), direct=direct), pool


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
@pytest.mark.parametrize("chunk_pages", [1, 5, 64])
def test_pages_lying_in_the_arena_are_placed_in_their_pool_pages_exactly(chunk_pages, direct):
    """Straight from the map (on CUDA: registered), or staged through the two host chunks (a map
    the driver refused): with one, several or all pages a chunk, each chunk's pages are placed where
    asked, host chunks reused in turn."""
    keys, pages, items = prefix()
    with StoreProcess(["--no-disk"]) as store:
        tier = RemoteTier([store.address])
        copier, pool = copier_and_pool(chunk_pages=chunk_pages, direct=direct)
        try:
            tier.put(items)
            tier.warm()
            assert tier.same_host
            where = tier.arena_pages(keys)
            assert all(w is not None for w in where)
            assert len(_adjacent_runs(where, raw_blob_size(SPEC))) == 1  # put in order: one run
            targets = pool.allocate(N)[::-1].copy()  # out of order, as an allocator hands them out
            assert copier.to_pool(keys, where, targets) == N
            assert torch.equal(pool.gather(targets), pages)
            assert (copier.refused, copier.lost) == (0, 0)
            figures = copier.stats()  # what `bench gpu` prints beside the store rows; no CUDA, no map registered
            assert (figures["calls"], figures["copied"], figures["registered"]) == (1, N, 0)
            assert figures["staged"] == (0 if direct else N)
            assert 0 < figures["copy_s"] < figures["call_s"] and 0 < figures["check_s"] < figures["call_s"]
        finally:
            copier.close()
            tier.close()


def test_pages_on_the_servers_disk_are_loaded_into_the_arena_first(tmp_path):
    keys, pages, items = prefix(seed=1)
    with StoreProcess(["--disk", str(tmp_path), "--ram", "1MiB"]) as store:
        tier = RemoteTier([store.address])
        copier, pool = copier_and_pool()
        try:
            tier.put(items)
            tier.put(prefix(400, seed=11)[2])  # more than a 1 MiB arena holds: the first pages go to disk
            tier.warm()
            with StoreClient(store.address) as client:
                assert pb_disk(client.lookup(keys).tiers)
            half = keys[:N // 2]
            where = tier.arena_pages(half)
            assert all(w is not None for w in where)
            targets = pool.allocate(len(half))
            assert copier.to_pool(half, where, targets) == len(half)
            assert torch.equal(pool.gather(targets), pages[:N // 2])
        finally:
            copier.close()
            tier.close()


def test_a_map_the_driver_refuses_is_staged_and_the_driver_asked_once():
    """On a platform without read-only registration (cudaErrorNotSupported), every load from the
    store stages its pages, and none asks the driver to pin the arena again. The refusal is the
    only fake: there is no driver here to refuse."""
    from tiered_cache.device.arena_registry import ArenaRegistry

    asked: list[int] = []
    refusing = ArenaRegistry(lambda address, size: asked.append(address) or 801, lambda address: 0)
    keys, pages, items = prefix(seed=9)
    with StoreProcess(["--no-disk"]) as store:
        tier = RemoteTier([store.address])
        pool = PagePool(SPEC, 4 * N)
        copier = ArenaCopier(pool, chunk_bytes=5 * raw_blob_size(SPEC), registry=refusing)
        try:
            tier.put(items)
            tier.warm()
            for _ in range(2):
                where = tier.arena_pages(keys)
                targets = pool.allocate(N)
                assert copier.to_pool(keys, where, targets) == N
                assert torch.equal(pool.gather(targets), pages)
                pool.free(targets)
            assert (copier.staged, copier.copied, len(asked)) == (2 * N, 2 * N, 1)
        finally:
            copier.close()
            tier.close()


def pb_disk(tiers) -> bool:
    from tiered_cache.v1 import cache_pb2 as pb

    return pb.TIER_DISK in list(tiers)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_a_page_that_is_not_the_one_asked_for_ends_the_prefix_there(direct):
    keys, pages, items = prefix(seed=2)
    with StoreProcess(["--no-disk"]) as store:
        tier = RemoteTier([store.address])
        copier, pool = copier_and_pool(direct=direct)
        try:
            tier.put(items)
            tier.warm()
            where = tier.arena_pages(keys)
            where[4] = where[7]  # page 4 asked where page 7 lies: its key does not match
            targets = pool.allocate(N)
            assert copier.to_pool(keys, where, targets) == 4 and copier.refused == 1
            assert torch.equal(pool.gather(targets[:4]), pages[:4])
        finally:
            copier.close()
            tier.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_a_page_written_over_during_the_copy_ends_the_prefix_there(direct):
    """No lease: the pages are written over by another client's Puts between the refs and the
    copy. None of them may count as arrived."""
    keys, _, items = prefix(seed=3)
    _, _, filler = prefix(400, seed=4)  # more than the 1 MiB arena
    with StoreProcess(["--no-disk", "--ram", "1MiB", "--arena-lease", "0"]) as store:
        tier = RemoteTier([store.address])
        copier, pool = copier_and_pool(direct=direct)
        try:
            tier.put(items)
            tier.warm()
            where = tier.arena_pages(keys)
            assert all(w is not None for w in where)
            with StoreClient(store.address) as other:
                other.put(filler)
            assert copier.to_pool(keys, where, pool.allocate(N)) == 0
            assert copier.lost + copier.refused >= 1
        finally:
            copier.close()
            tier.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_load_through_the_cache_from_a_same_host_store_is_exact_and_counted(device):
    """The whole engine path: match, load, the bytes; read in place, so nothing is prefetched
    into staging. On a CPU pool pages are placed by `get_into`; on CUDA by DMA from the arena."""
    from tiered_cache.cache import TieredCache
    from tiered_cache.config import CacheConfig

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _, pages, items = prefix(seed=5)
    with StoreProcess(["--no-disk"]) as store:
        tier = RemoteTier([store.address])
        cache = TieredCache(SPEC, CacheConfig(device=device, pool_capacity=4 * N * SPEC.bytes_per_page,
                                              namespace="copy-5", host_capacity=4 * N * SPEC.bytes_per_page),
                            lower=[tier])
        try:
            tier.put(items)
            tier.warm()
            handle = cache.match(list(range(SPEC.page_size * N)))
            assert cache.prefetch(handle) is False  # read in place at load: staging would add a copy
            loaded = cache.load(handle)
            assert len(loaded) == N and torch.equal(cache.pool.gather(loaded).cpu(), pages)
            if device == "cuda":
                copier = cache.loader.arena_loads.copier
                assert copier is not None and (copier.copied, copier.lost, copier.refused) == (N, 0, 0)
            cache.release(handle)
            with StoreClient(store.address) as client:
                figures = client.stats().server
            # Read in place (refs from the server or from the arena's index): the server copied nothing.
            assert figures.shm_pages == figures.shm_pages_reused and tier.pages_from_lookup == N
        finally:
            cache.close()


@pytest.mark.gpu
def test_pages_go_from_the_arena_to_a_cuda_pool_by_dma_exactly():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    keys, pages, items = prefix(seed=6)
    with StoreProcess(["--no-disk"]) as store:
        tier = RemoteTier([store.address])
        copier, pool = copier_and_pool("cuda", chunk_pages=5)
        try:
            tier.put(items)
            tier.warm()
            where = tier.arena_pages(keys)
            assert copier.usable(where[0][0])
            targets = pool.allocate(N)[::-1].copy()
            assert copier.to_pool(keys, where, targets) == N
            assert torch.equal(pool.gather(targets).cpu(), pages)
            figures = copier.stats()  # the DMA ran from the registered map, timed on the stream
            assert (figures["registered"], figures["copied"]) == (1, N) and figures["copy_s"] > 0
        finally:
            copier.close()
            tier.close()


@pytest.mark.gpu
def test_pages_of_a_map_not_registered_are_staged_to_a_cuda_pool_exactly():
    """What a platform without read-only registration gets: pages copied and checked on threads
    into two pinned host chunks in turn, each DMA'd and scattered while the next fills (three
    chunks: the first host chunk is filled again once its DMA is done), after the caller's work."""
    from tiered_cache.device.copy_stream import CopyStream

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    run = CopyStream.run

    def slow_run(self, n, size, chunk, *args, **kwargs):  # each chunk's DMA starts 50 ms late
        def late(start, end):
            torch.cuda._sleep(50_000_000)
            chunk(start, end)

        return run(self, n, size, late, *args, **kwargs)

    keys, pages, items = prefix(seed=8)
    with StoreProcess(["--no-disk"]) as store, pytest.MonkeyPatch.context() as patch:
        # A host chunk filled again before its DMA read it would place the wrong pages: made likely.
        patch.setattr(CopyStream, "run", slow_run)
        tier = RemoteTier([store.address])
        copier, pool = copier_and_pool("cuda", chunk_pages=5, direct=False)
        try:
            tier.put(items)
            tier.warm()
            where = tier.arena_pages(keys)
            assert not copier.usable(where[0][0])
            targets = pool.allocate(N)[::-1].copy()
            # Work the caller queued on its stream before the load (here: late, then zeroing the
            # pool) must come before the copies, or it would wipe the pages they placed.
            torch.cuda._sleep(50_000_000)
            pool.kv.zero_()
            assert copier.to_pool(keys, where, targets) == N
            assert torch.equal(pool.gather(targets).cpu(), pages)
            figures = copier.stats()
            assert (figures["staged"], figures["registered"], figures["refused"]) == (N, 0, 0) and figures["copy_s"] > 0
        finally:
            copier.close()
            tier.close()


@pytest.mark.gpu
def test_two_copiers_share_one_registration_and_a_refused_one_leaves_no_error_behind():
    """Two caches reading one store: the map is registered once and stays so when the first
    copier closes. A registration the driver refuses (a bogus range) is answered, and the
    runtime's error it left is read off: torch's next kernel does not raise it."""
    from tiered_cache.device.arena_registry import cuda_registry

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    keys, pages, items = prefix(seed=7)
    with StoreProcess(["--no-disk"]) as store:
        tier = RemoteTier([store.address])
        (first, _), (second, pool) = copier_and_pool("cuda"), copier_and_pool("cuda")
        try:
            tier.put(items)
            tier.warm()
            where = tier.arena_pages(keys)
            assert first.usable(where[0][0]) and second.usable(where[0][0])
            assert cuda_registry(pool.device).held(where[0][0])
            first.close()  # the map stays registered for the other
            targets = pool.allocate(N)
            assert second.to_pool(keys, where, targets) == N
            assert torch.equal(pool.gather(targets).cpu(), pages)

            class Bogus:  # a range the driver cannot register
                size = 4096
                raw = None

                def on_close(self, callback: object) -> bool:
                    return True

                def address(self) -> int:
                    return 8

            assert cuda_registry(pool.device).ensure(Bogus()) != 0
            assert float((torch.ones(4, device="cuda") + 1).sum()) == 8.0  # no stale error raised here
        finally:
            second.close()
            tier.close()


@pytest.mark.parametrize("direct", [True, False], ids=["registered", "refused"])
@pytest.mark.parametrize("found", [N, 5, 0])
def test_the_cuda_load_path_run_on_the_cpu_takes_the_arena_then_stages_the_rest(found, direct, monkeypatch):
    """The CUDA path of `TieredCache.load` (`ArenaLoads.load`: pages DMA'd from the arena into
    device pages), run on a CPU pool that says it cannot take pages in place. Pages from the first
    one not in an arena come by the staged path; all are placed exactly, from the remote tier. A map the
    driver refused (`direct=False`) is still read in place, its pages staged by the copier."""
    from tiered_cache.cache import TieredCache
    from tiered_cache.config import CacheConfig

    _, pages, items = prefix(seed=7)
    with StoreProcess(["--no-disk"]) as store:
        tier = RemoteTier([store.address])
        cache = TieredCache(SPEC, CacheConfig(pool_capacity=4 * N * SPEC.bytes_per_page, namespace="copy-7",
                                              host_capacity=4 * N * SPEC.bytes_per_page), lower=[tier])
        try:
            tier.put(items)
            tier.warm()
            cache.loader.tier_loads.fills_pool = False  # as on CUDA
            cache.loader.arena_loads.copier = ArenaCopier(cache.pool, direct=direct)
            arena_pages = tier.arena_pages
            monkeypatch.setattr(tier, "arena_pages",  # pages past `found` not in the arena (a mock of that only)
                                lambda keys: [w if i < found else None for i, w in enumerate(arena_pages(keys))])
            handle = cache.match(list(range(SPEC.page_size * N)))
            assert cache.loader.arena_loads.direct(handle.plan)
            loaded = cache.load(handle)
            assert len(loaded) == N and torch.equal(cache.pool.gather(loaded), pages)
            copier = cache.loader.arena_loads.copier
            assert copier is not None and (copier.copied, copier.lost, copier.refused) == (found, 0, 0)
            assert copier.staged == (0 if direct else found)
            cache.release(handle)
        finally:
            cache.close()
