"""The reuse policy: load a cached prefix only as far as it arrives sooner than it would be
recomputed (tiered_cache/cache/reuse.py). The estimators and the cut as pure functions, the settings,
and a real store server behind a real rate-limited link with host RAM as the fast tier."""

from __future__ import annotations

import re
import threading
import time
import types

import pytest
import torch
from prometheus_client import generate_latest
from throttle_proxy import ThrottledProxy

from tiered_cache.cache import TieredCache
from tiered_cache.cache.handle import HOST
from tiered_cache.cache.reuse import Rate, RateEstimator, ReuseEstimates, pages_to_load
from tiered_cache.client.stats import server_stats
from tiered_cache.config import CacheConfig, ReusePolicy
from tiered_cache.index.keys import PageKeyer
from tiered_cache.metrics import registry_of
from tiered_cache.metrics.families import cache_families
from tiered_cache.model.spec import KVSpec
from tiered_cache.report.tree import render_tree
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.wire.codec import encode_page

MB = 1_000_000
PAGE_BYTES, PAGE_TOKENS = 64 * 1024, 16
SLOW, FAST = Rate(1 * MB), Rate(10_000 * MB)  # 65 ms and 6.6 µs per 64 KiB page
PREFILL = 1000.0  # tokens/s: 16 ms per page, between the two


# --- the estimators --------------------------------------------------------------------------------
def test_an_estimator_separates_a_per_call_latency_from_the_rate():
    fit = RateEstimator()
    assert fit.estimate() is None
    fit.add(1 * MB, 0.011)  # 1 ms per call + 100 MB/s
    fit.add(10 * MB, 0.101)
    rate = fit.estimate()
    assert rate.per_s == pytest.approx(100 * MB) and rate.latency_s == pytest.approx(0.001)
    assert rate.seconds(50 * MB) == pytest.approx(0.501)


def test_samples_of_one_size_give_no_latency_and_empty_samples_are_ignored():
    fit = RateEstimator()
    fit.add(0, 0.5)  # a load that found nothing says nothing about the rate
    fit.add(4 * MB, 0.0)
    assert fit.estimate() is None and fit.samples == 0
    for seconds in (0.1, 0.3):
        fit.add(4 * MB, seconds)
    rate = fit.estimate()
    assert rate.latency_s == 0 and 10 * MB < rate.per_s < 40 * MB  # between the two samples' rates


def test_the_estimate_follows_a_tier_that_got_faster():
    fit = RateEstimator()
    for _ in range(10):
        fit.add(MB, 0.1)  # 10 MB/s
    for _ in range(10):
        fit.add(MB, 0.01)  # then 100 MB/s
    assert fit.estimate().per_s > 50 * MB  # the old samples weigh (3/4)^10 ~ 6% each (of their seconds)
    for _ in range(10):
        fit.add(MB, 0.01)
    assert fit.estimate().per_s > 95 * MB


def test_prefill_rate_is_the_configured_one_else_the_measured_slope():
    measured = ReuseEstimates()
    assert measured.prefill_rate() is None
    measured.observe_prefill(1, 0.095)  # one token: a decode-like step, mostly fixed cost
    measured.observe_prefill(2048, 6.6)
    measured.observe_prefill(1024, 0.095 + 1023 * (6.6 - 0.095) / 2047)
    assert measured.prefill_rate() == pytest.approx(2047 / (6.6 - 0.095))  # the slope, ~315 tokens/s
    fixed = ReuseEstimates(prefill_tokens_per_s=5000.0)
    fixed.observe_prefill(100, 1.0)
    assert fixed.prefill_rate() == 5000.0 and fixed.stats().prefill_configured


def test_suffixes_of_similar_length_give_tokens_over_seconds_not_a_noisy_slope():
    # On a GPU the forwards of 40-70 token suffixes cost the same ~20 ms: a slope fitted across
    # them is noise (it came out at millions of tokens/s and cut even host RAM); tokens over
    # seconds errs towards loading.
    measured = ReuseEstimates()
    for tokens, wobble in ((50, 0), (60, 5e-6), (40, 2e-6), (70, 4e-6), (55, 1e-6)):
        measured.observe_prefill(tokens, 0.020 + wobble)
    assert measured.stats().prefill_measured.basis == "throughput"
    assert 2000 <= measured.prefill_rate() <= 3500  # tokens over seconds, none of the slope's millions
    assert cut([HOST] * 512, {HOST: Rate(20e9)}, measured.prefill_rate()) == 512


