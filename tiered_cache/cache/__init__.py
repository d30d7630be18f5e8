"""`TieredCache` and the parts it is built from, one job per file:

- `tiered_cache.py`: `TieredCache`, the public API, each call handed to its part.
- `core.py`: `CacheCore`, what every part shares, built once (lock, pool, tree, ledger, host RAM
  and its writer, the chain below, the copier, the reuse gate, ...); each part takes it plus only
  what is its own.
- `ledger.py`: who holds which device page (tree, handles, copies under way); `check_integrity`.
- `loader.py`: fills new device pages and hands them to the tree (`load`, `put`); its stages:
  `tier_loads.py` (plan, prefetch, load from host RAM and below), `host_loads.py` (host RAM rows
  into device pages), `arena_loads.py` (same-host store arenas into device pages, CUDA), and
  `reuse.py` (the reuse policy, whole: how far a load pays); `tensor_reads.py`: `get()`, every
  page copied once straight into the result.
- `demoter.py`: room on the device: device -> host RAM, inline or above the watermark.
- `lower_writer.py`: write-behind from host RAM to the blob tiers below.
- `sequences.py`: a sequence's own pages (write, fork, swap, drop tokens) over `forks.py`,
  `swaps.py`, `compaction.py`: copy-on-write forks, preemption by swap, retention.
- `handle.py`, `arguments.py`, `staging.py`, `spare_output.py`, `canary.py`, `stats.py`,
  `tree_view.py` + `page_tokens.py`, `background.py` + `foreground.py`, `lower_tiers.py`,
  `metrics_endpoint.py`, `warm_up.py` (what a new cache opens before its first request): what
  those use.
"""

from tiered_cache.cache.handle import CacheHandle
from tiered_cache.cache.tiered_cache import TieredCache

__all__ = ["CacheHandle", "TieredCache"]
