"""Ray actors (GPU worker, store shards, discovery) and the cluster commands.

The only layer that imports Ray; it arrives with a later issue. Importing this package is free.
"""
