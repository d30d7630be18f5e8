"""The store server (`tiered-cache serve`): `StoreServer` (store_server.py) runs the
`tiered_cache.v1.KVCache` handlers (handlers.py) over a `BlobStore` (store.py: a RAM blob tier in
front of disk and/or Redis), with its settings (config.py), what keeps it serving under load
(streams.py), what it says at start (startup.py), and a child process of it (process.py).

Nothing here is imported by the client: both speak through `wire/` (DESIGN.md §2).
"""
