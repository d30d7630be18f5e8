"""The prefill rate the reuse policy plans with stays within 2x of the engine's real rate through
noisy forwards: busy spells that make some forwards many times slower, short suffixes that are
mostly a forward's fixed cost, sizes too alike for a slope; and `stats` shows what it rests on."""

from __future__ import annotations

import random

import pytest

from tiered_cache.cache.prefill_estimate import WINDOW, PrefillEstimate
from tiered_cache.cache.reuse import ReuseEstimates
from tiered_cache.report.tree import reuse_line

RATE, FIXED_S = 300.0, 0.05  # the engine: 300 tokens/s after a 50 ms fixed cost per forward


def forward_s(tokens: int) -> float:
    return FIXED_S + tokens / RATE


def within_2x(rate: float | None) -> bool:
    return rate is not None and RATE / 2 <= rate <= RATE * 2


@pytest.mark.parametrize("seed", range(20))
def test_a_third_of_forwards_slowed_by_a_busy_machine_move_it_little(seed):
    rng = random.Random(seed)
    estimate = PrefillEstimate()
    for _ in range(60):
        tokens = rng.randint(64, 4000)
        slowed = rng.uniform(3, 20) if rng.random() < 0.3 else 1.0
        estimate.add(tokens, forward_s(tokens) * slowed)
        if estimate.figure().samples >= 8:
            assert within_2x(estimate.figure().tokens_per_s), estimate.figure()


def test_a_busy_spell_of_consecutive_slow_forwards_passes():
    estimate = PrefillEstimate()
    sizes = [300, 2800, 900, 2000, 150, 3200, 600, 1200] * 4
    for i, tokens in enumerate(sizes):
        busy = 10.0 if 8 <= i < 8 + WINDOW // 2 else 1.0  # half the window, in a row
        estimate.add(tokens, forward_s(tokens) * busy)
        assert within_2x(estimate.figure().tokens_per_s), (i, estimate.figure())


def test_short_suffixes_of_one_size_and_a_lucky_fast_forward_do_not_claim_a_fast_engine():
    estimate = PrefillEstimate()
    for i in range(30):
        tokens = 200 + i % 3  # alike: no slope can be told from the fixed cost
        estimate.add(tokens, forward_s(tokens) * (0.1 if i % 7 == 0 else 1.0))  # a timer's lucky reading
    figure = estimate.figure()
    assert figure.basis == "throughput" and within_2x(figure.tokens_per_s)


def test_stats_show_the_rate_planned_with_beside_what_it_was_fitted_on():
    estimates = ReuseEstimates()
    assert estimates.stats().to_dict()["prefill_measured"] is None
    for tokens in (200, 3000, 800, 2400, 1500):
        estimates.observe_prefill(tokens, forward_s(tokens))
    figures = estimates.stats().to_dict()
    measured = figures["prefill_measured"]
    assert measured["forwards"] == 5 and measured["basis"] == "slope"
    assert figures["prefill_tokens_per_s"] == measured["tokens_per_s"] and within_2x(measured["tokens_per_s"])
    assert measured["throughput_tokens_per_s"] < measured["tokens_per_s"]  # the slope leaves the fixed cost out
    assert "(measured: slope over 5 forward(s), throughput" in reuse_line(figures)
