"""Tiers below the device pool: host RAM (decoded pages), then disk, Redis or a remote store (blobs),
and the blob codec. Import tier modules directly (`tiered_cache.tiers.disk`): only `host` needs
torch, and the store server imports this package without it."""
