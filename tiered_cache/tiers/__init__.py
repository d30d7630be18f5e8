"""Tiers below the device pool: host RAM (decoded pages), then disk, Redis or a remote store (blobs)."""

from tiered_cache.tiers.base import BlobTier, TierStats
from tiered_cache.tiers.disk import DiskTier
from tiered_cache.tiers.host import HostTier

__all__ = ["BlobTier", "DiskTier", "HostTier", "TierStats"]
