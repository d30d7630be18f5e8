"""The one place blob tiers are built by name: the cache (`CacheConfig.lower_tiers`), the vLLM
connector and the store server (its tiers below RAM) all come here, each turning its own
config into `TierSettings`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiered_cache.tiers.base import BlobTier, Tier

KINDS = tuple(tier.value for tier in Tier.lower())


@dataclass(frozen=True)
class TierSettings:
    """What the blob tiers need; each field is used only by the tier its name starts with."""

    disk_path: str = ""
    disk_capacity: int | str = 0
    disk_fsync: bool = True
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "tiered-cache"
    redis_ttl_s: float | None = None
    redis_timeout_s: float = 1.0
    remote_addresses: Sequence[str] = ()
    remote_token: str | None = None
    remote_namespace: str | None = None  # the store servers' namespace (server/tenants.py)
    remote_tls_ca: str | None = None
    remote_timeout_s: float = 5.0
    remote_budget_s: float | None = None
    fingerprint: bytes = b""  # the model's: a remote tier sends it, so servers refuse other models' blobs


def build_tier(kind: str, settings: TierSettings) -> BlobTier:
    """One tier: "disk", "redis" or "remote" (a store server, or several by rendezvous hashing).
    Raises ValueError for another kind, and what the tier raises for settings it refuses."""
    if kind == Tier.DISK:
        from tiered_cache.tiers.disk import DiskTier

        return DiskTier(settings.disk_path, settings.disk_capacity, fsync=settings.disk_fsync)
    if kind == Tier.REDIS:
        from tiered_cache.tiers.redis import RedisTier

        return RedisTier(settings.redis_url, settings.redis_prefix, settings.redis_ttl_s, settings.redis_timeout_s)
    if kind == Tier.REMOTE:
        from tiered_cache.tiers.remote import RemoteTier

        return RemoteTier(settings.remote_addresses, settings.remote_token, settings.remote_tls_ca,
                          settings.remote_timeout_s, fingerprint=settings.fingerprint,
                          budget_s=settings.remote_budget_s, namespace=settings.remote_namespace)
    raise ValueError(f"unknown tier kind {kind!r}; expected one of {', '.join(KINDS)}")


def build_tiers(kinds: Sequence[str], settings: TierSettings) -> list[BlobTier]:
    """One tier per kind, in order. A tier built before one that fails is closed again."""
    tiers: list[BlobTier] = []
    try:
        for kind in kinds:
            tiers.append(build_tier(kind, settings))
    except BaseException:
        for tier in tiers:
            close = getattr(tier, "close", None)
            if close is not None:
                close()
        raise
    return tiers
