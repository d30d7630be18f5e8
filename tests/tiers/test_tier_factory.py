"""`tiers/factory.py`: every blob tier is built by name in one place, for the cache, the vLLM
connector and the store server."""

from __future__ import annotations

import pytest
from tier_helpers import blobs_for

from tiered_cache.tiers.disk import DiskTier
from tiered_cache.tiers.factory import TierSettings, build_tiers


def test_builds_the_named_tiers_in_order(tmp_path):
    tiers = build_tiers(["disk"], TierSettings(disk_path=str(tmp_path / "d"), disk_capacity="1MiB", disk_fsync=False))
    try:
        assert [type(t) for t in tiers] == [DiskTier]
        items = blobs_for(2)
        assert tiers[0].put(items) == 2 and tiers[0].get([k for k, _ in items]) == [b for _, b in items]
    finally:
        for tier in tiers:
            tier.close()


def test_an_unknown_kind_is_named():
    with pytest.raises(ValueError, match="'tape'"):
        build_tiers(["tape"], TierSettings())


def test_a_tier_that_fails_closes_those_built_before_it(tmp_path):
    folder = str(tmp_path / "d")
    with pytest.raises(ValueError):
        build_tiers(["disk", "redis"], TierSettings(disk_path=folder, disk_capacity="1MiB", redis_url="nonsense://"))
    again = DiskTier(folder, "1MiB")  # the first disk tier let go of its folder's lock
    again.close()
