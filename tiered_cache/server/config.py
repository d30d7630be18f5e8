"""`ServerConfig`: the settings of `tiered-cache serve`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_cache.events.endpoints import check_endpoint
from tiered_cache.model.units import parse_size
from tiered_cache.server.tenants import Grants
from tiered_cache.wire.auth import check_token
from tiered_cache.wire.options import DEFAULT_MAX_PAGE_BYTES, DEFAULT_PORT, max_message_bytes

LOOPBACK = {"127.0.0.1", "::1", "localhost"}
MIN_CAPACITY = 2**20  # a tier smaller than this is a unit forgotten (`--ram 10` is 10 bytes), not a choice
DEFAULT_DISK = "default"  # <$TIERED_CACHE_DIR or ~/.cache/tiered-cache>/store
_INTS = ("port", "max_keys", "workers", "max_streams", "metrics_port", "bulk_port")
_FLOATS = ("stream_idle_s", "grace_s", "arena_lease_s")
_SIZES = ("ram_capacity", "disk_capacity", "max_page_bytes", "stream_buffer_bytes")
_ON = {"on": True, "1": True, "true": True, "yes": True, "off": False, "0": False, "false": False, "no": False}


def default_store_folder() -> str:
    return str(Path(os.environ.get("TIERED_CACHE_DIR", "~/.cache/tiered-cache")).expanduser() / "store")


def _coerce(name: str, value: Any) -> Any:
    """A YAML or flag value as the field's type, or ValueError naming the setting."""
    if value is None:
        return None
    if name == "bulk_port" and str(value).strip().lower() == "off":
        return None
    try:
        if name in _SIZES:
            return parse_size(value)
        if name in _INTS:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()) or \
                    (isinstance(value, str) and not value.strip().lstrip("-").isdigit()):
                raise ValueError(f"expected an integer, got {value!r}")
            return int(value)
        if name in _FLOATS:
            if isinstance(value, bool):
                raise ValueError(f"expected a number, got {value!r}")
            return float(value)
        if name == "write_through" and not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        if name == "shm" and not isinstance(value, bool):
            if str(value).strip().lower() not in _ON:
                raise ValueError(f"expected on or off, got {value!r} (the arena is the RAM tier: size it with "
                                 f"ram_capacity, --ram)")
            return _ON[str(value).strip().lower()]
    except (TypeError, ValueError) as exc:
        message = str(exc) if "expected" in str(exc) or "size" in str(exc) else f"expected a number, got {value!r}"
        raise ValueError(f"bad value for {name}: {message}") from None
    return value


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    token: str | None = None  # clients must send `authorization: Bearer <token>`
    # Tokens scoped to namespaces, one per line (server/tenants.py); instead of `token`.
    token_file: str | None = None
    tls_cert: str | None = None  # PEM files; both or neither
    tls_key: str | None = None
    ram_capacity: int = 2**30
    disk_path: str | None = DEFAULT_DISK  # None or "": no disk tier; default: default_store_folder()
    disk_capacity: int = 10 * 2**30
    redis_url: str | None = None  # a Redis tier below disk (or below RAM without disk)
    redis_prefix: str = "tiered-cache-store"
    max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES  # the largest blob accepted; messages are bounded by it
    max_keys: int = 1 << 20  # per Lookup or Get request
    workers: int = 8  # threads doing store I/O (disk, Redis, checksums) for Get and Put
    max_streams: int = 64  # Get/Put streams at once; past it calls fail fast (RESOURCE_EXHAUSTED)
    stream_idle_s: float = 30.0  # a stream with no progress for this long is ended
    stream_buffer_bytes: int = 8 * 2**20  # blobs a stream holds per step (Put batch, Get read-ahead)
    grace_s: float = 10.0  # shutdown waits this long for in-flight streams
    write_through: bool = False  # copy new blobs to the tier below RAM at once
    metrics_port: int | None = None  # serve Prometheus metrics at http://metrics_host:PORT/metrics
    metrics_host: str = "127.0.0.1"  # (with the token, when one is set)
    # The RAM tier as a shared-memory arena that clients on this host read in place (shm/arena.py);
    # off: a private RAM tier, and every page goes over gRPC.
    shm: bool = True
    # How long a page handed to a same-host client by ref is not written over (shm/arena.py).
    arena_lease_s: float = 2.0
    # The bulk Get (wire/bulk.py): plain TCP beside gRPC on `host`, this port (0: a free one);
    # None: off. Never with TLS (it would carry pages in the clear): clients then use gRPC's Get.
    bulk_port: int | None = 0
    # KV events (tiered_cache/events/): the pages this server stores and drops, as vLLM's
    # BlockStored / BlockRemoved (medium STORAGE), published on a ZMQ PUB socket at this endpoint
    # (tcp://HOST:PORT; None: off), replay on the next port unless given. ZMQ takes no token: an
    # endpoint beyond loopback is allowed only when the server itself listens beyond loopback.
    kv_events: str | None = None
    kv_events_replay: str | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name)))
        if self.disk_path == DEFAULT_DISK:
            object.__setattr__(self, "disk_path", default_store_folder())
        elif self.disk_path:
            object.__setattr__(self, "disk_path", str(Path(self.disk_path).expanduser()))
        for name in ("ram_capacity", *(("disk_capacity",) if self.disk_path else ())):
            if getattr(self, name) < MIN_CAPACITY:
                raise ValueError(f"{name} of {getattr(self, name)} bytes cannot hold a page: give a size with a "
                                 f"unit, e.g. 4GiB (a bare number is bytes; at least 1MiB)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both tls_cert and tls_key")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path and not Path(path).expanduser().is_file():
                raise ValueError(f"--{name.replace('_', '-')} {path}: no such file (a PEM file)")
        for name in ("port", "metrics_port", "bulk_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= int(value) < 65536:
                raise ValueError(f"{name} must be in 0..65535, got {value}")
        for name in ("workers", "max_streams"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not float(self.arena_lease_s) >= 0:
            raise ValueError(f"arena_lease_s must be 0 or more seconds, got {self.arena_lease_s}")
        if not float(self.stream_idle_s) > 0:
            raise ValueError(f"stream_idle_s must be positive, got {self.stream_idle_s}")
        for name in ("kv_events", "kv_events_replay"):
            if getattr(self, name) is not None:
                check_endpoint(getattr(self, name), beyond_loopback=self.host not in LOOPBACK,
                               allow="serve beyond loopback (--host with --token): its events may follow")
        check_token(self.token, "token")
        if self.token and self.token_file:
            raise ValueError("give token or token_file, not both (a token file can list the token with '*')")
        grants = Grants.from_file(Path(self.token_file).expanduser()) if self.token_file else Grants.single(self.token)
        object.__setattr__(self, "_grants", grants)
        if self.token_file and self.metrics_port is not None and not grants.operator_tokens():
            raise ValueError(f"metrics need a token that grants every namespace: add a line 'TOKEN *' to "
                             f"{self.token_file}")

    @property
    def grants(self) -> Grants:
        """The tokens the server takes and the namespaces each may use (empty: no token needed)."""
        return self._grants  # type: ignore[attr-defined, no-any-return]

    @property
    def metrics_token(self) -> str | None:
        """The token metrics scrapes must send: the server's token, or a token file's first '*' token."""
        return self.token or next(iter(self.grants.operator_tokens()), None)

    @property
    def max_message_bytes(self) -> int:
        return max_message_bytes(self.max_page_bytes)

    @property
    def serves_bulk(self) -> bool:
        """Whether the bulk Get listens (on, and no TLS: it would send pages in the clear)."""
        return self.bulk_port is not None and not self.tls_cert

    @property
    def loopback_only(self) -> bool:
        return self.host in LOOPBACK

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> ServerConfig:
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**{**data, **{k: v for k, v in overrides.items() if v is not None}})
