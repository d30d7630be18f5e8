"""One circuit breaker per remote server (a store server, a Redis server or cluster master).

    closed ──(failure_threshold failures in a row)──> open
    open ──(cooldown passed: the next call is let through as a probe)──> half-open
    half-open ──(probe succeeds)──> closed          (cooldown back to its base)
    half-open ──(probe fails)──> open               (cooldown doubled, up to max_cooldown_s)

While open, calls are refused at once: the tier answers misses and drops writes instead of
paying a timeout per request against a server that is down. In half-open only one probe is in
flight at a time; a probe whose caller never reports (a thread that died) stops counting after
`probe_timeout_s` and another call probes. This is the only retry policy of the remote tiers:
Redis's in-call retry of a broken connection is redis-py's own `Retry` (tiers/redis.py).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("tiered_cache.tiers")


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(frozen=True)
class BreakerPolicy:
    failure_threshold: int = 1  # failures in a row that open a closed breaker
    cooldown_s: float = 0.1  # first open period
    max_cooldown_s: float = 5.0  # cap of the doubling
    probe_timeout_s: float = 30.0  # a probe not reported after this long no longer blocks others

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be at least 1, got {self.failure_threshold}")
        if not 0 < self.cooldown_s <= self.max_cooldown_s:
            raise ValueError(f"need 0 < cooldown_s <= max_cooldown_s, got {self.cooldown_s} and {self.max_cooldown_s}")


class CircuitBreaker:
    """Thread-safe. Ask `allow()` before each call to the server; report `succeeded()` or
    `failed()` after each call that was allowed."""

    def __init__(self, policy: BreakerPolicy | None = None, clock: Callable[[], float] = time.monotonic,
                 name: str = "") -> None:
        self.policy = policy or BreakerPolicy()
        self.name = name  # what the server is, in the log: "store server 10.0.0.5:50551"
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0  # in a row, while closed
        self._cooldown = self.policy.cooldown_s
        self._open_until = 0.0
        self._probe_started: float | None = None
        self.why = ""  # what the last failed call said of the server ("is down (UNAVAILABLE)", ...)
        self.trips = 0  # times it opened
        self.refused = 0  # calls refused while open or while a probe was in flight

    @property
    def state(self) -> BreakerState:
        """The state now (an open breaker whose cooldown has passed reads half-open)."""
        with self._lock:
            if self._state is BreakerState.OPEN and self._clock() >= self._open_until:
                return BreakerState.HALF_OPEN
            return self._state

    @property
    def available(self) -> bool:
        """Whether `allow()` would let a call through now (without taking the probe)."""
        with self._lock:
            return self._would_allow(self._clock())

    def _would_allow(self, now: float) -> bool:
        if self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.OPEN:
            return now >= self._open_until
        return self._probe_started is None or now - self._probe_started >= self.policy.probe_timeout_s

    def allow(self) -> bool:
        """Whether to call the server now. In half-open the caller that gets True is the probe."""
        with self._lock:
            now = self._clock()
            if not self._would_allow(now):
                self.refused += 1
                return False
            if self._state is not BreakerState.CLOSED:
                self._state = BreakerState.HALF_OPEN
                self._probe_started = now
            return True

    def succeeded(self) -> None:
        with self._lock:
            recovered = self._state is not BreakerState.CLOSED
            self._state = BreakerState.CLOSED
            self._failures = 0
            self._cooldown = self.policy.cooldown_s
            self._probe_started = None
        if recovered and self.name:  # once per outage: when it ends
            log.warning("%s is back", self.name)

    def failed(self, why: str = "is down") -> bool:
        """Count a failed call (`why`: what it says of the server, for the log line when the
        breaker opens: "is down (UNAVAILABLE)", "is up and refuses ..."); returns whether this
        opened the breaker (a trip)."""
        with self._lock:
            self.why = why
            if self._state is BreakerState.CLOSED:
                self._failures += 1
                if self._failures < self.policy.failure_threshold:
                    return False
                cooldown = self._cooldown
            elif self._state is BreakerState.HALF_OPEN:
                cooldown = self._cooldown = min(self.policy.max_cooldown_s, self._cooldown * 2)
            else:  # a call allowed before the breaker opened failed late: it stays open as it is
                return False
            went_down = self._state is BreakerState.CLOSED  # not a failed probe of an outage logged already
            self._state = BreakerState.OPEN
            self._open_until = self._clock() + cooldown
            self._probe_started = None
            self._failures = 0
            self.trips += 1
        if went_down and self.name:  # once per outage: when it starts
            log.warning("%s %s: its calls answer misses until it answers again (next try in %.1f s)",
                        self.name, why, cooldown)
        return True


def breaker_states(breakers: dict[str, CircuitBreaker]) -> tuple[int, dict[str, str]]:
    """(how many are not closed now, state by server) over `breakers`."""
    states = {name: b.state.value for name, b in breakers.items()}
    return sum(state != BreakerState.CLOSED.value for state in states.values()), states
