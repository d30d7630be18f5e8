"""The whole engine path with the page pool on a CUDA device (marked `gpu`: skipped without CUDA):
put KV that lives on the GPU, demote it (inline and by the background demoter) to pinned host
RAM and on to disk, and load it back with get, the paged API and prefetch. Every read is
compared bit for bit with what was put; the same workload runs on a CPU pool in
test_cache.py and test_cache_machine.py."""

import contextlib
import random

import pytest
import torch

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig, WritePolicy
from tiered_cache.model.spec import DType, KVSpec, Layout

pytestmark = pytest.mark.gpu
SPECS = [
    KVSpec("gpu-fp16", 3, 2, 64, DType.FP16, 4),
    KVSpec("gpu-bf16-hnd", 2, 4, 32, DType.BF16, 8, Layout.HND),
    KVSpec("gpu-odd", 2, 3, 5, DType.FP16, 3),
]


def _cache(spec, pool_pages, host_pages, tmp_path=None, **cfg):
    below = {"lower_tiers": ["disk"], "disk_path": str(tmp_path), "disk_fsync": False} if tmp_path else {}
    return TieredCache(spec, CacheConfig(device="cuda", pool_capacity=pool_pages * spec.bytes_per_page,
                                         host_capacity=host_pages * spec.bytes_per_page, **below, **cfg))


def _kv(spec, n, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(spec.kv_shape(n), generator=gen, device="cuda").to(spec.dtype.torch)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.model_id)
def test_random_workload_reads_back_exactly_what_was_put(spec, tmp_path):
    """Prompts sharing prefixes, a pool of 12 pages and host RAM of 16, disk below: most gets
    load pages from host RAM or disk. Each hit must equal the KV that was put."""
    rng = random.Random(spec.page_size)
    c = _cache(spec, pool_pages=12, host_pages=16, tmp_path=tmp_path, high_watermark=0.7, low_watermark=0.4)
    ps = spec.page_size
    base = _kv(spec, 8 * ps, seed=1)
    truth: dict[tuple[int, ...], torch.Tensor] = {}
    try:
        for i in range(40):
            shared = rng.randrange(0, 5) * ps  # a prefix of the common document
            n = shared + rng.randrange(1, 4) * ps + rng.randrange(ps)
            tokens = tuple(range(shared)) + tuple(range(10_000 * (i + 1), 10_000 * (i + 1) + n - shared))
            kv = torch.cat([base[:, :, :shared], _kv(spec, n - shared, seed=100 + i)], dim=2)
            c.put(list(tokens), kv)
            truth[tokens] = kv
            for probe in rng.sample(sorted(truth), min(3, len(truth))):
                want = truth[probe]
                got_n, got = c.get(list(probe))
                assert got.device.type == "cuda"
                assert torch.equal(got, want[:, :, :got_n]), f"prompt {i}: wrong KV for a {got_n}-token hit"
        c.flush(timeout=60)
        st = c.stats()
        assert st.tier("device").evictions > 0 and st.tier("host").loads > 0
        c.check_integrity()
    finally:
        c.close()


def test_get_into_a_host_tensor_and_a_device_tensor(tmp_path):
    spec = SPECS[0]
    c = _cache(spec, pool_pages=4, host_pages=8, tmp_path=tmp_path, high_watermark=1.0)
    tokens, kv = list(range(16)), _kv(spec, 16, seed=3)
    try:
        c.put(tokens, kv)
        for i in range(3):  # push the prompt out of the pool
            c.put(list(range(1000 * (i + 1), 1000 * (i + 1) + 16)), _kv(spec, 16, seed=4 + i))
        handle = c.match(tokens)
        assert handle.num_device_pages == 0 and handle.available_pages == 4  # in host RAM or on disk
        c.release(handle)
        for device in ("cpu", "cuda"):
            out = torch.full(spec.kv_shape(16), float("nan"), device=device).to(spec.dtype.torch)
            n, got = c.get(tokens, out=out)
            assert n == 16 and got.device.type == device and torch.equal(got.cuda(), kv)
    finally:
        c.close()


def test_paged_api_prefetch_load_write_commit_on_the_device(tmp_path):
    spec = SPECS[1]
    c = _cache(spec, pool_pages=8, host_pages=16, tmp_path=tmp_path, high_watermark=1.0)
    ps = spec.page_size
    prompt, kv = list(range(4 * ps)), _kv(spec, 4 * ps, seed=7)
    try:
        c.put(prompt, kv)
        c.put(list(range(500, 500 + 8 * ps)), _kv(spec, 8 * ps, seed=8))  # evicts `prompt` to host RAM
        handle = c.match(prompt + [9, 9, 9])
        assert handle.num_device_pages == 0 and handle.available_pages == 4
        c.prefetch(handle)
        pages = c.load(handle)
        assert len(pages) == 4 and torch.equal(c.pool.read_tokens(pages, 4 * ps), kv)
        more = _kv(spec, ps, seed=9)
        c.allocate(handle, ps)
        c.write(handle, more)
        assert c.commit(handle, prompt + list(range(900, 900 + ps))) == ps
        c.release(handle)
        n, got = c.get(prompt + list(range(900, 900 + ps)))
        assert n == 5 * ps and torch.equal(got, torch.cat([kv, more], dim=2))
        c.check_integrity()
    finally:
        c.close()


