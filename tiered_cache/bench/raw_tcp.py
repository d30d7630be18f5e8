"""A raw TCP stream for baselines: the wire's own speed from Python, no framing, no gRPC. Each
request is 8 bytes (u64 n); the answer is n bytes sent from memory. Run as a child process (in
`bench remote --netns`, inside the server's network namespace):

    python -m tiered_cache.bench.raw_tcp HOST   # prints "listening on HOST:PORT"; ends when stdin closes
"""

from __future__ import annotations

import socket
import struct
import sys
import threading

_CHUNK = 4 * 2**20


def _serve(conn: socket.socket) -> None:
    payload = memoryview(bytes(_CHUNK))
    with conn:
        while True:
            request = conn.recv(8, socket.MSG_WAITALL)
            if len(request) < 8:
                return
            left = struct.unpack("<Q", request)[0]
            while left:
                n = min(left, _CHUNK)
                conn.sendall(payload[:n])
                left -= n


def receive(sock: socket.socket, into: memoryview) -> int:
    """Ask for len(into) bytes and read them into `into` (the client side, `recv_into`)."""
    sock.sendall(struct.pack("<Q", len(into)))
    got = 0
    while got < len(into):
        n = sock.recv_into(into[got:])
        if not n:
            raise ConnectionError(f"the raw TCP stream closed after {got:,} of {len(into):,} bytes")
        got += n
    return got


def main() -> None:
    host = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1"
    listener = socket.create_server((host, 0))
    print(f"listening on {host}:{listener.getsockname()[1]}", flush=True)

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=_serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    sys.stdin.read()  # until the parent closes stdin


if __name__ == "__main__":
    main()
