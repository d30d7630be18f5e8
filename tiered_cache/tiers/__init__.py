"""Tiers below the device pool: host RAM (decoded pages), then blob tiers (a RAM blob tier, disk,
Redis or a remote store) and the chain that holds them in order; each tier's parts beside it
(`disk_files.py`, `redis_nodes.py`, `remote_servers.py`, ...). Import tier modules directly
(`tiered_cache.tiers.disk`): only `host` needs torch, and the store server imports this package
without it."""
