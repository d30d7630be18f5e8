"""Plain-text rendering that several commands share: tables (`table.py`), a store server's figures
(`stats.py`) and a cache's radix tree (`tree.py`). Below `bench/`, `demo/` and `cli/`; imports the
cache layer, `model/units` and `tiers/base` (`Tier`)."""
