"""The correctness canary (cache/canary.py): hits recomputed off the request path and compared
with the reused KV. A real disk tier made to lie (its page files hold valid blobs, right key and
checksum, of other KV) is caught, quarantined for the namespace, and never reused from again;
an honest tier is not. A random-weight model of the tiny Llama shape, on the CPU."""

from __future__ import annotations

import threading

import pytest
import torch

from tiered_cache.bench.gpu_model import load_random_model
from tiered_cache.cache import TieredCache
from tiered_cache.cache.canary import Canary, pages_differ
from tiered_cache.config import CacheConfig
from tiered_cache.index.keys import PageKeyer
from tiered_cache.integrations.transformers import generate, spec_for
from tiered_cache.tiers.disk import DiskTier
from tiered_cache.wire.codec import encode_page

PROMPT, PAGES = 200, 12  # 12 whole pages of 16 reused


@pytest.fixture(scope="module")
def tiny():
    model = load_random_model("tiny", "cpu", torch.float32, 1024).model
    ids = torch.randint(0, model.config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(11)).tolist()
    return model, spec_for(model, "fp16", page_size=16, model_id="tiny-canary"), ids


def config(tmp_path, **settings):
    return CacheConfig(pool_capacity=2**22, host_capacity=2**22, lower_tiers=["disk"], disk_path=str(tmp_path / "disk"),
                       disk_capacity=2**26, write_policy="write_through", namespace="tenant", **settings)


def write_prompt(model, spec, ids, tmp_path):
    with TieredCache(spec, config(tmp_path)) as writer:
        generate(model, ids, writer, 1)
        assert writer.flush(30)


def test_a_tier_that_lies_is_caught_quarantined_and_not_reused_from_again(tiny, tmp_path):
    model, spec, ids = tiny
    write_prompt(model, spec, ids, tmp_path)
    keys = PageKeyer(spec, "tenant").keys(ids[:PAGES * spec.page_size])
    disk = DiskTier(tmp_path / "disk", 2**26)
    try:  # the lie: every page file a valid blob of other KV, under the right key
        other = torch.randn(spec.staging_shape(PAGES), generator=torch.Generator().manual_seed(5)).half()
        disk.delete(keys)
        assert disk.put([(key, encode_page(page, spec, key)) for key, page in zip(keys, other, strict=True)]) == PAGES
    finally:
        disk.close()
    plain = generate(model, ids, None, 4)
    with TieredCache(spec, config(tmp_path, verify_fraction=1.0)) as reader:
        fooled = generate(model, ids, reader, 4)
        assert fooled.sources.get("disk") == PAGES * spec.page_size  # checksums pass: it was reused
        assert reader.canary.wait(60)
        figures = reader.stats().canary
        assert (figures.checks, figures.mismatches, figures.pages_wrong) == (1, 1, PAGES)
        assert figures.quarantined == {"tenant": ["disk"]} and reader.canary.quarantined("other") == frozenset()
        assert reader.stats().to_dict()["canary"]["mismatches"] == 1
        again = generate(model, ids, reader, 4)
        assert again.reused_tokens == 0 and again.tokens == plain.tokens
        reader.canary.clear()  # the operator lifts the quarantine: the pages found wrong stay unused
        assert reader.stats().canary.quarantined == {}
        assert generate(model, ids, reader, 4).reused_tokens == 0


def test_an_honest_tier_passes_the_canary_and_stays_in_use(tiny, tmp_path):
    model, spec, ids = tiny
    write_prompt(model, spec, ids, tmp_path)
    with TieredCache(spec, config(tmp_path, verify_fraction=1.0)) as reader:
        hit = generate(model, ids, reader, 4)
        assert hit.sources.get("disk") == PAGES * spec.page_size
        assert reader.canary.wait(60)
        figures = reader.stats().canary
        assert (figures.checks, figures.mismatches, figures.quarantined) == (1, 0, {})
        assert figures.pages_checked == PAGES
        assert generate(model, ids, reader, 4).reused_tokens == PAGES * spec.page_size


