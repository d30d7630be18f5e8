"""The backend's settings, from the JSON SGLang hands it (`--hicache-storage-backend-extra-config`),
and the identity of the model whose KV it keeps (module doc of backend.py: the keys)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from tiered_cache.config import CacheConfig, with_hints
from tiered_cache.integrations.vllm.identity import model_id_for

# SGLang's own keys of the extra config; the rest are ours.
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "interface_v2", "tp_lcm_size",
                "file_storage_path"}
_OUR_KEYS = {"config", "model_id"}


def store_settings(extra: dict[str, Any]) -> CacheConfig:
    """Our settings from SGLang's extra config: a YAML it names (`config`), then inline keys. An
    unknown key is one line naming it, the closest known key, and the backend's own keys."""
    settings = {f.name for f in fields(CacheConfig)}
    unknown = sorted(set(extra) - _SGLANG_KEYS - _OUR_KEYS - settings)
    if unknown:
        raise ValueError(f"tiered-cache: unknown key(s) in SGLang's extra config: "
                         f"{with_hints(unknown, settings | _OUR_KEYS | _SGLANG_KEYS)}; the backend's own: "
                         f"{', '.join(sorted(_OUR_KEYS))}; SGLang's: {', '.join(sorted(_SGLANG_KEYS))}; and any "
                         f"tiered-cache setting (remote_addresses, remote_token, ...: CacheConfig)")
    base = CacheConfig.from_yaml(extra["config"]) if extra.get("config") else CacheConfig()
    config = CacheConfig.from_dict({k: v for k, v in extra.items() if k not in _SGLANG_KEYS | _OUR_KEYS}, base)
    if not config.remote_addresses:
        raise ValueError("tiered-cache: the extra config names no store server: set remote_addresses "
                         "(HOST:PORT of `tiered-cache serve`)")
    return config


def model_identity(model_name: str | None, explicit: str | None) -> str:
    """Who computed the KV: `model_id` if given, else a hash of the weights of the local checkpoint
    SGLang names (its name may end in `-TAG`, the host pool's page format: kept in the identity).
    A name that is no local folder (a Hub id, a served name) raises: pages are never keyed by a
    guess, as two sets of weights can share a name."""
    if explicit:
        return str(explicit)
    name = model_name or ""
    if Path(name).is_dir():
        return model_id_for(name, None)
    for cut in (i for i, c in enumerate(name) if c == "-"):  # the tag may hold dashes, so may the folder
        if Path(name[:cut]).is_dir():
            return f"{model_id_for(name[:cut], None)}|{name[cut + 1:]}"
    raise ValueError(f"tiered-cache: cannot tell which weights {name or 'the model'!r} are (not a local checkpoint "
                     "folder): set model_id in the extra config, e.g. the Hub id with its revision")
