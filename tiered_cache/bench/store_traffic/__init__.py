"""`tiered-cache bench store-traffic`: traffic on a store, N client processes in a serving-like mix
against store servers (or, `--ray`, a cluster's router) for a bounded time. `bench.py` runs it;
`workload.py` (the mix), `runner.py` + `client.py` (the client processes), `report.py` + `table.py`
+ `plot.py` (figures, tables, the PNG), `rss.py` (servers' memory); `through_ray.py`,
`ray_client.py`, `chat.py`, `ray_table.py` (the same through a Ray cluster's router)."""