def test_a_share_of_hits_is_checked_evenly_and_a_busy_canary_drops_and_counts():
    canary = Canary(0.25)
    assert [canary.due() for _ in range(8)] == [False, False, False, True] * 2
    assert not any(Canary(0.0).due() for _ in range(10))
    release = threading.Event()
    try:
        assert canary.submit(release.wait)  # running
        assert canary.wait(0.05) is False
        started = [canary.submit(lambda: None) for _ in range(3)]  # one waits, the rest are dropped
        assert started.count(True) >= 1 and canary.stats().dropped == started.count(False) >= 1
    finally:
        release.set()
    assert canary.wait(10)
    canary.close()
    with pytest.raises(ValueError, match="verify_fraction"):
        CacheConfig(verify_fraction=1.5)


def test_pages_differ_beyond_noise_only():
    fresh = torch.randn(2, 2, 48, 2, 8, generator=torch.Generator().manual_seed(1))
    noisy = fresh.half().float()  # what fp16 storage does to it
    wrong = noisy.clone()
    wrong[:, :, 16:32] = torch.randn(2, 2, 16, 2, 8, generator=torch.Generator().manual_seed(2))
    assert pages_differ(noisy, fresh, 16) == [False, False, False]
    assert pages_differ(wrong, fresh, 16) == [False, True, False]


def test_a_quarantined_tier_is_not_loaded_from_for_any_page_of_its_namespace(tiny, tmp_path):
    _, spec, _ = tiny
    tokens = list(range(5000, 5000 + 4 * spec.page_size))
    kv = torch.randn(spec.kv_shape(len(tokens)), generator=torch.Generator().manual_seed(3)).half()
    with TieredCache(spec, config(tmp_path)) as cache:
        cache.put(tokens, kv)
        assert cache.flush(30)
        cache.evict()
        cache.host.delete(list(cache.host.index))  # only the disk holds the pages now
        assert cache.lookup(tokens) == len(tokens)
        cache.canary.record("tenant", [b"\0" * 32], ["disk"], [True])  # another prompt's page was wrong
        assert cache.lookup(tokens) == 0 and cache.lookup(tokens, namespace="other") == 0  # other: never put
        handle = cache.match(tokens)
        assert handle.prefix_tokens == 0
        cache.release(handle)
        cache.canary.clear(tier="disk")
        assert cache.lookup(tokens) == len(tokens)


def test_the_canary_line_says_what_was_checked_and_quarantined():
    from tiered_cache.report.tree import canary_line

    canary = Canary(0.01)
    canary.record("tenant", [b"\1" * 32, b"\2" * 32], ["disk", "disk"], [True, False])
    line = canary_line(canary.stats().to_dict())
    assert "1% of hits" in line and "1 checked, 1 wrong (1 pages)" in line and "quarantined: tenant: disk" in line
    assert canary_line(Canary(0.0).stats().to_dict()) == ""


def _held_in_host_and_on_disk(cache, spec):
    tokens = list(range(7000, 7000 + 4 * spec.page_size))
    kv = torch.randn(spec.kv_shape(len(tokens)), generator=torch.Generator().manual_seed(4)).half()
    cache.put(tokens, kv)
    assert cache.flush(30)
    cache.evict()  # now in host RAM, and on disk (written through)
    return tokens


def test_a_page_looked_for_again_is_not_read_from_a_quarantined_tier(tiny, tmp_path):
    """Planned from host RAM, gone from it before the load (demoted meanwhile): the load looks
    for the rest below again, and must skip the disk quarantined for this namespace there too."""
    _, spec, _ = tiny
    with TieredCache(spec, config(tmp_path)) as cache:
        tokens = _held_in_host_and_on_disk(cache, spec)
        cache.canary.record("tenant", [b"\0" * 32], ["disk"], [True])
        handle = cache.match(tokens)
        assert cache.page_sources(handle) == ["host"] * 4
        cache.host.delete(list(cache.host.index))
        try:
            assert len(cache.load(handle)) == 0 and handle.sources["disk"] == 0
        finally:
            cache.release(handle)


def test_the_canary_is_told_the_tier_a_page_was_read_from_not_the_one_planned(tiny, tmp_path):
    _, spec, _ = tiny
    with TieredCache(spec, config(tmp_path)) as cache:
        tokens = _held_in_host_and_on_disk(cache, spec)
        handle = cache.match(tokens)
        assert cache.page_sources(handle) == ["host"] * 4
        cache.host.delete(list(cache.host.index))
        try:
            assert len(cache.load(handle)) == 4
            assert cache.page_sources(handle) == ["disk"] * 4
        finally:
            cache.release(handle)
