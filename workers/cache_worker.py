"""`CacheWorker`: a Ray actor that serves generation with a model and its own `TieredCache`.

The device pool sits on the worker's GPU (CPU on a CPU-only cluster), host RAM below it, and the
cluster's store shards as the remote tier. Pages are written through to the shards as soon as a
prompt is computed, so another worker finds the prefix there instead of prefilling it. A thread
re-reads the shard directory every `watch_interval_s` and moves the ring when shards come or go
(a departed shard's keys become misses, never errors).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import ray

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig, WritePolicy
from tiered_cache.index.keys import PageKeyer
from tiered_cache.integrations.hf_models import encode_messages, encode_prompt, kv_dtype_for, load_causal_lm
from tiered_cache.integrations.transformers import GenerationResult, generate, spec_for
from tiered_cache.metrics.families import cache_families, tier_families
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.tiers.remote_servers import owner
from tiered_cache.wire.auth import token_from
from tiered_cache.workers.config import ShardSettings, WorkerSettings
from tiered_cache.workers.directory import WORKER
from tiered_cache.workers.kv_events import member_endpoints
from tiered_cache.workers.names import DIRECTORY
from tiered_cache.workers.placement import compute_device
from tiered_cache.workers.ray_metrics import RayMetrics
from tiered_cache.workers.routing import Prompt, prompt_text

_SUMMARY_PROMPTS = 256  # recent prompts kept for the router's picture of what this worker holds
_SUMMARY_CHARS = 16384  # of each, the leading characters (the shared part is the leading part)


class CacheWorker:
    def __init__(self, name: str, settings: WorkerSettings, shard: ShardSettings | None = None,
                 watch_interval_s: float = 1.0, kv_events: str | None = None, slot: int = 0) -> None:
        import torch

        shard = shard or ShardSettings()
        self.name = name
        self.settings = settings
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.gpu_ids = [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
        self.device = compute_device(settings, self.gpu_ids, torch.cuda.is_available())
        self.model, self.tokenizer = load_causal_lm(settings.model, self.device, settings.weights_dtype)
        self.spec = spec_for(self.model, kv_dtype_for(settings.kv_dtype, self.model), page_size=settings.page_size)
        self._shard = shard
        self._use_shards = True
        self._namespace = ""  # of the page keys (CacheConfig.namespace)
        # KV events of this worker's cache (ClusterConfig.kv_events): (endpoint, replay, beyond loopback).
        self._events = member_endpoints(kv_events, slot, self.node_ip) if kv_events else None
        self.remote, self.cache = self._new_cache()
        self._generate_lock = threading.Lock()  # one forward at a time; stats never wait for it
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._summary_lock = threading.Lock()
        self.requests = 0
        self.ring_version = -1
        self._directory = ray.get_actor(DIRECTORY)
        self._refresh_ring()
        ray.get(self._directory.register.remote(WORKER, name, self._address(), self.node_id))
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, args=(watch_interval_s,), daemon=True,
                                         name="tiered-cache-ring-watch")
        self._watcher.start()
        self.metrics = RayMetrics(name, self._metric_families).start()
        self.cache.chain.observe_gets(self.metrics.observe_get)

    def _new_cache(self) -> tuple[RemoteTier, TieredCache]:
        """An empty cache: the device pool, host RAM, and the shards as its remote tier."""
        token = token_from(self._shard.token, dict(os.environ))
        remote = RemoteTier([], token=token, tls_ca=self._shard.tls_ca, allow_empty=True,
                            fingerprint=bytes.fromhex(self.spec.fingerprint))
        events = self._events or (None, None, False)
        config = CacheConfig(device=self.device, pool_capacity=self.settings.pool_capacity,
                             host_capacity=self.settings.host_capacity, write_policy=WritePolicy.WRITE_THROUGH,
                             namespace=self._namespace, verify_fraction=self.settings.verify_fraction,
                             kv_events_endpoint=events[0], kv_events_replay_endpoint=events[1],
                             kv_events_beyond_loopback=events[2])
        return remote, TieredCache(self.spec, config, lower=[remote])

    def reset(self, use_shards: bool = True, namespace: str | None = None) -> int:
        """A cold start without a new process (`bench cluster` runs each way from one): an empty
        cache, the prompts it recorded forgotten, and as its ring the directory's shards, or none
        (`use_shards=False`: a worker alone). A new `namespace` makes the shards cold for it too
        (page keys carry it: nothing stored before is found). Returns the ring's size."""
        with self._generate_lock:
            self.cache.close()
            self._use_shards = use_shards
            if namespace is not None:
                self._namespace = namespace
            self.remote, self.cache = self._new_cache()
            self.cache.chain.observe_gets(self.metrics.observe_get)
            with self._summary_lock:
                self._recent.clear()
            self.ring_version = -1
            self._refresh_ring()
        # A new cache publishes anew: the router re-reads this worker's events from the start.
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self._directory.register.remote(WORKER, self.name, self._address(), self.node_id), timeout=10)
        return len(self.remote.addresses)

    def _address(self) -> str:
        """What the directory lists for this worker: its cache's KV event endpoints (publisher, replay)
        and the cache's identity, so a new cache (a reset) is a change the router sees; "" without events."""
        events = self.cache.events
        if events is None:
            return ""
        return f"{events.publisher.endpoint} {events.publisher.replay_endpoint} {id(self.cache):x}"

    # --- ring -------------------------------------------------------------------------------------
    def _refresh_ring(self) -> None:
        try:
            version, addresses = ray.get(self._directory.shards.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            self._directory = ray.get_actor(DIRECTORY)  # restarted: the old handle is dead for good
            raise
        if version != self.ring_version:
            self.cache.set_remote_addresses(addresses if self._use_shards else [])
            self.ring_version = version

    def _watch(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            # The directory restarting or gone: keep the ring we have.
            with contextlib.suppress(ray.exceptions.RayError, ValueError, TimeoutError):
                self._refresh_ring()

    # --- serving ----------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, max_new_tokens: int | None = None, use_cache: bool = True,
                 chat: bool = True) -> dict[str, Any]:
        """Greedy answer to `prompt` (text, or chat messages: [{"role", "content"}]). Returns the
        text and tokens, how many prompt tokens were reused and from which tier (`sources`:
        device / host / remote), and the TTFT in seconds. ValueError names a bad prompt, or one
        past the model's context."""
        ids, max_new = self._encode(prompt, max_new_tokens, chat)
        return self._answer(prompt, ids, self._run(ids, max_new, use_cache), use_cache)

    def stream(self, prompt: Prompt, max_new_tokens: int | None = None, use_cache: bool = True,
               chat: bool = True) -> Iterator[dict[str, Any]]:
        """`generate`, token by token: {"token", "text"} as each is chosen (`text`: what it adds to
        the decoded answer), then the whole answer as `generate` returns it."""
        ids, max_new = self._encode(prompt, max_new_tokens, chat)
        chosen: queue.Queue[int | None] = queue.Queue()
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["result"] = self._run(ids, max_new, use_cache, chosen.put)
            except BaseException as exc:  # raised to the caller below, on its thread
                outcome["error"] = exc
            finally:
                chosen.put(None)

        threading.Thread(target=run, daemon=True, name="tiered-cache-stream").start()
        tokens: list[int] = []
        text = ""
        while (token := chosen.get()) is not None:
            tokens.append(token)
            now = self.tokenizer.decode(tokens, skip_special_tokens=True)
            yield {"token": token, "text": now[len(text):]}
            text = now
        if "error" in outcome:
            raise outcome["error"]
        yield self._answer(prompt, ids, outcome["result"], use_cache)

    def _encode(self, prompt: Prompt, max_new_tokens: int | None, chat: bool) -> tuple[list[int], int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("generate() needs a non-empty prompt string")
            ids = encode_prompt(self.tokenizer, prompt, chat)
        else:
            ids = encode_messages(self.tokenizer, prompt)
        max_new = max_new_tokens or self.settings.max_new_tokens
        if max_new <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new}")
        context = getattr(self.model.config, "max_position_embeddings", None)
        if context is not None and len(ids) + max_new > context:
            raise ValueError(f"the prompt's {len(ids):,} tokens and {max_new:,} new ones are past the model's "
                             f"context of {context:,} tokens")
        return ids, max_new

    def _run(self, ids: list[int], max_new: int, use_cache: bool,
             on_token: Callable[[int], None] | None = None) -> tuple[GenerationResult, float]:
        """The answer, and the seconds it waited for the model (requests ahead of it)."""
        arrived = time.perf_counter()
        with self._generate_lock:
            queued = time.perf_counter() - arrived
            result = generate(self.model, ids, self.cache if use_cache else None, max_new,
                              self.tokenizer.eos_token_id, on_token=on_token)
            self.requests += 1
        return result, queued

    def _answer(self, prompt: Prompt, ids: list[int], run: tuple[GenerationResult, float],
                use_cache: bool) -> dict[str, Any]:
        result, queued = run
        if use_cache:
            key = prompt_text(prompt)[:_SUMMARY_CHARS]
            with self._summary_lock:
                self._recent[key] = None
                self._recent.move_to_end(key)
                while len(self._recent) > _SUMMARY_PROMPTS:
                    self._recent.popitem(last=False)
        data = asdict(result)
        data.pop("first_logits")
        return {**data, "queued_s": queued, "worker": self.name, "node_id": self.node_id,
                "text": self.tokenizer.decode(result.tokens, skip_special_tokens=True)}

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until pages queued for host RAM and the shards are written (tests, benchmarks)."""
        return self.cache.flush(timeout_s)

    def evict(self) -> int:
        """Move every unlocked device page down to host RAM (benchmarks: a cold device)."""
        return self.cache.evict()

    def where(self, prompt: str, chat: bool = True) -> list[dict[str, Any]]:
        """Each full page of `prompt`: its key, the shard that owns it on this worker's ring, and
        whether that shard holds it now ("where does my prefix live?")."""
        ids = encode_prompt(self.tokenizer, prompt, chat)
        keys = PageKeyer(self.spec, self.cache.config.namespace).keys(ids)
        ring = self.remote.addresses
        held = self.remote.contains(keys) if ring else [False] * len(keys)
        return [{"page": i, "key": key.hex()[:16], "shard": ring[owner(key, ring)] if ring else None,
                 "held": held[i]} for i, key in enumerate(keys)]

    # --- reporting --------------------------------------------------------------------------------
    def _metric_families(self) -> list[Any]:
        stats = self.cache.stats()
        return [*tier_families(stats.tiers), *cache_families(stats)]

    def ping(self) -> str:
        return self.name

    def info(self) -> dict[str, Any]:
        return {"kind": WORKER, "name": self.name, "node_id": self.node_id, "node_ip": self.node_ip,
                "pid": os.getpid(), "device": self.device, "gpu_ids": self.gpu_ids, "model_id": self.spec.model_id,
                "weights_dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
                "kv_dtype": self.spec.dtype.value,
                "shards": self.remote.addresses, "ring_version": self.ring_version, "address": self._address(),
                "model": self.settings.model, "fingerprint": self.spec.fingerprint,
                "namespace": self.cache.config.namespace, "page_size": self.spec.page_size,
                "bytes_per_token": self.spec.bytes_per_page // self.spec.page_size}

    def stats(self) -> dict[str, Any]:
        """Info plus the cache's figures (`CacheStats.to_dict()`) and requests served."""
        return {**self.info(), "requests": self.requests, "cache": self.cache.stats().to_dict()}

    def tree(self, max_nodes: int = 500) -> dict[str, Any]:
        """This worker's radix tree (`TieredCache.prefix_tree`), node text decoded with its tokenizer."""
        view = self.cache.prefix_tree(max_nodes, decode=lambda ids: self.tokenizer.decode(ids))
        return {**view, "worker": self.name}

    def prefix_summary(self) -> list[str]:
        """Leading characters of the prompts this worker served recently, newest last: enough for a
        router (after its own restart) to know which prefixes this worker holds."""
        with self._summary_lock:
            return list(self._recent)

    def shutdown(self) -> None:
        self._stop.set()
        self.metrics.stop()
        self.cache.close()
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self._directory.unregister.remote(self.name), timeout=5)