def test_write_through_and_background_demotion_copy_finished_kv(tmp_path):
    """Puts back to back (no synchronize) while the demoter and the write-through copy run on
    their own threads: what is written into host RAM and on disk is the KV that was put."""
    spec = SPECS[0]
    c = _cache(spec, pool_pages=16, host_pages=64, tmp_path=tmp_path, write_policy=WritePolicy.WRITE_THROUGH,
               high_watermark=0.5, low_watermark=0.25)
    eye = torch.eye(spec.head_dim, device="cuda", dtype=spec.dtype.torch)
    # kv @ eye == kv, computed on the stream just before the put: the copies must wait for it.
    prompts = [(list(range(1000 * i, 1000 * i + 4 * spec.page_size)), _kv(spec, 4 * spec.page_size, seed=i) @ eye)
               for i in range(12)]
    try:
        for tokens, kv in prompts:
            c.put(tokens, kv)
        assert c.flush(timeout=60)
        c.evict()  # the device pool empties: every read below comes from host RAM or disk
        for tokens, kv in prompts:
            n, got = c.get(tokens)
            assert n == len(tokens) and torch.equal(got, kv)
        assert c.stats().tier("disk").pages > 0
    finally:
        c.close()


def test_kv_written_on_a_side_stream_is_copied_down_only_once_written(tmp_path):
    """An engine writes KV on a stream of its own, busy for a while, and puts it with write-through:
    the background demoter's copies (from its own thread, whose stream is the default one) must
    wait for those writes, so host RAM and disk get the KV, not the pool's old bytes."""
    spec = LARGE_PAGES
    c = _cache(spec, pool_pages=32, host_pages=64, tmp_path=tmp_path, write_policy=WritePolicy.WRITE_THROUGH)
    prompt = list(range(8 * spec.page_size))
    kv = _kv(spec, len(prompt), seed=21)
    try:
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(BUSY)  # the engine's stream is busy: the put's writes queue behind it
            c.put(prompt, kv)
        assert len(c.demoter.writers) == 1  # the put marked its stream
        assert c.flush(timeout=60)
        side.synchronize()
        c.evict()  # from here every read comes from host RAM
        n, got = c.get(prompt)
        assert n == len(prompt) and torch.equal(got, kv)
    finally:
        c.close()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.model_id)
def test_forks_copy_on_write_and_swap_on_a_cuda_pool(spec):
    """The engine features with the pool on the GPU: a fork's first write copies the shared page
    with the copy kernel; a swap goes through pinned host RAM and back into other pages."""
    c = _cache(spec, pool_pages=16, host_pages=8)
    ps = spec.page_size
    n = 2 * ps + 1  # the last page is partly written: shared by the forks
    kv = _kv(spec, n + 2, seed=7)
    try:
        parent = c.match(list(range(n)))
        c.allocate(parent, n)
        c.write(parent, kv[:, :, :n])
        forks = c.fork(parent, 2)
        for i, fork in enumerate(forks):
            c.allocate(fork, 1)
            c.write(fork, _kv(spec, 1, seed=20 + i))
        assert c.stats().pool.cow_copies == 2 and c.stats().pool.used_pages == 3 + 2
        for i, fork in enumerate(forks):
            pages = fork.own_pages
            got = c.pool.read_tokens(pages, n + 1)
            assert torch.equal(got[:, :, :n], kv[:, :, :n]) and torch.equal(got[:, :, n:], _kv(spec, 1, seed=20 + i))
        assert torch.equal(c.pool.read_tokens(parent.own_pages, n), kv[:, :, :n])  # untouched by the forks
        before = list(parent.own_pages)
        c.swap_out(parent)
        blocker = c.match([99] * (3 * ps))
        c.allocate(blocker, 3 * ps)  # takes the pages it had
        c.swap_in(parent)
        assert parent.own_pages != before and torch.equal(c.pool.read_tokens(parent.own_pages, n), kv[:, :, :n])
        for h in (parent, blocker, *forks):
            c.release(h)
        c.check_integrity()
    finally:
        c.close()


LARGE_PAGES = KVSpec("gpu-large-pages", 16, 8, 128, DType.FP16, 16)  # 1 MiB pages: a load's DMA takes a while
BUSY = 2_000_000_000  # GPU cycles of `torch.cuda._sleep`: the stream stays busy, copies queued behind it


@contextlib.contextmanager
def _in_host_ram(n, pool_pages, host_pages, seed):
    """A cache of `LARGE_PAGES` whose prompt of `n` pages is in host RAM only, with the pool zeroed,
    after one load of it: the small pinned uploads a load makes are then cached, so the next load
    queues its copies without waiting for the device. Yields (cache, prompt, its KV)."""
    spec = LARGE_PAGES
    c = _cache(spec, pool_pages=pool_pages, host_pages=host_pages)
    prompt, kv = list(range(n * spec.page_size)), _kv(spec, n * spec.page_size, seed=seed)
    try:
        c.put(prompt, kv)
        c.evict()
        assert c.flush(timeout=60)
        handle = c.match(prompt)
        c.load(handle)
        c.release(handle)
        c.evict()  # still in host RAM: the device pages are just dropped
        assert c.flush(timeout=60)
        c.pool.kv.zero_()  # the free pages the next load gets held this KV: a read too early must see zeros
        torch.cuda.synchronize()
        yield c, prompt, kv
    finally:
        c.close()


