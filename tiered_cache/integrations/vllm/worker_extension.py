"""`TieredCacheWorkerExtension`: the method an engine's front end calls on vLLM's workers (vLLM's
`worker_extension_cls`, reached by `collective_rpc`) to hand our connector a hint: a request with
this prompt is on its way, start loading its blocks (`TieredCacheConnector.promote`). Ray Serve
LLM's replica (`workers/serve_llm/llm_server.py`) sends it as the router's choice reaches it,
before vLLM schedules the request. A worker without our connector answers 0.

It also tells how the connector keys its pages (`tiered_cache_keying`), so a router can read the
store shards' own events, which name pages by those keys."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PROMOTE = "tiered_cache_promote"  # the methods' names, as collective_rpc asks for them
KEYING = "tiered_cache_keying"


def _connector() -> Any:
    """This worker's TieredCacheConnector, or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from tiered_cache.integrations.vllm.connector import TieredCacheConnector

    if not has_kv_transfer_group():
        return None
    connector = get_kv_transfer_group()
    return connector if isinstance(connector, TieredCacheConnector) else None


class TieredCacheWorkerExtension:
    def tiered_cache_promote(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Blocks of the prompt this worker's connector started loading (0 without one)."""
        connector = _connector()
        return 0 if connector is None else connector.promote(token_ids, cache_salt)

    def tiered_cache_keying(self) -> dict[str, Any] | None:
        """How this worker's connector keys pages (`BlockTiers.keying`; a request with a cache salt
        keys under the salt instead); None without one."""
        connector = _connector()
        if connector is None:
            return None
        return connector.tiers.keying(connector.config.namespace)
