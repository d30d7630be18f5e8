"""Same-host shared memory between the store server and the instances on its node.

One vocabulary, each word for one thing:
- **arena**: the store server's RAM tier, kept in a sealed memfd that every same-host client maps
  read-only (`arena.py`, the server's side; `arena_map.py`, a client's map of it).
- **ref**: where one page's blob lies in the arena, `(position, length)`: positions are absolute
  (they only grow), so a ref names one placement of one page, never a later one.
- **tail**: the arena's published erase mark; bytes below it may already be written over. A reader
  checks `tail <= position` after it copied a page: then the bytes it copied are the page's.
- **lease**: the server's promise not to write over a ref it handed out for `LEASE_S` seconds;
  leases end by themselves, so a client that dies holding some costs nothing past that bound.
- **views**: pages lent to a caller in place in its arena map (`ArenaViews`): copy them, then ask
  `lost()`.
- **put ring**: a client's own segment for same-host Put (`put_ring.py`): the server maps it
  read-only (`put_ring_reader.py`) and copies each page out of it once, into the arena (`offers.py`).
- **prefault**: memory just past an arena's or a put ring's write head, faulted in by a background
  thread before the writes reach it (`advice.py`).
"""
