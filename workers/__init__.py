"""The Ray layer: the actors (cache workers, store shards, the directory, the router) and their
driver (`cluster.py`: start / stats / stop, behind `tiered-cache cluster`).

The only layer that imports Ray at module level; the Ray benchmarks (`bench cluster`, `bench load
--ray`) live in `tiered_cache/bench/` and import it when they run. Importing this package is free.
"""
