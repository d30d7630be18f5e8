"""The engine path: only written KV is cached, the request path never waits on the tiers below,
prefetch, residency, few copies, and the defects a careless engine found (issue 11 §6)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from kv_oracle import token_kv

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.errors import KVShapeError, PoolExhaustedError
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.ram import RamTier

SPEC = KVSpec("engine-path-test", 2, 2, 8, dtype=DType.FP32, page_size=4)
PAGE = SPEC.bytes_per_page


def make(pool_pages=16, host_pages=16, lower=None, **cfg) -> TieredCache:
    config = CacheConfig(pool_capacity=pool_pages * PAGE, host_capacity=host_pages * PAGE, malloc_tuning=False, **cfg)
    return TieredCache(SPEC, config, lower=lower)


class GatedTier(RamTier):
    """A real RAM blob tier whose puts wait until `gate` is set: a Redis or store that hangs."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.gate = threading.Event()
        self.lookups = 0
        self.gets = 0
        self.put_keys: list[bytes] = []

    def put(self, items):
        self.gate.wait(30)
        self.put_keys += [k for k, _ in items]
        return super().put(items)

    def contains(self, keys):
        self.lookups += 1
        return super().contains(keys)

    def get(self, keys):
        self.gets += 1
        return super().get(keys)


def run_with_deadline(fn, seconds=20.0):
    """Run `fn` on a thread; fail if it does not return in `seconds` (it must not block)."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} blocked on the request path"
    return result.get("value")


# --- §1: only written KV is cached --------------------------------------------------------------
def test_allocate_n_write_k_commit_serves_only_written_pages_to_another_instance(tmp_path):
    tokens = list(range(100, 140))  # 10 pages
    written = 22  # 5 full pages and 2 tokens of the 6th
    with StoreProcess(["--no-disk"]) as store:
        cfg = {"lower_tiers": ["remote"], "remote_addresses": [store.address], "write_policy": "write_through"}
        a = make(**cfg)
        h = a.match(tokens)
        a.allocate(h, len(tokens))
        a.pool.kv.normal_()  # stale garbage in every page, as after earlier requests
        a.write(h, token_kv(SPEC, tokens[:written]))
        with pytest.raises(ValueError, match="only 22 were written"):
            a.commit(h, tokens)
        with pytest.raises(ValueError, match="only 22 tokens of this handle were written"):
            a.commit(h, tokens, num_written=30)
        assert a.commit(h, tokens, num_written=written) == 20
        a.release(h)
        a.close()  # finishes the write-behind to the store
        b = make(**cfg)
        assert b.lookup(tokens) == 20
        n, kv = b.get(tokens)
        assert n == 20 and torch.equal(kv, token_kv(SPEC, tokens[:20]))
        b.close()


def test_mark_written_is_how_an_engine_writing_the_pool_itself_commits():
    c = make()
    tokens = list(range(16))
    h = c.match(tokens)
    pages = c.allocate(h, 16)
    slots = c.pool.slots(pages, 16)
    c.pool.write(slots[:8], token_kv(SPEC, tokens)[:, :, :8])  # the engine's own kernel
    assert c.commit(h, tokens, num_written=0) == 0  # nothing marked yet: nothing cached
    c.mark_written(h, 8)
    with pytest.raises(ValueError, match="would pass the 16 allocated"):
        c.mark_written(h, 9)
    assert c.commit(h, tokens, num_written=8) == 8
    c.release(h)
    n, kv = c.get(tokens)
    assert n == 8 and torch.equal(kv, token_kv(SPEC, tokens[:8]))
    c.check_integrity()


def test_load_after_allocate_is_refused():
    c = make()
    tokens = list(range(8))
    c.put(tokens, token_kv(SPEC, tokens))
    c.evict()
    h = c.match(tokens + [1, 2, 3, 4])
    c.allocate(h, 4)
    with pytest.raises(ValueError, match=r"load\(\) after allocate\(\)"):
        c.load(h)
    c.release(h)
    c.check_integrity()


# --- §3: the request path never waits on the tiers below ----------------------------------------
def test_put_and_commit_never_wait_for_a_hanging_lower_tier_and_a_full_queue_drops():
    below = GatedTier(1 << 20)
    c = make(pool_pages=4, host_pages=2, lower=[below], demotion_queue=1, write_policy="write_through")
    for i in range(8):  # every put demotes; the one writer job hangs, the queue of 1 fills, the rest drop
        tokens = list(range(i * 100, i * 100 + 8))
        assert run_with_deadline(lambda t=tokens: c.put(t, token_kv(SPEC, t))) == 8
    writer = c.stats().queue("lower-writer")
    assert c.stats().dropped_pages > 0 and writer.depth <= writer.capacity
    below.gate.set()
    assert c.flush(timeout=30)
    for i in range(8):  # whatever was dropped is a miss, never wrong bytes
        tokens = list(range(i * 100, i * 100 + 8))
        n, kv = c.get(tokens)
        assert torch.equal(kv, token_kv(SPEC, tokens[:n]))
    c.close()


def test_the_writer_stops_between_pages_while_a_request_is_in_progress(monkeypatch):
    """A request that arrives while the writer encodes a chunk waits for at most one page of it:
    the writer holds the GIL while it encodes, and gives the request its turn page by page."""
    import tiered_cache.cache.lower_writer as writer_module

    monkeypatch.setattr(writer_module, "YIELD_S", 5.0)  # no timeout ends the wait within the test
    below = GatedTier(1 << 20)
    below.gate.set()
    c = make(pool_pages=8, host_pages=8, lower=[below], write_policy="write_through")
    encoded: list[bytes] = []
    first = threading.Event()
    encode = c.core.writer._encode

    def encode_then_a_request_arrives(page, key):
        if not encoded:
            c.core.foreground.__enter__()  # a request starts while this chunk is being encoded
            first.set()
        encoded.append(key)
        return encode(page, key)

    monkeypatch.setattr(c.core.writer, "_encode", encode_then_a_request_arrives)
    tokens = list(range(16))  # 4 pages, one chunk
    c.put(tokens, token_kv(SPEC, tokens))
    assert first.wait(10)
    threading.Event().wait(0.2)
    assert len(encoded) == 1 and below.put_keys == [], "the writer went on while a request was in progress"
    c.core.foreground.__exit__(None, None, None)  # the request ends
    assert c.flush(timeout=30)
    assert len(encoded) == 4 and len(below.put_keys) == 4
    c.close()


def test_watermarks_demote_in_the_background():
    c = make(pool_pages=10, host_pages=32, high_watermark=0.5, low_watermark=0.2)
    for i in range(4):
        tokens = list(range(i * 100, i * 100 + 8))
        c.put(tokens, token_kv(SPEC, tokens))
    assert c.flush(timeout=30)
    usage = c.pool.usage()
    assert usage.used_pages <= 5, "the demoter should have brought the pool below the high watermark"
    assert c.stats().tier("host").demotions >= 3
    for i in range(4):
        tokens = list(range(i * 100, i * 100 + 8))
        n, kv = c.get(tokens)
        assert n == 8 and torch.equal(kv, token_kv(SPEC, tokens))
    c.check_integrity()
    c.close()


def test_residency_asks_below_once_per_load_and_never_re_puts():
    below = GatedTier(1 << 20)
    below.gate.set()
    c = make(pool_pages=4, host_pages=2, lower=[below], write_policy="write_through")
    tokens = list(range(16))
    c.put(tokens, token_kv(SPEC, tokens))
    c.flush()  # the write-through copy below is done
    c.evict()
    c.host.delete(list(c.host.index))  # only the tier below holds the pages now
    c.flush()
    below.lookups = below.gets = 0
    h = c.match(tokens)
    pages = c.load(h)
    assert len(pages) == 4 and below.lookups <= 1 and below.gets == 1
    c.release(h)
    c.evict()  # the pages go down again: host RAM, then below, which already holds them
    c.host.delete(list(c.host.index))
    c.put(list(range(500, 516)), token_kv(SPEC, list(range(500, 516))))
    c.flush()
    keys = c.core.keys("", tokens)
    assert sorted(below.put_keys.count(k) for k in keys) == [1, 1, 1, 1], "a page below was put again"
    c.close()


def test_prefetch_then_load_serves_the_same_bytes_and_release_cancels():
    below = RamTier(1 << 20)
    c = make(pool_pages=8, host_pages=2, lower=[below], max_prefetches=1)
    prompts = [list(range(i * 100, i * 100 + 16)) for i in range(3)]
    for p in prompts:
        c.put(p, token_kv(SPEC, p))
    c.flush()
    c.evict()
    c.flush()
    a, b = c.match(prompts[0]), c.match(prompts[1])
    assert a.available_pages == 4 and a.num_device_pages == 0
    assert c.prefetch(a) is True
    assert c.prefetch(b) in (True, False)  # one slot: declined unless a's prefetch already finished
    pages = c.load(a)
    assert torch.equal(c.pool.read_tokens(pages, 16), token_kv(SPEC, prompts[0]))
    c.release(b)  # cancels b's prefetch (if it started); nothing leaks
    c.release(a)
    h = c.match(prompts[2])
    c.prefetch(h)
    c.release(h)  # released before load: the staging buffer comes back, no lock is left
    assert c.tree.size_info().protected == 0
    c.check_integrity()
    c.close()


def test_a_page_from_below_is_copied_once_into_a_cpu_pool_with_or_without_a_prefetch(monkeypatch):
    # A load decodes each page straight into its own device page (the pool is memory on the CPU);
    # so does a prefetch, into device pages allocated for it that the load then adopts: no staging,
    # no second pass. Nothing is put into host RAM on the way up either way.
    below = RamTier(1 << 20)
    c = make(pool_pages=8, host_pages=2, lower=[below], write_policy="write_through")
    tokens = list(range(16))
    c.put(tokens, token_kv(SPEC, tokens))
    c.flush()
    pool_bytes = c.pool.kv.view(torch.uint8).numpy()
    copies: list[str] = []
    import tiered_cache.tiers.chain as chain_module

    real_decode, real_scatter, real_host_put = chain_module.decode_into, c.pool.scatter, c.host.put

    def decode(blob, spec, key, dest, **kwargs):
        copies.append("decode into pool" if np.shares_memory(dest, pool_bytes) else "decode into staging")
        return real_decode(blob, spec, key, dest, **kwargs)

    monkeypatch.setattr(chain_module, "decode_into", decode)
    monkeypatch.setattr(c.pool, "scatter", lambda *a, **k: (copies.append("scatter"), real_scatter(*a, **k))[1])
    monkeypatch.setattr(c.host, "put", lambda *a, **k: (copies.append("host"), real_host_put(*a, **k))[1])
    expected = {False: ["decode into pool"] * 4, True: ["decode into pool"] * 4}
    for prefetch in (False, True):
        c.evict()
        c.host.delete(list(c.host.index))
        c.flush()
        copies.clear()
        h = c.match(tokens)
        assert h.plan == [0] * 4  # every page below, none in host RAM
        if prefetch:
            assert c.prefetch(h)
        pages = c.load(h)
        assert len(pages) == 4 and h.sources[below.name] == 4
        assert copies == expected[prefetch], prefetch
        assert torch.equal(c.pool.read_tokens(pages, 16), token_kv(SPEC, tokens))
        c.release(h)
        c.check_integrity()
    c.close()


# --- §6: defects found by trying it as a careless engine would -----------------------------------
def test_get_of_a_prefix_longer_than_the_pool_loads_what_fits():
    c = make(pool_pages=4, host_pages=16)
    tokens = list(range(32))  # 8 pages, the pool has 4
    assert c.put(tokens, token_kv(SPEC, tokens)) == 16  # the leading pages that fit
    c.evict()
    assert c.lookup(tokens) == 16
    n, kv = c.get(tokens)
    assert n == 16 and torch.equal(kv, token_kv(SPEC, tokens[:16]))
    c.check_integrity()


def test_load_while_every_device_page_is_locked_reports_what_it_could_load():
    c = make(pool_pages=4, host_pages=16, high_watermark=1.0)  # no background demotion: the pool stays full
    a, b = list(range(16)), list(range(100, 116))
    c.put(a, token_kv(SPEC, a))
    c.evict()
    c.put(b, token_kv(SPEC, b))
    hold = c.match(b)  # locks all 4 device pages
    h = c.match(a)
    assert h.available_pages == 4
    pages = c.load(h)  # no room at all: nothing loaded, nothing raised
    assert len(pages) == 0
    c.release(h)
    n, kv = c.get(a)  # get() needs no room in the pool: host RAM's rows go straight into the tensor
    assert n == 16 and torch.equal(kv, token_kv(SPEC, a))
    assert c.pool.usage().used_pages == 4 and len(c.load(c.match(a))) == 0
    c.release(hold)
    n, kv = c.get(a)
    assert n == 16 and torch.equal(kv, token_kv(SPEC, a))
    c.check_integrity()


@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_unusable_kv_is_refused_before_any_page_is_allocated(kind):
    c = make(pool_pages=8)
    tokens = list(range(8))
    good = token_kv(SPEC, tokens)
    bad = torch.empty(SPEC.kv_shape(8), dtype=torch.float32, device="meta") if kind == "meta" else good.to_sparse()
    for _ in range(8):
        with pytest.raises(KVShapeError):
            c.put(tokens, bad)
    assert c.pool.usage().used_pages == 0
    assert c.put(tokens, good) == 8
    c.check_integrity()


def test_foreign_and_released_handles_are_refused():
    a, b = make(), make()
    tokens = list(range(8))
    a.put(tokens, token_kv(SPEC, tokens))
    h = a.match(tokens)
    for call in (lambda: b.release(h), lambda: b.load(h), lambda: b.allocate(h, 4), lambda: b.commit(h, tokens)):
        with pytest.raises(ValueError, match="another TieredCache"):
            call()
    b.check_integrity()
    a.release(h)
    with pytest.raises(ValueError, match="already released"):
        a.release(h)
    with pytest.raises(ValueError, match="already released"):
        a.allocate(h, 1)
    a.check_integrity()


def test_allocate_refuses_nonsense_and_reports_exhaustion_without_changes():
    c = make(pool_pages=2)
    h = c.match(list(range(4)))
    with pytest.raises(ValueError, match="non-negative"):
        c.allocate(h, -1)
    with pytest.raises(PoolExhaustedError):
        c.allocate(h, 100)
    assert c.pool.usage().used_pages == 0 and h.own_pages == []
    c.release(h)


# --- thread safety ------------------------------------------------------------------------------
def test_eight_threads_share_one_cache_and_every_byte_is_right():
    below = RamTier(64 * (PAGE + 512))
    c = make(pool_pages=12, host_pages=8, lower=[below], high_watermark=0.8, low_watermark=0.5)
    prefixes = [list(range(i * 1000, i * 1000 + 12)) for i in range(4)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(120):
                base = prefixes[rng.integers(len(prefixes))]
                tokens = base + rng.integers(0, 3, size=int(rng.integers(0, 9))).tolist()
                choice = rng.integers(3)
                if choice == 0:
                    c.put(tokens, token_kv(SPEC, tokens))
                elif choice == 1:
                    n, kv = c.get(tokens)
                    assert torch.equal(kv, token_kv(SPEC, tokens[:n])), "wrong KV under concurrency"
                else:
                    h = c.match(tokens)
                    try:
                        if rng.integers(2):
                            c.prefetch(h)
                        pages = c.load(h)
                        assert torch.equal(c.pool.read_tokens(pages, len(pages) * SPEC.page_size),
                                           token_kv(SPEC, tokens[:len(pages) * SPEC.page_size]))
                        rest = len(tokens) - h.prefix_tokens
                        try:
                            c.allocate(h, rest)
                        except PoolExhaustedError:
                            continue
                        c.write(h, token_kv(SPEC, tokens)[:, :, h.prefix_tokens:])
                        c.commit(h, tokens)
                    finally:
                        c.release(h)
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and not stop.is_set():
        c.check_integrity()
        stop.wait(0.05)
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    assert c.flush(timeout=30)
    c.check_integrity()
    assert c.tree.size_info().protected == 0
    c.close()


def test_get_into_a_reused_output_tensor():
    c = make()
    tokens = list(range(14))  # 3 full pages and 2 tokens
    c.put(tokens, token_kv(SPEC, tokens))
    out = torch.full(SPEC.kv_shape(14), -7.0)
    n, kv = c.get(tokens, out=out)
    assert n == 12 and kv.data_ptr() == out.data_ptr() and torch.equal(kv, token_kv(SPEC, tokens[:12]))
    assert (out[:, :, 12:] == -7.0).all()  # past the cached prefix nothing is written
    with pytest.raises(KVShapeError, match="out has shape"):
        c.get(tokens, out=torch.empty(SPEC.kv_shape(10)))
    c.check_integrity()


def test_get_without_out_hands_over_a_spare_faulted_in_ahead_and_never_shares_it():
    # Pages large enough for the spare (it skips outputs under 4 MiB, which fault in cheaply).
    spec = KVSpec("spare-output-test", 4, 4, 64, dtype=DType.FP32, page_size=64)  # 512 KiB pages
    n = 16 * spec.page_size  # an 8 MiB result
    kv = torch.randn(spec.kv_shape(n), generator=torch.Generator().manual_seed(3))
    tokens = list(range(n))
    with TieredCache(spec, CacheConfig(pool_capacity=32 * spec.bytes_per_page, host_capacity=32 * spec.bytes_per_page,
                                       malloc_tuning=False)) as cache:
        assert cache.put(tokens, kv) == n
        got, first = cache.get(tokens)
        assert got == n and torch.equal(first, kv)
        cache.spare.flush(10)  # the spare for the next get of this size is ready
        _, second = cache.get(tokens)
        assert cache.spare.taken == 1
        assert torch.equal(second, kv)
        assert second.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
        first.zero_()  # the caller owns what it got: changing it changes nothing else
        cache.spare.flush(10)
        _, third = cache.get(tokens)
        assert torch.equal(second, kv) and torch.equal(third, kv) and cache.spare.taken == 2
        assert third.untyped_storage().data_ptr() not in {first.untyped_storage().data_ptr(),
                                                          second.untyped_storage().data_ptr()}
        # A smaller get does not take a spare sized for the larger one (it would hold memory it needs not).
        _, part = cache.get(tokens[:n // 2])
        assert torch.equal(part, kv[:, :, :n // 2]) and cache.spare.taken == 2
    with TieredCache(spec, CacheConfig(pool_capacity=32 * spec.bytes_per_page, spare_output=False,
                                       malloc_tuning=False)) as plain:
        assert plain.spare is None
        plain.put(tokens, kv)
        assert torch.equal(plain.get(tokens)[1], kv)


def test_a_new_caches_first_gets_share_the_spare_its_warm_up_faulted_in():
    """Before any get there is no last size: the warm-up faults in a quarter of the pool, and the
    first gets each take the front of what is left (their bytes apart), until it runs short."""
    spec = KVSpec("spare-output-test", 4, 4, 64, dtype=DType.FP32, page_size=64)  # 512 KiB pages
    kv = torch.randn(spec.kv_shape(8 * spec.page_size), generator=torch.Generator().manual_seed(4))
    tokens = list(range(8 * spec.page_size))
    with TieredCache(spec, CacheConfig(pool_capacity=64 * spec.bytes_per_page, host_capacity=64 * spec.bytes_per_page,
                                       malloc_tuning=False)) as cache:  # a 32 MiB pool: an 8 MiB first spare
        cache.spare.flush(10)
        cache.put(tokens, kv)
        _, first = cache.get(tokens[:4 * spec.page_size])  # 2 MiB
        _, second = cache.get(tokens)  # 4 MiB: 6 MiB were left
        assert cache.spare.taken == 2
        assert torch.equal(first, kv[:, :, :4 * spec.page_size]) and torch.equal(second, kv)
        first.fill_(7.0)  # apart: writing one changes nothing in the other
        assert torch.equal(second, kv)
        # 2 MiB were left, too little to keep: the next spare is the last size's own.
        cache.spare.flush(10)
        _, third = cache.get(tokens)
        assert cache.spare.taken == 3 and torch.equal(third, kv)
        assert third.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()


def test_a_prefetch_released_before_its_load_gives_its_device_pages_back():
    # On a CPU pool a prefetch fills device pages of its own: a handle released before `load`
    # (a request cancelled, preempted) must not leak them, nor leave them counted as being filled.
    below = RamTier(1 << 20)
    c = make(pool_pages=8, host_pages=2, lower=[below], write_policy="write_through")
    tokens = list(range(16))
    c.put(tokens, token_kv(SPEC, tokens))
    c.flush()
    c.evict()
    c.host.delete(list(c.host.index))
    c.flush()
    free = c.pool.num_free
    h = c.match(tokens)
    assert c.prefetch(h)
    pending = h.prefetch
    assert pending is not None and pending.pages is not None and len(pending.pages) == 4
    c.release(h)
    pending.future.result(timeout=30)
    deadline = time.monotonic() + 30  # the pages are freed by the prefetch's end, on its thread
    while c.core.ledger.loose and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.pool.num_free == free and c.core.ledger.loose == 0
    c.check_integrity()
    again = c.match(tokens)  # the pages are still below, and load whole
    assert c.prefetch(again)
    assert torch.equal(c.pool.read_tokens(c.load(again), 16), token_kv(SPEC, tokens))
    c.release(again)
    c.close()
