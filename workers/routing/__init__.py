"""Routing: where a prompt should go, free of Ray, so any router can use it (our router actor,
`workers/router.py`, or a Ray Serve request router).

- `policy.py`: `RoutingPolicy`, the one interface every policy offers (no-op defaults), and what
  a decision is (`Decision`) and what a prompt is (`Prompt`, `prompt_text`).
- `policies.py`: the policies on prompt text: `PrefixAwarePolicy` (over `prefix_tree.py`'s
  approximate prefix tree) and `RoundRobinPolicy`; `by_name.py`: `make_policy`, any policy by name.
- `event_policy.py`: `EventRoutingPolicy`, by expected time to first token over the cluster's KV
  events (`event_index.py`: where every page is) and costs learned from answers
  (`ttft_estimate.py`); the prefix policy decides while events are stale.
"""

from tiered_cache.workers.routing.by_name import make_policy
from tiered_cache.workers.routing.policies import PrefixAwarePolicy, RoundRobinPolicy
from tiered_cache.workers.routing.policy import Decision, Prompt, RoutingPolicy, prompt_text

__all__ = ["Decision", "PrefixAwarePolicy", "Prompt", "RoundRobinPolicy", "RoutingPolicy", "make_policy",
           "prompt_text"]
