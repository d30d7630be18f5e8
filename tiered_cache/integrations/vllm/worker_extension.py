"""`TieredCacheWorkerExtension`: the method an engine's front end calls on vLLM's workers (vLLM's
`worker_extension_cls`, reached by `collective_rpc`) to hand our connector a hint: a request with
this prompt is on its way, start loading its blocks (`TieredCacheConnector.promote`). Ray Serve
LLM's replica (`workers/serve_llm/llm_server.py`) sends it as the router's choice reaches it,
before vLLM schedules the request. A worker without our connector answers 0."""

from __future__ import annotations

from collections.abc import Sequence

PROMOTE = "tiered_cache_promote"  # the method's name, as collective_rpc asks for it


class TieredCacheWorkerExtension:
    def tiered_cache_promote(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Blocks of the prompt this worker's connector started loading (0 without one)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        from tiered_cache.integrations.vllm.connector import TieredCacheConnector

        if not has_kv_transfer_group():
            return 0
        connector = get_kv_transfer_group()
        return connector.promote(token_ids, cache_salt) if isinstance(connector, TieredCacheConnector) else 0
