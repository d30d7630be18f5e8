"""`bench remote --netns`, run small as root: the store server, a bare gRPC server and a raw TCP
server in one network namespace, the reader in another; every prefix loaded whole (checked byte
for byte inside the bench) beside both limits, and the namespaces gone after."""

import subprocess

import pytest

from tiered_cache.bench.netns_bench import bench_netns, unavailable
from tiered_cache.model.spec import DType, KVSpec

SPEC = KVSpec("netns-bench-test", 4, 2, 64, dtype=DType.FP16, page_size=8)  # 16 KiB pages


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_the_store_is_read_across_two_namespaces_beside_tcp_and_grpc():
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    figures = bench_netns(SPEC.to_dict(), mib=1, rounds=2, pool_prefixes=2, settle_s=0.2)
    assert figures.nbytes == 2**20 and figures.wire_bytes > figures.nbytes  # blobs carry headers
    assert figures.load_s > 0 and figures.grpc_load_s > 0 and figures.raw_tcp_s > 0 and figures.bare_grpc_s > 0
    assert [name for name, *_ in figures.rows()] == ["raw TCP stream, same bytes", "bare gRPC stream, same bytes, kept",
                                                     "the same load over gRPC's Get (--bulk-port off)"]
    # A new reader process in the client namespace: its first load and its steady ones, each prefix
    # checked whole inside the bench (it raises otherwise).
    name, first, steady = figures.first_row()
    assert name.startswith("its steady loads") and first > 0 and steady > 0 and figures.memcpy_first_over_steady > 0
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == before
