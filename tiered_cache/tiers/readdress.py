"""`readdress`: point a chain's remote tier at other store servers (a shard joined, left or moved)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tiered_cache.tiers.base import Readdressable
from tiered_cache.tiers.chain import TierChain
from tiered_cache.tiers.remote_servers import owner_address


def readdress(chain: TierChain, addresses: Sequence[str]) -> tuple[int, Callable[[bytes], bool]] | None:
    """Point the chain's remote tier at `addresses` and forget what the chain knew of the keys
    whose owner moved (rendezvous hashing); returns (the tier's index, which keys moved), or None
    when the ring is unchanged. Raises ValueError when the chain has no remote tier."""
    index = next((i for i, t in enumerate(chain.tiers) if isinstance(t, Readdressable)), None)
    if index is None:
        raise ValueError("this cache has no remote tier (lower_tiers has no 'remote')")
    tier = chain.tiers[index]
    assert isinstance(tier, Readdressable)
    old = tier.addresses
    if not tier.set_addresses(addresses):
        return None
    new = tier.addresses

    def moved(key: bytes) -> bool:
        return owner_address(key, old) != owner_address(key, new)

    chain.forget(index, moved)
    return index, moved