# --- the cut ---------------------------------------------------------------------------------------
def cut(plan, rates, prefill=PREFILL):
    return pages_to_load(plan, rates, PAGE_BYTES, PAGE_TOKENS, prefill)


def test_a_slow_tier_after_fast_host_ram_is_cut_and_a_fast_one_is_kept():
    plan = [HOST] * 4 + [0] * 4
    assert cut(plan, {HOST: FAST, 0: SLOW}) == 4
    assert cut(plan, {HOST: FAST, 0: Rate(1000 * MB)}) == 8
    assert cut([0] * 4, {0: SLOW}) == 0  # all slow: recompute it all
    assert cut([1, 1, 0, 0], {0: FAST, 1: SLOW}) == 0  # a slow run first cuts everything after it


def test_no_estimate_means_load_everything():
    plan = [HOST] * 2 + [0] * 3
    assert cut(plan, {HOST: FAST, 0: SLOW}, prefill=None) == 5  # no prefill rate yet
    assert cut(plan, {HOST: FAST}) == 5  # tier 0 never measured: loaded, so it gets measured
    assert cut(plan, {HOST: FAST, 0: None}) == 5
    assert cut([], {}) == 0


def test_one_slow_page_is_loaded_when_the_fast_pages_after_it_pay_for_it():
    mid = Rate(PAGE_BYTES / 0.030)  # 30 ms a page: 14 ms worse than recomputing it
    assert cut([HOST, 0] + [HOST] * 6, {HOST: FAST, 0: mid}) == 8  # 6 pages at ~0 ms win it back
    worse = Rate(PAGE_BYTES / 0.200)
    assert cut([HOST, 0] + [HOST] * 6, {HOST: FAST, 0: worse}) == 1  # 200 ms is not won back


def test_a_tiers_latency_is_paid_once_per_load():
    remote = Rate(1000 * MB, latency_s=0.050)  # fast per byte, 50 ms per call
    assert cut([0], {0: remote}) == 0  # one page: 50 ms against 16 ms of prefill
    assert cut([0] * 10, {0: remote}) == 10  # ten pages: 50.7 ms against 160 ms


def test_a_rate_from_one_size_of_load_says_where_it_is_a_guess_and_stays_pessimistic():
    # One cold first load of one page: 50 ms, most of it a round trip. With no latency to fit,
    # 1.3 MB/s is a guess for ten pages; the cut still prices them so (a request never waits for
    # a load on a guess) and says it extrapolated, so the policy measures that size aside.
    link = Rate(2 * MB, latency_s=0.050 - PAGE_BYTES / (2 * MB))  # 17 ms a call + 33 ms a page
    fit = RateEstimator()
    fit.add(PAGE_BYTES, link.seconds(PAGE_BYTES))
    first = fit.estimate()
    assert first.latency_s == 0 and first.known_up_to == PAGE_BYTES
    assert not first.extrapolates(PAGE_BYTES) and first.extrapolates(2 * PAGE_BYTES)
    assert cut([0] * 10, {0: first}) == 0  # 500 ms priced against 160 ms of prefill
    fit.add(10 * PAGE_BYTES, link.seconds(10 * PAGE_BYTES))  # measured at ten pages too
    fitted = fit.estimate()
    assert fitted.per_s == pytest.approx(link.per_s) and fitted.latency_s == pytest.approx(link.latency_s)
    assert fitted.known_up_to == float("inf") and not fitted.extrapolates(100 * PAGE_BYTES)
    for _ in range(30):  # then one page at a time: the ten-page load fades from the fit, and its size with it
        fit.add(PAGE_BYTES, link.seconds(PAGE_BYTES))
    assert fit.estimate().known_up_to == PAGE_BYTES


def test_a_bulk_load_faster_than_a_slow_small_first_one_is_priced_near_what_it_took():
    # A first load of one page slowed by connecting (65 ms), then sixteen pages in 16 ms: a
    # bigger load no slower than a smaller one fits no latency; priced by the samples' mean
    # rate, the sixteen pages would cost four times what they took, and a fast tier would stay
    # skipped after the probe that measured it.
    fit = RateEstimator()
    fit.add(PAGE_BYTES, 0.065)
    fit.add(16 * PAGE_BYTES, 0.016)
    rate = fit.estimate()
    assert rate.latency_s == 0 and rate.known_up_to == 16 * PAGE_BYTES
    assert rate.seconds(16 * PAGE_BYTES) < 1.5 * 0.016
    one_size = RateEstimator()  # of one size, the mean rate, as before
    for seconds in (0.010, 0.030):
        one_size.add(PAGE_BYTES, seconds)
    assert one_size.estimate().per_s == pytest.approx(PAGE_BYTES * 1.75 / (0.75 * 0.010 + 0.030))


