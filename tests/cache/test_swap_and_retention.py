"""Preemption by swap and token retention at the cache's level, on synthetic KV whose bytes say
which tokens they belong to (kv_oracle): what survives a swap or a drop must be exactly the KV of
the tokens the sequence still has."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_oracle import token_kv

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.errors import PoolExhaustedError, SwapError
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.retention import HeavyHitter, SinkWindow

SPEC = KVSpec("swap-test", 2, 1, 4, dtype=DType.FP32, page_size=4)
PAGE = SPEC.bytes_per_page


def new_cache(pages: int = 16, host_pages: int = 8) -> TieredCache:
    cfg = CacheConfig(pool_capacity=pages * PAGE, host_capacity=host_pages * PAGE, malloc_tuning=False,
                      high_watermark=1.0, low_watermark=0.9)
    return TieredCache(SPEC, cfg, lower=[])


def running(cache: TieredCache, prefix: list[int], suffix: list[int]):
    """A request whose `prefix` is cached (committed) and whose `suffix` is written, private."""
    if prefix:
        first = cache.match(prefix)
        cache.allocate(first, len(prefix))
        cache.write(first, token_kv(SPEC, prefix))
        cache.commit(first, prefix)
        cache.release(first)
    handle = cache.match(prefix + suffix)
    cache.allocate(handle, len(prefix) + len(suffix) - handle.prefix_tokens)
    cache.write(handle, token_kv(SPEC, prefix + suffix)[:, :, handle.prefix_tokens:])
    return handle


def live_kv(cache: TieredCache, handle) -> torch.Tensor:
    return cache.pool.read_slots(cache.live_slots(handle))


def test_swap_out_frees_every_device_page_and_swap_in_restores_the_bytes_elsewhere():
    cache = new_cache()
    prefix, suffix = list(range(8)), [9, 9, 7, 7, 5, 3]
    handle = running(cache, prefix, suffix)
    before = list(handle.own_pages)
    assert cache.swap_out(handle) == 2
    assert handle.own_pages == [] and cache.stats().pool.swapped_pages == 2
    assert cache.tree.size_info().protected == 0  # its prefix is unlocked: evictable like any other
    cache.evict()  # the prefix goes down to host RAM while the request waits
    blocker = running(cache, [], [1, 2, 3, 4, 5, 6, 7, 8])  # takes the pages it had
    for call, args in ((cache.write, (token_kv(SPEC, [1])[:, :, :1],)), (cache.allocate, (1,)),
                       (cache.commit, (prefix,)), (cache.fork, (2,)), (cache.live_slots, ())):
        with pytest.raises(ValueError, match="swapped out"):
            call(handle, *args)
    own = cache.swap_in(handle)
    assert len(own) == 2 and handle.own_pages != before and cache.stats().pool.swapped_pages == 0
    assert handle.prefix_tokens == 8  # the prefix came back up from host RAM
    assert torch.equal(live_kv(cache, handle), token_kv(SPEC, prefix + suffix))
    cache.allocate(handle, 2)  # and the request carries on
    cache.write(handle, token_kv(SPEC, prefix + suffix + [4, 4])[:, :, -2:])
    assert cache.commit(handle, prefix + suffix + [4, 4]) == 8
    for h in (handle, blocker):
        cache.release(h)
    cache.check_integrity()
    cache.close()


def test_swap_out_into_full_host_ram_changes_nothing():
    cache = new_cache(host_pages=1)
    handle = running(cache, [], list(range(10)))
    pages, used = list(handle.own_pages), cache.pool.usage().used_pages
    with pytest.raises(SwapError, match="host RAM cannot hold this request's 3 pages"):
        cache.swap_out(handle)
    assert handle.own_pages == pages and handle.swapped is None and cache.pool.usage().used_pages == used
    assert torch.equal(live_kv(cache, handle), token_kv(SPEC, list(range(10))))
    cache.release(handle)
    cache.check_integrity()
    cache.close()


def test_swapped_requests_fill_host_ram_and_the_next_one_is_refused():
    cache = new_cache(host_pages=4)
    first = running(cache, [], list(range(8)))
    second = running(cache, [], list(range(20, 28)))
    third = running(cache, [], list(range(40, 44)))
    cache.swap_out(first)
    cache.swap_out(second)  # host RAM is now all swap space
    with pytest.raises(SwapError, match="0 of 4 rows free"):
        cache.swap_out(third)
    cache.release(first)  # a released swapped request gives its host slots back
    assert cache.stats().pool.swapped_pages == 2
    cache.swap_out(third)
    cache.swap_in(second)
    assert torch.equal(live_kv(cache, second), token_kv(SPEC, list(range(20, 28))))
    for h in (second, third):
        cache.release(h)
    assert cache.stats().pool.swapped_pages == 0 and cache.host.rows.num_free == 4
    cache.check_integrity()
    cache.close()


def test_swap_in_without_room_or_without_its_prefix_leaves_it_swapped():
    cache = new_cache(pages=4, host_pages=2)
    handle = running(cache, [], list(range(6)))
    cache.swap_out(handle)
    hog = cache.match([7] * 16)
    cache.allocate(hog, 16)  # every device page, none evictable
    with pytest.raises(PoolExhaustedError):
        cache.swap_in(handle)
    assert handle.swapped is not None and cache.stats().pool.swapped_pages == 2
    cache.release(hog)
    cache.swap_in(handle)
    assert torch.equal(live_kv(cache, handle), token_kv(SPEC, list(range(6))))
    cache.release(handle)

    lost = running(cache, list(range(8)), [1, 2])  # a prefix of 2 pages, then 1 private page
    cache.swap_out(lost)  # host RAM: 1 swap slot, 1 left for cached pages
    cache.evict()  # its prefix pages: one fits in host RAM, the other has nowhere to go (no tier below)
    with pytest.raises(SwapError, match="no longer cached"):
        cache.swap_in(lost)
    assert lost.swapped is not None
    cache.release(lost)
    cache.check_integrity()
    cache.close()


def test_drop_tokens_frees_dead_pages_and_keeps_the_rest_exact():
    cache = new_cache()
    prefix, suffix = list(range(4)), list(range(100, 114))  # 1 prefix page, then 14 own tokens (4 pages)
    handle = running(cache, prefix, suffix)
    with pytest.raises(ValueError, match="shared prefix"):
        cache.drop_tokens(handle, [2])
    with pytest.raises(ValueError, match="past the 18 live"):
        cache.drop_tokens(handle, [18])
    assert cache.drop_tokens(handle, [5, 6]) == 0  # holes in a page: nothing to free yet
    # Live now: the prefix, own tokens 0, 3, 4, 5, ...; dropping 0, 3, 4, 5 empties own page 0.
    assert cache.drop_tokens(handle, [4, 5, 6, 7]) == 1
    live = [*range(4), *range(10, 18)]  # the prefix, then own tokens 6..13
    assert torch.equal(live_kv(cache, handle), token_kv(SPEC, prefix + suffix)[:, :, live])
    assert len(cache.live_slots(handle)) == len(live)
    assert handle.compacted and len(handle.own_pages) == 3
    with pytest.raises(ValueError, match="compacted"):
        cache.commit(handle, prefix + suffix)
    assert cache.tree.size_info().total == 1  # only the prefix, committed before
    cache.release(handle)
    cache.check_integrity()
    cache.close()


def test_scattered_drops_are_repacked_into_fewer_pages():
    cache = new_cache()
    tokens = list(range(50, 66))  # 4 full own pages
    handle = running(cache, [], tokens)
    drop = [1, 2, 3, 5, 6, 7, 9, 10, 11]  # keep one token in each of the first three pages
    cache.drop_tokens(handle, drop)
    keep = [i for i in range(16) if i not in drop]
    assert len(handle.own_pages) == 2  # 7 live tokens repacked into 2 pages
    assert torch.equal(live_kv(cache, handle), token_kv(SPEC, tokens)[:, :, keep])
    assert cache.stats().pool.compacted_pages == 2
    cache.release(handle)
    assert cache.pool.usage().used_pages == 0
    cache.check_integrity()
    cache.close()


def test_a_fork_of_a_compacted_sequence_drops_on_its_own():
    cache = new_cache()
    tokens = list(range(12))
    handle = running(cache, [], tokens)
    cache.drop_tokens(handle, [0, 1, 2, 3])
    (fork,) = cache.fork(handle, 1)
    cache.drop_tokens(fork, [0, 1, 2, 3])  # live 4..7 of the fork: its own copy of that page goes
    assert torch.equal(live_kv(cache, handle), token_kv(SPEC, tokens)[:, :, 4:])
    assert torch.equal(live_kv(cache, fork), token_kv(SPEC, tokens)[:, :, 8:])
    cache.check_integrity()
    for h in (handle, fork):
        cache.release(h)
    assert cache.pool.usage().used_pages == 0
    cache.close()


def test_sink_window_drops_the_middle_only():
    policy = SinkWindow(sink=2, window=3)
    positions = np.arange(10)
    assert policy.to_drop(positions, fixed=0).tolist() == [2, 3, 4, 5, 6]
    assert policy.to_drop(positions, fixed=4).tolist() == [4, 5, 6]  # a shared prefix stays
    assert policy.to_drop(np.array([0, 1, 7, 8, 9, 10]), fixed=0).tolist() == [2]  # the one that left
    assert SinkWindow(4, 100).to_drop(positions, 0).size == 0
    for bad in ({"sink": -1, "window": 3}, {"sink": 4, "window": 0}):
        with pytest.raises(ValueError, match="SinkWindow needs"):
            SinkWindow(**bad)


def test_heavy_hitter_keeps_the_most_attended_and_the_recent():
    policy = HeavyHitter(budget=4, recent=2)
    positions = np.arange(8)
    scores = np.array([5.0, 0.1, 3.0, 0.2, 0.3, 9.0, 0.0, 0.0])
    assert policy.to_drop(positions, 0, scores).tolist() == [1, 2, 3, 4]  # keeps 0 and 5, and 6, 7
    assert policy.to_drop(positions, 5, scores).size == 0  # only 3 private tokens
    assert policy.to_drop(positions[:4], 0, scores[:4]).size == 0
    with pytest.raises(ValueError, match="one accumulated attention score per live token"):
        policy.to_drop(positions, 0, None)
    for bad in ({"budget": 0}, {"budget": 4, "recent": 5}):
        with pytest.raises(ValueError, match="HeavyHitter needs"):
            HeavyHitter(**bad)


def test_re_rotation_moves_a_key_to_its_new_position_exactly_as_the_model_would_rotate_it():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from tiered_cache.integrations.paged_attention import rotate_half

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, rope_theta=10000.0)
    rotary = LlamaRotaryEmbedding(config)
    raw = torch.randn(1, 1, 5, 32, dtype=torch.float64).float()
    written, now = torch.tensor([[40, 41, 42, 43, 44]]), torch.tensor([[7, 8, 9, 10, 11]])
    cos_w, sin_w = rotary(raw, written)
    cos_n, sin_n = rotary(raw, now)
    stored, _ = apply_rotary_pos_emb(raw, raw, cos_w, sin_w)
    expected, _ = apply_rotary_pos_emb(raw, raw, cos_n, sin_n)
    angles = (now - written)[0].float()[:, None] * rotary.inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    moved = stored * emb.cos() + rotate_half(stored) * emb.sin()
    assert torch.allclose(moved, expected, atol=1e-5)
    assert not torch.allclose(stored, expected, atol=1e-2)  # the positions really differ
