"""The store's client: `StoreClient` (store_client.py), its one Get stream on an aio channel
(get_streams.py), the bulk Get over plain TCP (bulk_client.py, bulk_endpoint.py), the one place a
read picks its transport (reads.py: `read_pages`), and a server's figures as plain data (stats.py).

The client imports only the stubs, `wire/` and the client's side of `shm/`, never the server:
the remote tier, which the cache uses, does not pull the server in (DESIGN.md §2).
"""