def test_a_probe_for_an_extrapolated_estimate_is_due_at_once_but_not_twice_a_second():
    estimates = ReuseEstimates(prefill_tokens_per_s=PREFILL)
    estimates.observe_load("remote", PAGE_BYTES, 0.05)
    assert not estimates.due_for_probe("remote", 1.0)  # measured just now
    assert estimates.due_for_probe("remote", 1.0, since_sample=False)  # ...but not at this size
    assert not estimates.due_for_probe("remote", 1.0, since_sample=False)  # one probe at a time


def test_always_loads_everything_whatever_the_estimates():
    names = {HOST: "host", 0: "remote"}
    plan = [HOST] * 4 + [0] * 4
    for policy, expected in ((ReusePolicy.ALWAYS, 8), (ReusePolicy.FASTER, 4)):
        estimates = ReuseEstimates(policy, prefill_tokens_per_s=PREFILL)
        estimates.observe_load("host", 4 * PAGE_BYTES, 4 * PAGE_BYTES / FAST.per_s)
        estimates.observe_load("remote", 4 * PAGE_BYTES, 4 * PAGE_BYTES / SLOW.per_s)
        assert estimates.cut(plan, names, PAGE_BYTES, PAGE_TOKENS) == expected, policy


def test_a_skipped_tier_is_due_for_a_probe_once_per_interval():
    estimates = ReuseEstimates()
    estimates.observe_load("remote", MB, 1.0)
    assert not estimates.due_for_probe("remote", after_s=60)  # measured just now
    assert estimates.due_for_probe("remote", after_s=0)
    assert not estimates.due_for_probe("remote", after_s=60)  # a probe just started


# --- settings --------------------------------------------------------------------------------------
def test_settings_take_strings_from_yaml_and_the_environment(tmp_path):
    assert CacheConfig().reuse is ReusePolicy.FASTER and CacheConfig().prefill_tokens_per_s is None
    assert CacheConfig(reuse="Always").reuse is ReusePolicy.ALWAYS
    path = tmp_path / "cache.yaml"
    path.write_text("reuse: always\nprefill_tokens_per_s: 12000\n")
    config = CacheConfig.from_yaml(path)
    assert config.reuse is ReusePolicy.ALWAYS and config.prefill_tokens_per_s == 12000.0
    env = CacheConfig.from_env(environ={"TIERED_CACHE_REUSE": "faster", "TIERED_CACHE_PREFILL_TOKENS_PER_S": "none"},
                               base=config)
    assert env.reuse is ReusePolicy.FASTER and env.prefill_tokens_per_s is None
    assert config.to_dict()["reuse"] == "always"


@pytest.mark.parametrize(("changes", "message"), [
    ({"reuse": "sometimes"}, "bad value for reuse: expected one of 'faster', 'always', got 'sometimes'"),
    ({"prefill_tokens_per_s": 0}, "prefill_tokens_per_s must be a positive number"),
    ({"prefill_tokens_per_s": "fast"}, "bad value for prefill_tokens_per_s: expected a number, got 'fast'"),
])
def test_bad_reuse_settings_are_refused_in_one_line(changes, message):
    with pytest.raises(ValueError) as caught:
        CacheConfig(**changes)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_observe_prefill_refuses_nonsense():
    with TieredCache(KVSpec("reuse-args", 1, 1, 8, page_size=4), CacheConfig(pool_capacity="64KiB")) as cache:
        cache.observe_prefill(0, 0.0)  # a forward of nothing: ignored, not an error
        assert cache.stats().reuse.prefill_tokens_per_s is None
        for bad in ((-1, 1.0), (3, -0.5), (2.5, 1.0)):
            with pytest.raises(ValueError):
                cache.observe_prefill(*bad)


