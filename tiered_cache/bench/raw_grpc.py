"""A bare gRPC server for baselines: streams N byte messages of a given size from memory, takes a
client stream of byte messages (counting their bytes, keeping none), and answers a unary echo.
Same HTTP/2 options as the store server. It is deliberately not the store: it is the bare-gRPC
baseline that `bench remote` sets the store's own Get (client/get_streams.py) beside. Run as a child
process:

    python -m tiered_cache.bench.raw_grpc [HOST]   # prints "listening on HOST:PORT" (127.0.0.1)
"""

from __future__ import annotations

import struct
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from tiered_cache.wire.options import server_options

_MAX = 80 * 2**20
STREAM = "/raw.Raw/Stream"
ECHO = "/raw.Raw/Echo"
ABSORB = "/raw.Raw/Absorb"


def _stream(request: bytes, context: Any) -> Iterator[bytes]:
    count, size = struct.unpack("<QQ", request)
    payload = bytes(size)
    for _ in range(count):
        yield payload


def _absorb(requests: Iterator[bytes], context: Any) -> bytes:
    return struct.pack("<Q", sum(len(r) for r in requests))


def _echo(request: bytes, context: Any) -> bytes:
    return struct.pack("<Q", len(request))


def main() -> None:
    # A thread per stream (up to 32): the multi-client ceiling must not be capped by threads.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=server_options(_MAX))
    handlers = {"Stream": grpc.unary_stream_rpc_method_handler(_stream),
                "Echo": grpc.unary_unary_rpc_method_handler(_echo),
                "Absorb": grpc.stream_unary_rpc_method_handler(_absorb)}
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("raw.Raw", handlers)])
    host = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1"  # another only in a bench's own network namespace
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    print(f"listening on {host}:{port}", flush=True)
    threading.Event().wait() if sys.stdin is None else sys.stdin.read()  # until the parent closes stdin
    server.stop(0)


if __name__ == "__main__":
    main()
