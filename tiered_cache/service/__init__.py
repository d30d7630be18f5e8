"""The gRPC store: `server` (imports the store chain) and `client` (imports only the stubs).

`client` must stay importable without `server`, so that the remote tier, which `cache.py` uses,
does not pull the server in (DESIGN.md §2).
"""
