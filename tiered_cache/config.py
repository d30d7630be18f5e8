"""`CacheConfig`: every setting of a `TieredCache`, from defaults, a YAML file and the environment.

The dataclass fields are the one registry of settings: each has a type, a default, and an
environment variable `TIERED_CACHE_<FIELD>` (e.g. `TIERED_CACHE_POOL_CAPACITY=2GiB`).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from tiered_cache.events.endpoints import check_endpoint
from tiered_cache.index.eviction_queue import EvictionPolicy
from tiered_cache.model.units import parse_size
from tiered_cache.tiers.base import Tier
from tiered_cache.wire.auth import check_token
from tiered_cache.wire.codec import Codec
from tiered_cache.wire.namespaces import check_namespace
from tiered_cache.wire.options import normalize_address

ENV_PREFIX = "TIERED_CACHE_"
# Variables under the prefix that are not cache settings (read elsewhere).
ENV_NOT_SETTINGS = {"TIERED_CACHE_DIR", "TIERED_CACHE_SERVE_TOKEN"}


class WritePolicy(enum.Enum):
    WRITE_BACK = "write_back"  # pages are copied down only when evicted from the tier above
    WRITE_THROUGH = "write_through"  # new pages are copied to every tier at once


class ReusePolicy(enum.Enum):
    FASTER = "faster"  # load only the leading pages that arrive sooner than they would be recomputed
    ALWAYS = "always"  # load every page any tier holds


_SIZE_FIELDS = {"pool_capacity", "host_capacity", "disk_capacity"}


def with_hints(unknown: list[str], known: set[str]) -> str:
    """`unknown` keys, each with the closest of `known` as a "did you mean" where one is close."""
    return ", ".join(f"{u} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(u, known, 1)) else u
                     for u in unknown)


@dataclass(frozen=True)
class CacheConfig:
    namespace: str = ""
    device: str = "cpu"
    pool_capacity: int = 256 * 2**20
    host_capacity: int = 2**30
    lower_tiers: tuple[Tier, ...] = ()  # below host RAM, in order: e.g. (Tier.DISK, Tier.REDIS)
    disk_path: str | None = None
    disk_capacity: int = 10 * 2**30
    disk_fsync: bool = True
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "tiered-cache"
    redis_ttl_s: float | None = None
    redis_timeout_s: float = 1.0
    remote_addresses: tuple[str, ...] = ()  # HOST:PORT of store servers; keys spread over them
    # A file of HOST:PORT lines the remote tier follows when it changes (shards that move:
    # cache/address_file.py); remote_addresses is the ring until it is read.
    remote_addresses_file: str | None = None
    remote_token: str | None = None
    # The store servers' namespace this cache reads and writes: its token must allow it (a server
    # with a token file, server/tenants.py); None: the token's first namespace.
    remote_namespace: str | None = None
    remote_tls_ca: str | None = None  # PEM of the CA that signed the servers' certificates
    remote_timeout_s: float = 5.0  # progress deadline: a stream fails when nothing moves this long
    remote_budget_s: float | None = None  # optional bound on one whole get/put stream
    codec: Codec = Codec.RAW
    codec_min_saving: float = 0.05
    write_policy: WritePolicy = WritePolicy.WRITE_BACK
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    malloc_tuning: bool = True  # keep freed heap for reuse: see tiered_cache/device/malloc.py
    spare_output: bool = True  # get() without out=: keep one output tensor faulted in ahead (CPU pools)
    # Write-behind demotion: above `high_watermark` (fraction of device pages in use) a background
    # thread moves cold pages device -> host until `low_watermark`; host -> lower-tier writes go
    # through a queue of at most `demotion_queue` jobs (full: dropped and counted, never waited on).
    high_watermark: float = 0.9
    low_watermark: float = 0.75
    demotion_queue: int = 256
    # Prefetch: threads that bring pages up from host RAM / lower tiers ahead of `load`, and how
    # many prefetches may be in flight at once (past it `prefetch` declines; `load` fetches inline).
    prefetch_workers: int = 2
    max_prefetches: int = 16
    # Prometheus metrics of this cache at http://metrics_host:PORT/metrics (0: a free port); None: off.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_token: str | None = None  # scrapes must send `authorization: Bearer TOKEN`
    # Reuse policy (reuse.py): FASTER loads only the leading cached pages that arrive sooner than
    # the engine would recompute them, judged by moving estimates of each tier's load rate and of
    # the prefill rate; ALWAYS loads every page found. `prefill_tokens_per_s` fixes the prefill
    # rate; None learns it from the engine (`TieredCache.observe_prefill`), and until it is known
    # everything is loaded.
    reuse: ReusePolicy = ReusePolicy.FASTER
    prefill_tokens_per_s: float | None = None
    # The correctness canary (cache/canary.py): the share of cache hits an integration with the
    # model recomputes off the request path and compares with the reused KV; a tier whose pages
    # differ is quarantined for the namespace. 0: off.
    verify_fraction: float = 0.0
    # KV events (tiered_cache/events/): vLLM's BlockStored / BlockRemoved / AllBlocksCleared for
    # every page this cache's tiers gain or lose, on a ZMQ PUB socket bound at this endpoint
    # (tcp://HOST:PORT; None: off), with a replay endpoint (default: the next port). Loopback
    # unless `kv_events_beyond_loopback`: ZMQ has no token, and the events say what is cached.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_beyond_loopback: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name)))
        if len(set(self.lower_tiers)) != len(self.lower_tiers):
            raise ValueError(f"lower_tiers lists a tier twice: {[t.value for t in self.lower_tiers]}")
        if Tier.DISK in self.lower_tiers and not self.disk_path:
            raise ValueError("lower_tiers includes 'disk' but disk_path is not set")
        if Tier.REMOTE in self.lower_tiers and not self.remote_addresses:
            raise ValueError("lower_tiers includes 'remote' but remote_addresses is empty")
        if not 0 <= self.codec_min_saving < 1:
            raise ValueError(f"codec_min_saving must be in [0, 1), got {self.codec_min_saving}")
        for name in ("redis_timeout_s", "remote_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.remote_budget_s is not None and not self.remote_budget_s > 0:
            raise ValueError(f"remote_budget_s must be positive or None, got {self.remote_budget_s}")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError(f"watermarks must satisfy 0 < low_watermark < high_watermark <= 1, "
                             f"got low={self.low_watermark} high={self.high_watermark}")
        for name in ("demotion_queue", "prefetch_workers", "max_prefetches"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in 0..65535 or None, got {self.metrics_port}")
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise ValueError(f"verify_fraction must be between 0 and 1 (a share of hits), got {self.verify_fraction}")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            if getattr(self, name) is not None:
                check_endpoint(getattr(self, name), self.kv_events_beyond_loopback,
                               allow="set kv_events_beyond_loopback")
        if self.prefill_tokens_per_s is not None and not (0 < self.prefill_tokens_per_s < float("inf")):
            raise ValueError(f"prefill_tokens_per_s must be a positive number of tokens per second or None "
                             f"(learned), got {self.prefill_tokens_per_s}")

    def replace(self, **changes: Any) -> CacheConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base: CacheConfig | None = None) -> CacheConfig:
        """`base` (or the defaults) with the settings in `data`. Raises ValueError for unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config key(s): {with_hints(unknown, known)}; known: {', '.join(sorted(known))}")
        return dataclasses.replace(base or cls(), **dict(data))

    @classmethod
    def from_yaml(cls, path: str | Path, base: CacheConfig | None = None) -> CacheConfig:
        import yaml

        text = Path(path).read_text()
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
        try:
            return cls.from_dict(data, base)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: {exc}") from None

    @classmethod
    def from_env(cls, base: CacheConfig | None = None, environ: Mapping[str, str] | None = None) -> CacheConfig:
        """`base` overridden by `TIERED_CACHE_*` variables. An unknown `TIERED_CACHE_*` name is an error."""
        environ = os.environ if environ is None else environ
        data = {name[len(ENV_PREFIX):].lower(): value for name, value in environ.items()
                if name.startswith(ENV_PREFIX) and name not in ENV_NOT_SETTINGS}
        try:
            return cls.from_dict(data, base)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"environment ({ENV_PREFIX}*): {exc}") from None

    @classmethod
    def load(cls, path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> CacheConfig:
        """Defaults, then the YAML file at `path` (if any), then the environment."""
        base = cls.from_yaml(path) if path else cls()
        return cls.from_env(base, environ)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, tuple):
                value = [getattr(v, "value", v) for v in value]
            out[f.name] = value
        return out


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
E = TypeVar("E", bound=enum.Enum)


