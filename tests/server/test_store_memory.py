"""A store server's memory is what its RAM tier counts: a real server in another process, its RAM
tier overfilled by Puts over gRPC, keeps its own resident memory (heap, and its arena with shared
memory on) within 1.5x `--ram` plus a fixed 32 MiB, for pages from the smallest the server accepts
(~124 bytes as a blob) to 64 MiB. Same-host clients' Put rings the server maps are counted apart:
within what the server reports mapping (`shm_offered_bytes`), itself bounded. A blob kept as a view
into its received message, an entry cost counted short, or an arena keeping a record per tiny page
would grow past it (measured before the fixes: 1.97x for a 96 MiB tier of the smallest pages).

`long` (make test-long): a 48 MiB tier of the smallest pages is some 800,000 Puts."""

from __future__ import annotations

import os

import pytest
from service_helpers import checksummed

from tiered_cache.client.store_client import StoreClient
from tiered_cache.model.spec import KVSpec
from tiered_cache.server.process import StoreProcess
from tiered_cache.shm.put_ring import PUT_RING
from tiered_cache.wire import codec
from tiered_cache.wire.codec import Codec

pytestmark = pytest.mark.long
MiB = 2**20
FIXED_BOUND = 32 * MiB  # the interpreter's arenas, gRPC's buffers, a batch in flight

SPECS = {  # (spec, --ram): the smallest page the server accepts, 64 KiB and 64 MiB
    "tiny": (KVSpec("rss-tiny", 1, 1, 1, page_size=1), 48 * MiB),  # enough that 2x could not pass
    "medium": (KVSpec("rss-medium", 4, 4, 64, page_size=16), 24 * MiB),
    "large": (KVSpec("rss-large", 32, 8, 128, page_size=64), 136 * MiB),
}


def rss(pid: int) -> tuple[int, int]:
    """(the server's own resident bytes, resident bytes of clients' Put rings it maps)."""
    own = rings = 0
    ring = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(maxsplit=1)[0]:  # a mapping's first line
                ring = f"memfd:{PUT_RING}" in line
            elif line.startswith("Rss:"):
                size = int(line.split()[1]) * 1024
                rings, own = (rings + size, own) if ring else (rings, own + size)
    return own, rings


def blobs(spec: KVSpec, count: int, start: int) -> list[tuple[bytes, bytes]]:
    """`count` distinct pages of `spec` (keys of their own; the server never derives keys)."""
    shape, dtype_id = spec.staging_shape(1)[1:], codec._DTYPES.index(spec.dtype)
    payload = os.urandom(spec.bytes_per_page)
    out = []
    for i in range(start, start + count):
        key = i.to_bytes(32, "little")
        out.append((key, checksummed(spec, Codec.RAW.wire_id, dtype_id, shape, spec.bytes_per_page, payload, key)))
    return out


@pytest.mark.parametrize("shm", ["off", "on"])
@pytest.mark.parametrize("size", list(SPECS))
def test_resident_memory_stays_within_the_ram_tiers_bound(size, shm):
    spec, ram = SPECS[size]
    if shm == "on" and size != "tiny":
        pytest.skip("the shared-memory arena's bound does not depend on the page size: tiny pages cover it")
    blob_bytes = len(blobs(spec, 1, 0)[0][1])
    # Twice what the tier holds: it evicts all along the second half, and an arena's head comes
    # round its whole data (every byte of it resident) with pages that small.
    total = 2 * ram
    per_put = max(1, min(4096, 8 * MiB // blob_bytes))
    # No disk below: the bound is the RAM tier's (a disk tier's index grows with its own capacity).
    # With shared memory on, the client puts as a same-host client does: through its Put ring.
    args = ["--ram", str(ram), "--shm", shm, "--max-page", str(blob_bytes), "--no-disk"]
    with StoreProcess(args) as server, StoreClient(server.address, shm=shm == "on", timeout_s=60,
                                                   max_message_bytes=blob_bytes + MiB) as client:
        pid = server.proc.pid
        client.put(blobs(spec, 1, 10**9))  # the server's first Put: its pools and buffers exist
        before, _ = rss(pid)
        sent = 0
        while sent < total:
            batch = blobs(spec, per_put, sent // blob_bytes)
            ack = client.put(batch)
            assert not ack.refused, ack.refused[0].message
            sent += per_put * blob_bytes
        own, rings = rss(pid)
        stats = client.stats()
        tiers = {t.name: t for t in stats.tiers}
        assert 0 < tiers["ram"].used_bytes <= ram and tiers["ram"].evictions > 0
        # The tier charges what its entries cost: far more than their blobs when pages are tiny.
        assert tiers["ram"].used_bytes > tiers["ram"].pages * blob_bytes
        offered = stats.server.shm_offered_bytes
    assert (offered > 0) == (shm == "on") and rings <= offered
    grown = own - before
    assert grown <= 1.5 * ram + FIXED_BOUND, (
        f"{size} pages ({blob_bytes:,} B), shm {shm}: the server's own RSS grew {grown / MiB:.0f} MiB "
        f"for a {ram / MiB:.0f} MiB RAM tier (clients' Put rings apart: {rings / MiB:.0f} MiB)")
