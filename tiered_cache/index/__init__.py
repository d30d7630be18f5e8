"""Which prefix is where: page keys (DESIGN.md §4) and the radix tree over them, with residency."""
