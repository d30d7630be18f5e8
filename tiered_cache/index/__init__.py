"""Which prefix is where: page keys (DESIGN.md §4) and the radix tree of the device's pages over them."""