def test_swap_in_loads_the_whole_prefix_back_even_where_match_would_recompute_it():
    spec = KVSpec("reuse-swap", 2, 1, 8, page_size=4)
    config = CacheConfig(pool_capacity=16 * spec.bytes_per_page, host_capacity=16 * spec.bytes_per_page,
                         prefill_tokens_per_s=1e9)
    with TieredCache(spec, config, lower=[]) as cache:
        prefix = list(range(8))
        cache.put(prefix, torch.randn(spec.kv_shape(8)).half())
        handle = cache.match(prefix + [1, 2])
        cache.allocate(handle, 2)
        cache.write(handle, torch.randn(spec.kv_shape(2)).half())
        assert cache.swap_out(handle) == 1
        assert cache.evict() == 2  # the prefix waits in host RAM
        cache.core.reuse.estimates.observe_load("host", spec.bytes_per_page, 1.0)  # a second a page: slower
        assert cache.lookup(prefix) == 0
        other = cache.match(prefix)
        assert other.available_pages == 0 and cache.stats().reuse.skipped_pages == {"host": 2}
        cache.release(other)
        cache.swap_in(handle)  # its own pages follow the prefix: it needs it all, whatever it costs
        assert handle.prefix_tokens == 8 and handle.own_written == 2
        cache.release(handle)
        cache.check_integrity()


# --- a real slow tier ------------------------------------------------------------------------------
SPEC = KVSpec("reuse-e2e", 4, 4, 64, page_size=PAGE_TOKENS)  # fp16: 4 KiB a token, 64 KiB a page
LINK = 1 * MB  # bytes/s through the proxy: 65 ms a page, 4x what recomputing it costs at PREFILL
WARM = list(range(10_000, 10_000 + 4 * PAGE_TOKENS))  # 4 pages only in the store: teaches its rate
PROMPT = list(range(5 * PAGE_TOKENS, 13 * PAGE_TOKENS))  # 8 pages: 4 in host RAM, then 4 only in the store


@pytest.fixture(scope="module")
def slow_store():
    """A store server (no shared memory, no bulk Get: every byte crosses the link, which carries
    gRPC only) behind a 1 MB/s proxy, holding WARM's pages and PROMPT's last four, put straight
    into the store (not through it)."""
    with StoreProcess(["--no-disk", "--shm", "off", "--bulk-port", "off"]) as store, \
            ThrottledProxy(store.address, LINK) as proxy:
        keyer = PageKeyer(SPEC, "")
        wanted = keyer.keys(WARM) + keyer.keys(PROMPT)[4:]
        pages = torch.randn(SPEC.staging_shape(len(wanted)), generator=torch.Generator().manual_seed(3)).half()
        direct = RemoteTier([store.address], fingerprint=bytes.fromhex(SPEC.fingerprint))
        try:
            assert direct.put([(k, encode_page(p, SPEC, k)) for k, p in zip(wanted, pages, strict=True)]) == 8
        finally:
            direct.close()
        yield store, proxy


def _cache_with_host_head(proxy: ThrottledProxy, reuse: str) -> TieredCache:
    """A cache over host RAM and the store through the slow link, with PROMPT's first 4 pages in
    host RAM (put, then evicted from the device) and nothing on the device."""
    config = CacheConfig(pool_capacity="4MiB", host_capacity="4MiB", lower_tiers=["remote"],
                         remote_addresses=[proxy.address], reuse=reuse, prefill_tokens_per_s=PREFILL)
    cache = TieredCache(SPEC, config)
    head = PROMPT[:4 * PAGE_TOKENS]
    cache.put(head, torch.randn(SPEC.kv_shape(len(head))).half())
    assert cache.evict() == 4 and cache.host.contains_prefix(PageKeyer(SPEC, "").keys(head)) == 4
    return cache


def _store_bytes_out(store: StoreProcess) -> int:
    return sum(int(t["bytes_out"]) for t in server_stats(store.address, None, None, 10)["tiers"])


def _warm_up(cache: TieredCache) -> None:
    """Load WARM from the store through the link: the cache learns the link's rate."""
    handle = cache.match(WARM)
    try:
        assert handle.plan == [0] * 4  # never measured: assumed fast, so loaded
        assert len(cache.load(handle)) == 4 and handle.sources["remote"] == 4
    finally:
        cache.release(handle)


def _timed_load(cache: TieredCache) -> tuple[object, float]:
    started = time.perf_counter()
    handle = cache.match(PROMPT)
    cache.load(handle)
    return handle, time.perf_counter() - started