def _choice(kind: type[E], value: Any) -> E:
    """`value` as a member of `kind`, or a ValueError listing the choices."""
    try:
        return kind(getattr(value, "value", value))
    except ValueError:
        choices = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"expected one of {choices}, got {value!r}") from None


def _number(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    try:
        return float(value)
    except (ValueError, TypeError):
        raise ValueError(f"expected a number, got {value!r}") from None


def _coerce(name: str, value: Any) -> Any:
    """Turn a YAML or environment value into the field's type, or raise ValueError naming the field."""
    try:
        if name in _SIZE_FIELDS:
            return parse_size(value)
        if name == "lower_tiers":
            items = value.split(",") if isinstance(value, str) else value
            names = [str(getattr(v, "value", v)).strip().lower() for v in items]
            lower = {t.value: t for t in Tier.lower()}
            wrong = [n for n in names if n and n not in lower]
            if wrong:
                raise ValueError(f"expected one of {', '.join(map(repr, lower))}, got {wrong[0]!r}")
            return tuple(lower[n] for n in names if n)
        if name == "codec":
            codec = Codec.parse(value)
            if codec is Codec.BLOSC2 and importlib.util.find_spec("blosc2") is None:
                raise ValueError("codec 'blosc2' needs the blosc2 package: pip install blosc2")
            return codec
        if name == "write_policy":
            return _choice(WritePolicy, value)
        if name == "eviction_policy":
            return _choice(EvictionPolicy, value)
        if name == "reuse":
            return _choice(ReusePolicy, value.strip().lower() if isinstance(value, str) else value)
        if name in {"disk_fsync", "malloc_tuning", "spare_output", "kv_events_beyond_loopback"}:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text not in _TRUE | _FALSE:
                raise ValueError(f"expected true or false, got {value!r}")
            return text in _TRUE
        if name in {"codec_min_saving", "redis_timeout_s", "remote_timeout_s", "high_watermark", "low_watermark",
                    "verify_fraction"}:
            return _number(value)
        if name in {"remote_budget_s", "prefill_tokens_per_s"}:
            return None if value is None or str(value).strip().lower() in {"", "none"} else _number(value)
        if name == "metrics_port" and (value is None or str(value).strip().lower() in {"", "none"}):
            return None
        if name in {"demotion_queue", "prefetch_workers", "max_prefetches", "metrics_port"}:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(f"expected an integer, got {value!r}")
            try:
                return int(value)
            except (ValueError, TypeError):
                raise ValueError(f"expected an integer, got {value!r}") from None
        if name == "remote_addresses":  # HOST:PORT each; `serve`'s port where none is given
            items = value.split(",") if isinstance(value, str) else value
            return tuple(normalize_address(str(v)) for v in items if str(v).strip())
        if name in {"remote_token", "metrics_token"}:
            return None if value is None else check_token(str(value), name)
        if name == "remote_namespace":
            return None if value in (None, "") else check_namespace(str(value), name)
        if name in {"kv_events_endpoint", "kv_events_replay_endpoint"}:
            return None if value in (None, "", "none") else str(value)
        if name in {"remote_tls_ca", "remote_addresses_file"}:
            return None if value in (None, "") else str(value)
        if name == "redis_ttl_s":
            return None if value in (None, "", "none") else _number(value)
        if name == "disk_path":
            return None if value in (None, "") else str(Path(str(value)).expanduser())
        return str(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"bad value for {name}: {exc}") from None