def test_a_host_hit_whose_slots_are_reused_at_once_still_loads_the_old_kv():
    """On CUDA `load` returns once the host RAM -> pool copies are queued. Writing new pages into
    the very slots they read, straight after, must wait for them (the slab's fence): the pool
    then holds the prefix's KV, not the new pages'."""
    n = 128
    with _in_host_ram(n, pool_pages=2 * n + 8, host_pages=n, seed=11) as (c, prompt, kv):
        assert c.stats().tier("host").pages == n
        other = torch.randn(LARGE_PAGES.staging_shape(n)).to(LARGE_PAGES.dtype.torch)
        keys = [bytes([7]) * 31 + i.to_bytes(1, "big") for i in range(n)]
        handle = c.match(prompt)
        torch.cuda._sleep(BUSY)  # the stream is busy: the load's copies wait behind it
        pages = c.load(handle)
        assert not c.core.host_loads.last.finished()  # load returned with its copies still queued
        with c.core.lock:  # what a demotion into host RAM does, on the slots just read
            c.host.put(keys, other)
        assert c.host.contains_prefix(handle.keys) == 0  # every slot of the prefix was reused
        assert torch.equal(c.pool.read_tokens(pages, len(prompt)), kv)
        c.release(handle)
        c.check_integrity()


def test_a_demotion_into_slots_still_being_read_does_not_overwrite_them():
    """A load from host RAM returns with its copies queued behind a busy stream; demoting other
    pages at once into the very slots it reads (host RAM holds only the prefix) must be written only after
    the load read them."""
    n = 64
    with _in_host_ram(n, pool_pages=3 * n + 8, host_pages=n, seed=13) as (c, prompt, kv):
        handle = c.match(prompt)
        torch.cuda._sleep(BUSY)
        pages = c.load(handle)
        assert not c.core.host_loads.last.finished()
        other = list(range(10**6, 10**6 + n * LARGE_PAGES.page_size))
        c.put(other, _kv(LARGE_PAGES, len(other), seed=14))
        with c.core.lock:  # inline, as a request short of device pages does: every prefix slot reused
            c.demoter.demote_now(c.tree.evict(n))  # the prefix's nodes are locked by the handle
        assert c.host.contains_prefix(handle.keys) == 0
        assert torch.equal(c.pool.read_tokens(pages, len(prompt)), kv)
        c.release(handle)
        c.check_integrity()


def test_a_device_hit_on_another_stream_waits_for_pages_still_arriving():
    """Pages loaded from host RAM are in the tree while their copies still run (queued behind a
    busy stream here). Another request, on a stream of its own, that matches them as a device
    hit must read them only after they arrived."""
    n = 64
    with _in_host_ram(n, pool_pages=2 * n, host_pages=2 * n, seed=12) as (c, prompt, kv):
        first = c.match(prompt)
        torch.cuda._sleep(BUSY)
        c.load(first)
        assert not c.core.host_loads.last.finished()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            second = c.match(prompt)
            assert second.num_device_pages == n  # a device hit: nothing to load
            got = c.pool.read_tokens(c.load(second), len(prompt))
        side.synchronize()
        assert torch.equal(got, kv)
        c.release(second)
        c.release(first)


def test_pages_still_filling_when_evicted_come_back_to_the_pool_for_the_next_allocation():
    """`get` releases its pages while their copies from host RAM may still run; they stay pinned
    until the copies end. A put that needs the whole pool right after must still get it (the
    copies are waited for), not fail as if the pool were full."""
    n = 32
    with _in_host_ram(n, pool_pages=n, host_pages=2 * n, seed=13) as (c, prompt, kv):
        other = list(range(10**6, 10**6 + len(prompt)))
        other_kv = _kv(LARGE_PAGES, len(prompt), seed=14)
        torch.cuda._sleep(BUSY)
        got_n, got = c.get(prompt)
        assert got_n == len(prompt) and not c.core.host_loads.last.finished()
        assert c.put(other, other_kv) == len(other)
        assert torch.equal(got, kv)
        c.check_integrity()


def test_a_host_hit_from_match_to_reading_its_pages_never_makes_the_host_wait_for_the_device():
    """The overlap of a load with the forward rests on nothing between `match` and the forward
    synchronizing (one blocking upload would make the host wait for the copies): torch's sync
    debug mode turns any such call into an error."""
    n = 32
    with _in_host_ram(n, pool_pages=2 * n, host_pages=2 * n, seed=15) as (c, prompt, kv):
        torch.cuda.set_sync_debug_mode("error")
        try:
            handle = c.match(prompt)
            got = c.pool.read_tokens(c.load(handle), len(prompt))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got, kv)
        c.release(handle)