def test_the_rates_are_learned_from_real_loads(slow_store):
    _, proxy = slow_store
    with _cache_with_host_head(proxy, "faster") as cache:
        assert cache.stats().reuse.load_rates == {}
        _warm_up(cache)
        rates = cache.stats().reuse.load_rates
        assert set(rates) == {"remote"} and rates["remote"].per_s > 0
        print(f"\nlearned: remote {rates['remote'].per_s / MB:.2f} MB/s through a {LINK / MB:.0f} MB/s link")
        cache.get(PROMPT[:4 * PAGE_TOKENS])  # host RAM -> pool
        assert "host" in cache.stats().reuse.load_rates


def test_pages_behind_a_slow_link_are_recomputed_and_host_ram_pages_loaded(slow_store):
    store, proxy = slow_store
    with _cache_with_host_head(proxy, "faster") as cache:
        _warm_up(cache)
        served = _store_bytes_out(store)
        assert cache.lookup(PROMPT) == 4 * PAGE_TOKENS  # what match would load
        handle, seconds = _timed_load(cache)
        try:
            assert handle.available_pages == 4 and handle.plan == []  # loaded: the plan is spent
            assert dict(handle.sources) == {"device": 0, "host": 4}
        finally:
            cache.release(handle)
        assert _store_bytes_out(store) == served  # the store sent nothing for the skipped pages
        stats = cache.stats()
        assert stats.reuse.skipped_pages == {"remote": 4} and stats.to_dict()["reuse"]["skipped_pages"] == {"remote": 4}
        assert stats.tier("remote").loads == 4  # the warm-up's pages only
        scraped = generate_latest(registry_of(lambda: cache_families(stats))).decode()
        assert 'tiered_cache_reuse_skipped_pages_total{tier="remote"} 4.0' in scraped
        assert 'tiered_cache_reuse_prefill_rate_tokens_per_second 1000.0' in scraped
        assert 'tiered_cache_reuse_load_rate_bytes_per_second{tier="remote"}' in scraped
        # Measured on four pages only (one size, no latency to fit): as far as the estimate goes.
        assert f'tiered_cache_reuse_load_seen_up_to_bytes{{tier="remote"}} {4 * SPEC.bytes_per_page:.1f}' in scraped
        drawn = render_tree(cache.prefix_tree())
        assert "reuse faster: prefill 1,000 tokens/s (set); load " in drawn
        assert re.search(r"remote [^,;]*/s \(seen up to 256 KiB\)", drawn), drawn
        assert "4 pages left to recompute (remote 4)" in drawn
    recompute = len(PROMPT) / PREFILL  # the engine at PREFILL tokens/s, the whole prompt
    ttft = seconds + 4 * PAGE_TOKENS / PREFILL  # load the host pages, compute the other four
    print(f"\nfaster: match+load {1e3 * seconds:.1f} ms, TTFT {1e3 * ttft:.0f} ms = {ttft / recompute:.2f}x of "
          f"recomputing all {len(PROMPT)} tokens ({1e3 * recompute:.0f} ms at {PREFILL:,.0f} tokens/s)")


def test_always_loads_through_the_slow_link_as_before(slow_store):
    store, proxy = slow_store
    with _cache_with_host_head(proxy, "always") as cache:
        _warm_up(cache)  # the same slow estimate: ALWAYS ignores it
        served = _store_bytes_out(store)
        assert cache.lookup(PROMPT) == len(PROMPT)
        handle, seconds = _timed_load(cache)
        try:
            assert handle.available_pages == 8 and dict(handle.sources) == {"device": 0, "host": 4, "remote": 4}
        finally:
            cache.release(handle)
        assert _store_bytes_out(store) - served >= 4 * SPEC.bytes_per_page  # four pages crossed the link
        assert cache.stats().reuse.skipped_pages == {}
    recompute = len(PROMPT) / PREFILL
    print(f"\nalways: match+load {1e3 * seconds:.1f} ms = {seconds / recompute:.2f}x of recomputing all "
          f"{len(PROMPT)} tokens ({1e3 * recompute:.0f} ms)")


def _load_one_page_of_warm(cache: TieredCache) -> None:
    handle = cache.match(WARM[:PAGE_TOKENS])
    try:
        assert len(cache.load(handle)) == 1 and handle.sources["remote"] == 1
    finally:
        cache.release(handle)


def _wait_for_loads(cache: TieredCache, count: int) -> None:
    deadline = time.monotonic() + 60
    while cache.stats().tier("remote").loads < count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cache.stats().tier("remote").loads == count


