"""tiered-cache as SGLang's HiCache storage backend (L3): SGLang's host pool <-> our store servers.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "tiered-cache", "module_path": "tiered_cache.integrations.sglang.backend",
          "class_name": "TieredCacheStorage", "interface_v1": 1, "remote_addresses": "127.0.0.1:9100"}'

The extra config's other keys: `config` (a tiered-cache YAML of `CacheConfig` settings), `model_id`
(who computed the KV, when the model path is not a local checkpoint folder), and `CacheConfig`
settings inline: `remote_addresses`, `remote_token`, `remote_namespace`, `remote_tls_ca`,
`remote_timeout_s`, `remote_budget_s`, `metrics_port` (our Prometheus figures of this backend).
An unknown key stops SGLang at start with one line naming it.

Reads go through `RemoteTier`: a server on this host is read in place in its arena, any other over
gRPC, every page checked (checksum, key, model fingerprint) as it is written into SGLang's host
pool; a page that fails ends the leading run there, so SGLang recomputes the rest. A store that is
down or slow is a miss within the tier's deadlines, its breaker skipping it until it answers again.
Nothing raises into SGLang and nothing returns None where SGLang wants a list: a fault is a miss.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from tiered_cache.integrations.sglang.pages import PageFormat, byte_view, rank_tag
from tiered_cache.integrations.sglang.settings import model_identity, store_settings
from tiered_cache.integrations.sglang.stats import serve_metrics
from tiered_cache.integrations.sglang.transfers import StoreTransfers

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def _miss_on_fault(default: Callable[..., Any]) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """A fault inside a call SGLang makes is logged and answered as `default(*args)` (a miss)."""

    def wrap(method: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(method)
        def guarded(self: TieredCacheStorage, *args: Any, **kwargs: Any) -> _T:
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:  # never into SGLang: its storage thread would die
                self.transfers.faults += 1
                log.warning("tiered-cache: %s failed (%s: %s); answered as a miss", method.__name__,
                            type(exc).__name__, exc)
                return default(*args)
        return guarded
    return wrap


def _no_hit() -> Any:
    from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

    return PoolTransferResult.empty()


def _none_moved(transfers: list[Any]) -> dict[str, list[bool]]:
    return {transfer.name: [False] * len(transfer.keys or []) for transfer in transfers}


class TieredCacheStorage(HiCacheStorage):
    """SGLang's HiCache storage backend over our store servers (module doc)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.config = store_settings(extra)
        self.model_id = model_identity(storage_config.model_name, extra.get("model_id"))
        self.rank = rank_tag(storage_config.tp_rank, storage_config.tp_size, storage_config.pp_rank,
                             storage_config.pp_size, storage_config.attn_cp_rank, storage_config.attn_cp_size,
                             replicated=storage_config.is_mla_model)
        self.transfers = StoreTransfers(self.config, record_batches=storage_config.enable_storage_metrics)
        self.format: PageFormat | None = None
        self.mem_pool_host: Any = None
        self._said_hybrid = False
        self._metrics_server = serve_metrics(self.config, self.transfers.remote)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        self.format = PageFormat.of_pool(mem_pool_host, self.model_id, self.rank)
        self.transfers.fingerprint(self.format.spec)
        log.info("tiered-cache: SGLang pages of %s (%s, %s bytes) <-> %s", self.model_id, self.rank,
                 f"{self.format.spec.bytes_per_page:,}", ", ".join(self.config.remote_addresses))

    # --- the zero-copy pair (`"interface_v1": 1`) -------------------------------------------------
    @_miss_on_fault(lambda keys, *_: [False] * len(keys))
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self.transfers.read(*self._in_pool(keys, host_indices))

    @_miss_on_fault(lambda keys, *_: [False] * len(keys))
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self.transfers.write(*self._in_pool(keys, host_indices))

    def _in_pool(self, keys: list[str], host_indices: torch.Tensor) -> tuple[PageFormat, list[bytes], list[Any]]:
        """The format, our page keys and the pool's page views of a v1 call."""
        fmt = self._format()
        return fmt, [fmt.key(k) for k in keys], fmt.pool_pages(self.mem_pool_host, host_indices, len(keys))

    # --- the generic calls: flat pages SGLang copies in and out itself -----------------------------
    @_miss_on_fault(lambda key, *_: None)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    @_miss_on_fault(lambda keys, *_: [None] * len(keys))
    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        fmt = self._format()
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        targets = [t if t is not None else self.mem_pool_host.get_dummy_flat_data_page() for t in targets]
        arrived = self.transfers.read(fmt, [fmt.key(k) for k in keys], [byte_view(t) for t in targets])
        return [t if ok else None for t, ok in zip(targets, arrived, strict=True)]

    @_miss_on_fault(lambda *_: False)
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    @_miss_on_fault(lambda *_: False)
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        fmt = self._format()
        return all(self.transfers.write(fmt, [fmt.key(k) for k in keys], [byte_view(v) for v in values]))

    # --- hybrid models (Mamba, SWA, DSA): their extra pools are not stored here yet ----------------
    @_miss_on_fault(lambda keys, *_: _no_hit())
    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """No L3 hit for a hybrid model (its state pools are not stored): SGLang recomputes."""
        self._say_hybrid_once()
        return _no_hit()

    @_miss_on_fault(lambda transfers, *_: _none_moved(transfers))
    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        self._say_hybrid_once()
        return _none_moved(transfers)

    @_miss_on_fault(lambda transfers, *_: _none_moved(transfers))
    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        self._say_hybrid_once()
        return _none_moved(transfers)

    def _say_hybrid_once(self) -> None:
        if not self._said_hybrid:
            self._said_hybrid = True
            log.warning("tiered-cache: this model's hybrid pools (Mamba/SWA state, indexers) are not stored in "
                        "tiered-cache yet: its L3 answers misses and SGLang recomputes")

    # --- presence --------------------------------------------------------------------------------
    @_miss_on_fault(lambda *_: False)
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    @_miss_on_fault(lambda *_: 0)
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading keys the store holds: one Lookup per server."""
        fmt = self._format()
        return self.transfers.leading([fmt.key(k) for k in keys])

    def clear(self) -> None:
        """A shared store is not this instance's to wipe: its servers evict. Counted, nothing deleted."""
        self.transfers.clears += 1
        log.info("tiered-cache: clear() asked; the shared store keeps its pages (its servers evict)")

    def get_stats(self) -> Any:
        """SGLang's storage metrics since the last call (pages per batch, GB/s)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        for name, values in self.transfers.batches.drain().items():
            getattr(metrics, name).extend(values)
        return metrics

    def stats(self) -> dict[str, Any]:
        """Our figures: the store tier's and this backend's."""
        return self.transfers.stats()

    def close(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.stop()
        self.transfers.close()

    def _format(self) -> PageFormat:
        if self.format is None:
            raise RuntimeError("SGLang has not registered its host pool with the backend yet")
        return self.format
