"""The backend's settings, from the JSON SGLang hands it (`--hicache-storage-backend-extra-config`),
and the identity of the model whose KV it keeps (module doc of backend.py: the keys)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tiered_cache.config import CacheConfig
from tiered_cache.integrations.vllm.identity import model_id_for

log = logging.getLogger(__name__)
# SGLang's own keys of the extra config; the rest are ours.
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "interface_v2", "tp_lcm_size"}
_OUR_KEYS = {"config", "model_id"}


def store_settings(extra: dict[str, Any]) -> CacheConfig:
    """Our settings from SGLang's extra config: a YAML it names (`config`), then inline keys."""
    base = CacheConfig.from_yaml(extra["config"]) if extra.get("config") else CacheConfig()
    config = CacheConfig.from_dict({k: v for k, v in extra.items() if k not in _SGLANG_KEYS | _OUR_KEYS}, base)
    if not config.remote_addresses:
        raise ValueError("tiered-cache: the extra config names no store server: set remote_addresses "
                         "(HOST:PORT of `tiered-cache serve`)")
    return config


def model_identity(model_name: str | None, explicit: str | None) -> str:
    """Who computed the KV: `model_id` if given, a hash of a local checkpoint's weights, else the name."""
    if explicit:
        return str(explicit)
    if model_name and Path(model_name).is_dir():
        return model_id_for(model_name, None)
    if not model_name:
        raise ValueError("tiered-cache: SGLang gave no model name: set model_id in the extra config")
    log.warning("tiered-cache: pages keyed by the model name %r: set model_id in the extra config if other "
                "weights are served under that name", model_name)
    return model_name