def test_a_slow_tier_seen_on_one_page_is_skipped_and_measured_at_the_larger_size_at_once(slow_store, monkeypatch):
    # Seen on one page through the link, the four store pages after host RAM are priced per byte
    # of that load: skipped (the request does not wait on a guess), and got aside at once,
    # not REUSE_REMEASURE_S later, by one probe however many requests skip them meanwhile. Two
    # sizes seen, the link's rate is fitted: still too slow.
    import tiered_cache.cache.reuse as reuse_module

    monkeypatch.setattr(reuse_module, "REUSE_EXTRAPOLATED_PROBE_S", 0.0)  # only a running probe holds one back
    _, proxy = slow_store
    with _cache_with_host_head(proxy, "faster") as cache:
        _load_one_page_of_warm(cache)
        assert cache.stats().reuse.load_rates["remote"].extrapolates(4 * SPEC.bytes_per_page)
        for _ in range(3):  # while the first one's probe crosses the link (~0.3 s)
            handle = cache.match(PROMPT)
            assert handle.plan == [HOST] * 4
            cache.release(handle)
        _wait_for_loads(cache, 1 + 4)  # the probe: the four skipped pages
        deadline = time.monotonic() + 60
        probing = lambda: any(t.name.startswith("tiered-cache-probe-") for t in threading.enumerate())  # noqa: E731
        while probing() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cache.stats().tier("remote").loads == 1 + 4  # one probe, not three
        fitted = cache.stats().reuse.load_rates["remote"]
        assert not fitted.extrapolates(100 * SPEC.bytes_per_page) and fitted.per_s < 2 * LINK
        handle = cache.match(PROMPT)
        assert handle.plan == [HOST] * 4  # known slow now, not guessed
        cache.release(handle)
        assert cache.stats().reuse.skipped_pages == {"remote": 16}


def test_a_fast_tier_whose_first_load_was_slow_is_used_again_after_one_probe(slow_store):
    # The store straight, no proxy: fast. Its first load was slowed by connecting, a fault that
    # cannot be caused on demand, so that one sample is fed in (65 ms for one page). The next
    # prompt skips the store's pages on that guess, a probe measures four pages at once, and the
    # prompt after loads them all.
    store, _ = slow_store
    with _cache_with_host_head(types.SimpleNamespace(address=store.address), "faster") as cache:
        cache.core.reuse.estimates.observe_load("remote", SPEC.bytes_per_page, 0.065)
        assert cache.stats().reuse.load_rates["remote"].known_up_to == SPEC.bytes_per_page
        handle = cache.match(PROMPT)
        assert handle.plan == [HOST] * 4
        cache.release(handle)
        _wait_for_loads(cache, 4)
        handle = cache.match(PROMPT)
        try:
            assert handle.plan == [HOST] * 4 + [0] * 4
            assert len(cache.load(handle)) == 8 and dict(handle.sources) == {"device": 0, "host": 4, "remote": 4}
        finally:
            cache.release(handle)


def test_a_tier_skipped_as_slow_is_measured_again_in_the_background(slow_store, monkeypatch):
    import tiered_cache.cache.reuse as reuse_module

    _, proxy = slow_store
    with _cache_with_host_head(proxy, "faster") as cache:
        _warm_up(cache)
        before = cache.stats().tier("remote").loads
        monkeypatch.setattr(reuse_module, "REUSE_REMEASURE_S", 0.0)  # the estimate counts as old
        handle = cache.match(PROMPT)
        assert handle.available_pages == 4  # the request still skips the slow pages...
        cache.release(handle)
        deadline = time.monotonic() + 60
        while cache.stats().tier("remote").loads < before + 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cache.stats().tier("remote").loads == before + 4  # ...and a probe got them aside
        assert len(cache.host.index) == 4 and cache.pool.usage().used_pages == 4  # and put them nowhere


def test_generate_teaches_the_cache_the_prefill_rate():
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiered_cache.integrations.transformers import generate, spec_for

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    with TieredCache(spec_for(model, "fp32", page_size=4, model_id="reuse-tiny"),
                     CacheConfig(pool_capacity="1MiB")) as cache:
        assert cache.stats().reuse.prefill_tokens_per_s is None
        generate(model, list(range(40)), cache, max_new_tokens=1)
        reuse = cache.stats().reuse
        assert reuse.prefill_tokens_per_s is not None and reuse.prefill_tokens_per_s > 0
        assert not reuse.prefill_configured
