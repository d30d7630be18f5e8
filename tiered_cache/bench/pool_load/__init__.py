"""`tiered-cache bench pool-load`: prefixes loaded into the device pool through `TieredCache` the way
engines load them (`match -> prefetch -> load`), from each tier, beside each tier's raw read.
`bench.py` runs it; `prefixes.py` (the prefixes moved), `sites.py` (where each path keeps them),
`serving.py` (the headline: new prefixes into a full pool), `first.py` (a new reader process's
first loads), `warm.py` (the side column: one prefix again, a pool with room)."""
