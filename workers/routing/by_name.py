"""`make_policy`: any routing policy by its name (`ClusterConfig`'s router policy), with its settings."""

from __future__ import annotations

from tiered_cache.workers.routing.event_policy import EventRoutingPolicy
from tiered_cache.workers.routing.policies import PrefixAwarePolicy, RoundRobinPolicy
from tiered_cache.workers.routing.policy import RoutingPolicy


def make_policy(name: str, **settings: float) -> RoutingPolicy:
    """The policy called `name` ("prefix", "round_robin" or "events") with its settings (the prefix
    policy's; the events policy falls back to a prefix policy built with them). ValueError for
    another name, or settings round robin does not take."""
    if name == "prefix":
        return PrefixAwarePolicy(**settings)  # type: ignore[arg-type]
    if name == "events":
        return EventRoutingPolicy(PrefixAwarePolicy(**settings))  # type: ignore[arg-type]
    if name == "round_robin":
        if settings:
            raise ValueError(f"round_robin takes no settings, got {', '.join(sorted(settings))}")
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}; known: prefix, round_robin, events")
