"""`TieredCacheLLMServer`: Ray Serve LLM's replica (`LLMServer`) with two additions:

- its routing stats (which Serve polls every few seconds and hands to the request router; `stats
  --ray` reads them there) carry its engine's connector figures: lookups, blocks asked, hit,
  saved, dropped, failed loads (the `vllm:tiered_cache_*` counters its stat loggers saw), and the
  blocks it asked its workers to start loading;
- a completion or chat request the router sent here to load from our tiers (its mark in
  `kv_transfer_params`) first tells the engine's workers to start loading the prompt's blocks
  (`worker_extension.py`), before vLLM schedules it: the prompt is keyed as the router keys it
  (the model's tokenizer and chat template), the hint sent ahead of the request, never waited for.

It also keeps the cluster's shard list in a file on its node, which its connector follows
(shard_list.py): a shard that moves is found without a redeploy.

Its routing stats also say how its connector keys pages (`tiered_cache_keying`, asked of its
workers once at start), which the router needs to read the store shards' own events, and how
long its engine took to prefill a prompt of random tokens once it had started, and the same prompt
again with its end new (`tiered_cache_prefill`: the prompts skip our tiers, under a cache salt no
one else uses): the router prices its first routes by them, a computed token and a cached one,
rather than by a guess, long before a loaded cluster's first answers come back.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from typing import Any

from ray.llm._internal.serve.core.server.llm_server import LLMServer

from tiered_cache.integrations.vllm.connector import NO_TIERS
from tiered_cache.integrations.vllm.worker_extension import KEYING, PROMOTE
from tiered_cache.workers.serve_llm.request_router import load_ahead, prompt_tokens
from tiered_cache.workers.serve_llm.shard_list import cluster_namespace, keep_shard_list, write_shard_list

log = logging.getLogger(__name__)
HINT_TIMEOUT_S = 10.0  # a hint the engine has not taken by then is dropped (the load happens anyway)
PROBE_TOKENS = 1024  # the start-up prefill's prompt (at most half the model's context)
PROBE_NEW = 32  # of it, the tokens its second prefill computes anew (the rest from vLLM's prefix cache)
PROBE_TIMEOUT_S = 120.0  # a probe not done by then is given up: the router keeps its prior


class TieredCacheLLMServer(LLMServer):
    async def start(self) -> None:
        namespace = cluster_namespace()
        self._shard_list: asyncio.Task[None] | None = None
        if namespace is not None:  # the connector follows the shards' addresses (shard_list.py)
            transfer = (self._llm_config.engine_kwargs or {}).get("kv_transfer_config") or {}
            deployed = (transfer.get("kv_connector_extra_config") or {}).get("remote_addresses")
            await write_shard_list(namespace, list(deployed or ()))  # before the engine reads it
            self._shard_list = asyncio.ensure_future(keep_shard_list(namespace))
        await super().start()
        self._tokenizer: Any = None
        self.hinted_blocks = 0  # blocks the workers started loading on a hint
        self.hints_failed = 0
        self._hints: set[asyncio.Task[Any]] = set()
        self.keying: dict[str, Any] | None = None
        self.prefill: dict[str, float] | None = await self._time_prefill()
        engine_kwargs = self._llm_config.engine_kwargs or {}
        if engine_kwargs.get("kv_transfer_config") and engine_kwargs.get("worker_extension_cls"):
            from tiered_cache.integrations.hf_models import load_tokenizer

            source = self._llm_config.model_loading_config.model_source
            self._tokenizer = await asyncio.to_thread(load_tokenizer, str(source))
            self.keying = await self._keying()

    async def _time_prefill(self) -> dict[str, float] | None:
        """What this engine takes to prefill: `PROBE_TOKENS` random tokens (after a short prompt
        that pays for the kernels' first use), then the same prompt again with its last
        `PROBE_NEW` tokens new (vLLM's prefix cache holds the rest: what a cached token costs),
        each timed to its first token; None where it cannot say (no vLLM engine client, a
        failure: logged)."""
        client = getattr(self.engine, "_engine_client", None)
        if client is None:
            return None
        try:
            from vllm import SamplingParams

            config = client.model_config
            tokens = max(2 * PROBE_NEW, min(PROBE_TOKENS, config.max_model_len // 2))
            vocab = config.get_vocab_size()
            params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {NO_TIERS: True}})
            salt = f"tiered-cache-probe-{uuid.uuid4().hex}"

            async def prefill(ids: list[int]) -> tuple[float, int]:
                started, cached = time.perf_counter(), 0
                async for output in client.generate({"prompt_token_ids": ids, "cache_salt": salt}, params,
                                                    f"{salt}-{uuid.uuid4().hex}"):
                    cached = int(getattr(output, "num_cached_tokens", 0) or 0)
                return time.perf_counter() - started, cached

            def fresh(n: int) -> list[int]:
                return [random.randrange(vocab) for _ in range(n)]

            await asyncio.wait_for(prefill(fresh(PROBE_NEW)), PROBE_TIMEOUT_S)
            ids = fresh(tokens)
            seconds, _ = await asyncio.wait_for(prefill(ids), PROBE_TIMEOUT_S)
            hit_seconds, cached = await asyncio.wait_for(prefill(ids[:-PROBE_NEW] + fresh(PROBE_NEW)),
                                                         PROBE_TIMEOUT_S)
            return {"tokens": tokens, "seconds": seconds, "cached_tokens": cached, "hit_seconds": hit_seconds}
        except Exception as exc:
            log.warning("tiered-cache: could not time this engine's prefill: %s", exc)
            return None

    async def _keying(self) -> dict[str, Any] | None:
        """How the connector keys pages (every worker keys alike: the first answer); None when the
        workers do not say (the router then counts the connectors' own blocks as the store)."""
        try:
            answers = await self.engine.collective_rpc(method=KEYING, timeout=HINT_TIMEOUT_S)
        except Exception as exc:
            log.warning("tiered-cache: the connector's page keying is unknown: %s", exc)
            return None
        return next((a for a in answers or () if a), None)

    async def _run_request(self, request: Any, *, engine_method: str, batch_output_stream: bool = False,
                           raw_request_info: Any = None) -> Any:
        if self._tokenizer is not None and engine_method in ("chat", "completions"):
            self._hint(request)
        return await super()._run_request(request, engine_method=engine_method,
                                          batch_output_stream=batch_output_stream, raw_request_info=raw_request_info)

    def _hint(self, request: Any) -> None:
        """Send the workers the prompt's token ids (before the request itself reaches the engine:
        the task is queued first); a prompt that cannot be keyed sends nothing."""
        if not load_ahead(request):  # the router expects this replica's device to hold it, or none
            return
        try:
            tokens = prompt_tokens(self._tokenizer, request)
        except Exception:  # a prompt vLLM will answer with its own error
            tokens = None
        if not tokens:
            return
        salt = getattr(request, "cache_salt", None)
        task = asyncio.ensure_future(self.engine.collective_rpc(method=PROMOTE, timeout=HINT_TIMEOUT_S,
                                                                args=(tokens, salt)))
        self._hints.add(task)
        task.add_done_callback(self._hinted)

    def _hinted(self, task: asyncio.Task[Any]) -> None:
        self._hints.discard(task)
        if task.cancelled() or task.exception() is not None:
            self.hints_failed += 1
            log.debug("tiered-cache: a load hint failed: %s", None if task.cancelled() else task.exception())
            return
        self.hinted_blocks += max((int(n) for n in task.result() or [0]), default=0)

    async def record_routing_stats(self) -> dict[str, Any]:
        stats = dict(await super().record_routing_stats() or {})
        figures = connector_figures()
        figures["hinted_blocks"] = getattr(self, "hinted_blocks", 0)
        figures["hints_failed"] = getattr(self, "hints_failed", 0)
        stats["tiered_cache"] = figures
        stats["tiered_cache_keying"] = getattr(self, "keying", None)
        stats["tiered_cache_prefill"] = getattr(self, "prefill", None)
        return stats


def connector_figures() -> dict[str, float]:
    """This replica's connector counters, summed over its engines (the stat loggers run here)."""
    from tiered_cache.integrations.vllm.stats import TOTALS

    return dict(TOTALS)
