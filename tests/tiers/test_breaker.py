"""The circuit breaker every remote server gets: its states, on a clock the test moves."""

from __future__ import annotations

import logging
import threading

import pytest

from tiered_cache.tiers.breaker import BreakerPolicy, BreakerState, CircuitBreaker, breaker_states


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(**policy) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    return CircuitBreaker(BreakerPolicy(**policy), clock), clock


def test_closed_until_the_threshold_then_open_then_one_probe():
    breaker, clock = make(failure_threshold=3, cooldown_s=1.0, max_cooldown_s=8.0)
    for _ in range(2):
        assert breaker.allow()
        assert not breaker.failed()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allow() and breaker.failed()  # the third in a row trips it
    assert breaker.state is BreakerState.OPEN and breaker.trips == 1
    assert not breaker.allow() and breaker.refused == 1
    clock.now += 0.99
    assert not breaker.allow()
    clock.now += 0.02
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow()  # the probe
    assert not breaker.allow() and not breaker.available  # one probe at a time
    breaker.succeeded()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()


def test_a_success_resets_the_failure_count():
    breaker, _ = make(failure_threshold=2)
    breaker.failed()
    breaker.succeeded()
    breaker.failed()
    assert breaker.state is BreakerState.CLOSED


def test_failed_probes_double_the_cooldown_up_to_the_cap_and_success_resets_it():
    breaker, clock = make(cooldown_s=1.0, max_cooldown_s=4.0)
    breaker.failed()
    waits = []
    for _ in range(4):
        waited = 0.0
        while not breaker.available:
            clock.now += 0.25
            waited += 0.25
        waits.append(waited)
        assert breaker.allow()
        assert breaker.failed()
    assert waits == [1.0, 2.0, 4.0, 4.0]
    assert breaker.trips == 5
    clock.now += 4.0
    assert breaker.allow()
    breaker.succeeded()
    breaker.failed()  # open again, with the base cooldown
    clock.now += 1.0
    assert breaker.available


def test_a_probe_that_never_reports_stops_blocking_after_its_timeout():
    breaker, clock = make(cooldown_s=1.0, probe_timeout_s=5.0)
    breaker.failed()
    clock.now += 1.0
    assert breaker.allow()  # a probe whose caller died
    clock.now += 4.9
    assert not breaker.allow()
    clock.now += 0.2
    assert breaker.allow()


def test_a_late_failure_of_a_call_allowed_before_opening_does_not_extend_it():
    breaker, clock = make(cooldown_s=1.0)
    assert breaker.allow() and breaker.allow()  # two calls in flight while closed
    assert breaker.failed()
    assert not breaker.failed()  # the second reports while open: no second trip
    clock.now += 1.0
    assert breaker.available and breaker.trips == 1


def test_only_one_of_many_threads_gets_the_probe():
    breaker, clock = make(cooldown_s=1.0)
    breaker.failed()
    clock.now += 1.0
    allowed = []
    barrier = threading.Barrier(16)

    def call() -> None:
        barrier.wait()
        allowed.append(breaker.allow())

    threads = [threading.Thread(target=call) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(allowed) == [False] * 15 + [True]


def test_states_summary_and_bad_policies():
    a, _ = make()
    b, _ = make()
    b.failed()
    assert breaker_states({"a:1": a, "b:2": b}) == (1, {"a:1": "closed", "b:2": "open"})
    with pytest.raises(ValueError, match="failure_threshold"):
        BreakerPolicy(failure_threshold=0)
    with pytest.raises(ValueError, match="cooldown"):
        BreakerPolicy(cooldown_s=2.0, max_cooldown_s=1.0)


def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends(caplog):
    clock = Clock()
    breaker = CircuitBreaker(BreakerPolicy(failure_threshold=1, cooldown_s=1.0), clock=clock,
                             name="store server 10.0.0.5:50551")
    with caplog.at_level(logging.WARNING, logger="tiered_cache.tiers"):
        assert breaker.allow() and breaker.failed()  # down
        for _ in range(3):  # failed probes of the same outage: no new line
            clock.now += 10
            assert breaker.allow() and breaker.failed()
        clock.now += 10
        assert breaker.allow()
        breaker.succeeded()  # back
        breaker.succeeded()  # still up: nothing to say
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("store server 10.0.0.5:50551 is down") and "misses" in lines[0]
    assert lines[1] == "store server 10.0.0.5:50551 is back"
    assert CircuitBreaker().name == ""  # unnamed (tests, internal): silent
