"""The Ray layer: the actors (cache workers, store shards, the directory, the router) and their
driver (`cluster.py`: start / stats / stop, behind `tiered-cache cluster`).

The only layer that imports Ray at module level; the Ray benchmarks (`bench cluster`, `bench store-traffic
--ray`) live in `tiered_cache/bench/` and import it when they run. Importing this package is free.
"""

# The folder is installed as `tiered_cache.workers` (pyproject's package-dir); a checkout's root on
# sys.path would also offer it as a top-level `workers`, a second copy of every actor class under a
# name PyPI gives to another project. Refuse that name rather than load the layer twice.
if __name__ != "tiered_cache.workers":
    raise ImportError(f"workers/ is imported as tiered_cache.workers, not as {__name__!r}", name=__name__)
