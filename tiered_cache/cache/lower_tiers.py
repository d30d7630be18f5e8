"""The blob tiers below host RAM that a `CacheConfig` names, in its order (disk, Redis, remote
store servers), for `TieredCache` and the vLLM connector (built by `tiers/factory.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiered_cache.tiers.base import BlobTier
from tiered_cache.tiers.factory import TierSettings, build_tiers

if TYPE_CHECKING:
    from tiered_cache.config import CacheConfig


def build_lower_tiers(config: CacheConfig, fingerprint_hex: str) -> list[BlobTier]:
    """One tier per entry of `config.lower_tiers`. `fingerprint_hex` is the model's fingerprint:
    the remote tier sends it, so servers skip and refuse blobs of other models."""
    c = config
    settings = TierSettings(
        disk_path=c.disk_path or "", disk_capacity=c.disk_capacity, disk_fsync=c.disk_fsync,
        redis_url=c.redis_url, redis_prefix=c.redis_prefix, redis_ttl_s=c.redis_ttl_s,
        redis_timeout_s=c.redis_timeout_s, remote_addresses=c.remote_addresses, remote_token=c.remote_token,
        remote_namespace=c.remote_namespace, remote_tls_ca=c.remote_tls_ca, remote_timeout_s=c.remote_timeout_s,
        remote_budget_s=c.remote_budget_s,
        fingerprint=bytes.fromhex(fingerprint_hex))
    return build_tiers([kind.value for kind in c.lower_tiers], settings)
