"""The blob tiers below host RAM that a `CacheConfig` names, in its order (disk, Redis, remote
store servers), built the same way for `TieredCache` and for the vLLM connector."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiered_cache.tiers.base import BlobTier

if TYPE_CHECKING:
    from tiered_cache.config import CacheConfig


def build_lower_tiers(config: CacheConfig, fingerprint_hex: str) -> list[BlobTier]:
    """One tier per entry of `config.lower_tiers`. `fingerprint_hex` is the model's fingerprint:
    the remote tier sends it, so servers skip and refuse blobs of other models."""
    from tiered_cache.config import LowerTier

    tiers: list[BlobTier] = []
    for kind in config.lower_tiers:
        if kind is LowerTier.DISK:
            from tiered_cache.tiers.disk import DiskTier

            tiers.append(DiskTier(config.disk_path or "", config.disk_capacity, fsync=config.disk_fsync))
        elif kind is LowerTier.REDIS:
            from tiered_cache.tiers.redis import RedisTier

            tiers.append(RedisTier(config.redis_url, config.redis_prefix, config.redis_ttl_s, config.redis_timeout_s))
        else:
            from tiered_cache.tiers.remote import RemoteTier

            tiers.append(RemoteTier(config.remote_addresses, config.remote_token, config.remote_tls_ca,
                                    config.remote_timeout_s, fingerprint=bytes.fromhex(fingerprint_hex),
                                    budget_s=config.remote_budget_s))
    return tiers
