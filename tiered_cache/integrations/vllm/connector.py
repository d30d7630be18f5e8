"""`TieredCacheConnector`: tiered-cache as a vLLM V1 KV connector.

    --kv-transfer-config '{"kv_connector": "TieredCacheConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"config": "cache.yaml"}}'

Scheduler side: a request's prompt is hashed into page keys (one vLLM block = one page, the
namespace is the request's cache salt), the tiers are asked how many full blocks past vLLM's own
prefix cache they hold (always leaving one token to compute; none asked when vLLM's covers the
prompt), and each step's metadata tells the worker which blocks to load and which to save: only
blocks whose every token has been computed, never a partial one, and neither blocks that were
just loaded nor those vLLM's own prefix cache gave the request (the request that computed them
saved them). A request marked `NO_TIERS` in its `kv_transfer_params` is left to vLLM alone.

Worker side: a block is stored as pages of layer groups (`layer_groups.py`). `start_load_kv`
hands the step's loads to a loader thread, which gets group after group and copies each into
vLLM's KV; `wait_for_layer_load` waits only for the group of the layer about to attend, so the
first layers compute while the last are still arriving. Saves are copied out of vLLM's KV after
the forward (`wait_for_save`) and encoded and written on a background queue, so the forward never
waits for disk, Redis or gRPC. A block that is missing or fails its checksum is reported through
`get_block_ids_with_load_errors`, and vLLM recomputes it: the connector sets vLLM's
`kv_load_failure_policy` to "recompute" (vLLM's default, "fail", would fail the request on a
cache miss).

`kv_connector_extra_config`: `config` (a tiered-cache YAML of `CacheConfig` settings: host
capacity, lower tiers, disk path, Redis URL, store servers ...), any `CacheConfig` setting
inline (wins over the file), `model_id` when the weights cannot be identified otherwise,
`layer_groups` (pages per block: "auto", about 1 MiB a page on GPUs and whole blocks when vLLM
runs on the CPU, or a number dividing the layers; 1 loads whole blocks before the forward) and
`load_failure_policy` ("recompute", or "fail" to keep vLLM's).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from tiered_cache.config import CacheConfig
from tiered_cache.integrations.vllm.block_copy import BlockCopier, DeviceBlocks, block_copier
from tiered_cache.integrations.vllm.block_events import BlockEvents
from tiered_cache.integrations.vllm.block_tiers import BlockTiers
from tiered_cache.integrations.vllm.identity import model_id_for, vllm_spec
from tiered_cache.integrations.vllm.layer_groups import group_size
from tiered_cache.integrations.vllm.layout import layout_of, stacked_view
from tiered_cache.integrations.vllm.load_job import LoadJob
from tiered_cache.integrations.vllm.stats import Loads, Tally, TieredCachePromMetrics, TieredCacheStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

_TIMING = bool(os.environ.get("TIERED_CACHE_VLLM_TIMING"))  # print each lookup's and load's time
# The rest of kv_connector_extra_config are CacheConfig settings.
_EXTRA_KEYS = {"config", "model_id", "layer_groups", "load_failure_policy"}
_POLICIES = ("recompute", "fail")
# A request whose kv_transfer_params carry this mark is neither looked up in our tiers nor saved to
# them (a replica's start-up probe of its own prefill: random tokens no one will ask again).
NO_TIERS = "tiered_cache_no_tiers"
log = logging.getLogger(__name__)


@dataclass
class BlockTransfer:
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class TieredCacheMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _Request:
    """Scheduler-side state of one request."""

    num_prompt_tokens: int
    keys: list[bytes]  # of the prompt's full blocks
    block_ids: list[int] = field(default_factory=list)
    load: tuple[int, int] | None = None  # blocks [a, b) to load before the next forward
    saved: int = 0  # blocks before this one are saved (or were loaded from us)
    request: Any = None  # vLLM's request: its block hashes and tokens name our blocks in KV events


def cache_config_from(extra: dict[str, Any]) -> CacheConfig:
    """The tiers' settings: the YAML named by `config`, then inline settings."""
    base = CacheConfig.from_yaml(extra["config"]) if extra.get("config") else CacheConfig()
    return CacheConfig.from_dict({k: v for k, v in extra.items() if k not in _EXTRA_KEYS}, base)


class TieredCacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = cache_config_from(extra)
        model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        dtype = model.dtype if cache.cache_dtype in (None, "auto") else cache.cache_dtype
        self.block_size = cache.block_size
        self.spec = vllm_spec(model_id_for(model.model, model.revision, extra.get("model_id")),
                              model.get_num_layers(parallel), model.get_num_kv_heads(parallel), model.get_head_size(),
                              str(dtype), self.block_size)
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
        per_page = group_size(self.spec.num_layers, self.spec.bytes_per_page // self.spec.num_layers,
                              extra.get("layer_groups"), kv_on_cpu=device == "cpu")
        self.tiers = BlockTiers.shared(self.spec, self.config, per_page)
        self._set_failure_policy(str(extra.get("load_failure_policy", "recompute")))
        self._requests: dict[str, _Request] = {}  # scheduler side
        self._layers: list[torch.Tensor] = []  # worker side
        self._group_of: dict[str, int] = {}  # layer name -> its layer group
        self._copier: BlockCopier | None = None  # worker side: vLLM's KV <-> our pages
        self._failed: set[int] = set()
        self._job: LoadJob | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._layerwise = self.tiers.num_groups > 1  # off for good if a forward skips wait_for_layer_load
        self.loads = Loads()  # worker side: blocks loaded, and what the forward waited for them
        self.events: BlockEvents | None = None  # scheduler side: our blocks for vLLM's KV event publisher
        self.tally: Tally | None = None  # scheduler side: our figures for vLLM's metrics
        if role == KVConnectorRole.SCHEDULER:
            self.events = BlockEvents(self.tiers.all_page_keys)
            self.tiers.chain.on_change = self.events.chain_changed
            self.tally = Tally(self.tiers)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save a preemption dropped is a later miss, never a hand-off a
        request must wait for or be recomputed over (vLLM defaults producers to True)."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Loads that wait per layer (`wait_for_layer_load`, several layer groups) need Python between
        graph pieces: replayed whole, a CUDA graph would skip the waits. Whole blocks (`layer_groups`
        1) load before the forward and need nothing; "auto" groups by layer on a GPU."""
        return str((extra_config or {}).get("layer_groups", "auto")).strip() != "1"

    def _set_failure_policy(self, policy: str) -> None:
        """A block we fail to load must be recomputed, not fail the request (vLLM's default)."""
        if policy not in _POLICIES:
            raise ValueError(f"load_failure_policy must be one of {', '.join(_POLICIES)}, got {policy!r}")
        if self._kv_transfer_config.kv_load_failure_policy != policy:
            log.info("tiered-cache: kv_load_failure_policy %r -> %r (a cache fault recomputes, never fails "
                     "a request)", self._kv_transfer_config.kv_load_failure_policy, policy)
            self._kv_transfer_config.kv_load_failure_policy = policy

    # --- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if (getattr(request, "kv_transfer_params", None) or {}).get(NO_TIERS):
            return 0, False  # no state kept: nothing loaded or saved for it
        tokens = list(request.prompt_token_ids or [])
        namespace = getattr(request, "cache_salt", None) or self.config.namespace
        state = _Request(len(tokens), self.tiers.keys(tokens, namespace), request=request)
        self._requests[request.request_id] = state
        usable = max(0, len(tokens) - 1) // self.block_size  # at least one token is computed
        first = num_computed_tokens // self.block_size  # vLLM's own prefix cache holds these
        # Computed on this engine by an earlier request, which saved them: saving them again per
        # request would copy the whole prefix out of vLLM's KV each time (every question on a
        # document still being written to the store).
        state.saved = first
        if usable <= first:
            return 0, False  # nothing past vLLM's own prefix cache for us to load
        # Keys chain over every token before them: the blocks past vLLM's own are asked alone.
        t0 = time.perf_counter()
        held = first + self.tiers.leading(state.keys[first:usable])
        if _TIMING:
            print(f"[tiered-cache] lookup {usable - first} blocks past vLLM's {first}: {held - first} held, "
                  f"{1e3 * (time.perf_counter() - t0):.1f} ms", file=sys.stderr, flush=True)
        if self.tally is not None:
            self.tally.add(lookups=1, blocks_asked=usable - first, blocks_hit=held - first)
        if held <= first:
            return 0, False
        state.load = (first, held)
        self.tiers.prefetch(state.keys[first:held])  # the worker's load job takes it (same process)
        return held * self.block_size - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is not None and num_external_tokens == 0:
            state.load = None  # nothing allocated for a load: vLLM computes those tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TieredCacheMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan(meta, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids += new_ids[0]
            self._plan(meta, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan(self, meta: TieredCacheMetadata, state: _Request, computed_after: int) -> None:
        """This step's load (if one is pending) and the save of blocks this step completes."""
        if state.load is not None:
            a, b = state.load
            meta.loads.append(BlockTransfer(state.keys[a:b], state.block_ids[a:b]))
            state.saved, state.load = max(state.saved, b), None
        # NOTE: only the prompt's full blocks, and only once all their tokens are computed.
        full = min(min(computed_after, state.num_prompt_tokens) // self.block_size, len(state.keys),
                   len(state.block_ids))
        # Newer vLLMs say how many of a request's blocks hold only verified KV (speculative
        # decoding writes draft KV ahead): never more than those. Prompt blocks always are.
        publishable = getattr(state.request, "num_publishable_block_hashes", None)
        if isinstance(publishable, int):
            full = min(full, publishable)
        if full > state.saved:
            todo = [i for i in range(state.saved, full) if not self.tiers.stored_below(state.keys[i])]
            if todo:
                meta.saves.append(BlockTransfer([state.keys[i] for i in todo], [state.block_ids[i] for i in todo]))
                if self.tally is not None:
                    self.tally.add(blocks_saved=len(todo))
            if self.events is not None and state.request is not None:
                self.events.saved(state.request, state.saved, state.keys[state.saved:full], self.block_size)
            state.saved = full

    def get_kv_connector_stats(self) -> TieredCacheStats | None:
        """Our counts since vLLM last asked (stats.py), for its logs and `/metrics`: the
        scheduler side's lookups and saves, the worker side's loads (vLLM adds them up)."""
        return self.tally.take() if self.tally is not None else self.loads.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TieredCacheStats:
        return TieredCacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> TieredCachePromMetrics:
        return TieredCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> list[Any]:
        """Our blocks stored and removed since the last call, as vLLM's KV events (block_events.py)."""
        return self.events.take() if self.events is not None else []

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None  # saves were copied out at each step: the blocks may be freed now

    # --- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = list(kv_caches.values())
        if len(self._layers) != self.spec.num_layers:
            raise ValueError(f"vLLM registered {len(self._layers)} KV layers, the model config says "
                             f"{self.spec.num_layers}")
        kind = layout_of(self._layers[0], self.spec.num_kv_heads, self.spec.head_dim)
        self._copier = block_copier(self._layers, kind, self.spec.num_kv_heads, self.spec.head_dim,
                                    self.spec.page_size)
        self._group_of = {name: i // self.tiers.layers_per_page for i, name in enumerate(kv_caches)}
        if _TIMING:
            if isinstance(self._copier, DeviceBlocks):
                ops = "our kernels" if self._copier.kernels else "torch ops"
                way = f"on {self._copier.device}: {ops}, one DMA a run"
            elif stacked_view(self._layers) is not None:
                way = "slices of one tensor (one copy a block)"
            else:
                way = "apart (one copy a block and layer)"
            print(f"[tiered-cache] {len(self._layers)} KV layers, {kind} layout, {way}", file=sys.stderr, flush=True)
        self.tiers.loads_here = True  # the scheduler here may start loads ahead (BlockTiers.prefetch)

    def promote(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Worker side: a hint that a request with this prompt is on its way (a router chose this
        engine; `worker_extension.py` brings it here): start loading the prompt's blocks the tiers
        hold, keyed as the scheduler side keys them, so the step that loads them finds them
        started. Returns the blocks started."""
        tokens = list(token_ids)
        usable = max(0, len(tokens) - 1) // self.block_size  # as get_num_new_matched_tokens asks
        return self.tiers.promote(self.tiers.keys(tokens, cache_salt or self.config.namespace)[:usable])

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredCacheMetadata)
        self._finish_load()  # a previous step's job, should one be left
        if not meta.loads:
            return
        assert self._copier is not None, "register_kv_caches comes first"
        job = LoadJob(self.tiers, self._copier, [(t.keys, t.block_ids) for t in meta.loads],
                      timing=_TIMING)
        self._job = job
        if self._layerwise:
            if self._loader is None:
                self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered-cache-vllm-load")
            self._loader.submit(job.run)
        else:
            job.run_inline()  # every group copied in before the forward starts

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self._job
        if job is not None:
            job.wait_for(self._group_of.get(layer_name, self.tiers.num_groups - 1), layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved all layers at once in wait_for_save, after the forward

    def _finish_load(self) -> None:
        """End this step's load job: every block it failed to copy in (or copied in after a layer
        had attended without waiting) is reported to vLLM, which recomputes it."""
        job, self._job = self._job, None
        if job is None:
            return
        unwaited = job.finish(set(self._group_of) if self._layerwise else set())
        self.loads.add(len(job.block_ids - job.failed), job.waited_s)
        if unwaited:
            log.warning("tiered-cache: %d layers attended without wait_for_layer_load; loading whole blocks "
                        "before the forward from now on (this step's loaded blocks are recomputed)", unwaited)
            self._layerwise = False
        self._failed.update(job.failed)
        self.tiers.load_failures += len(job.failed)

    def wait_for_save(self) -> None:
        self._finish_load()
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredCacheMetadata)
        for transfer in meta.saves:
            assert self._copier is not None, "register_kv_caches comes first"
            # A copy now (vLLM may reuse the blocks after this step); encoding and writing later.
            pages, ready = self._copier.gather(transfer.block_ids)
            self.tiers.save(transfer.keys, pages, ready)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_load()
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        self._finish_load()
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        self.tiers.flush(30.0)
