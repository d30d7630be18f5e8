"""The bulk Get: page blobs as bytes over a plain TCP connection, beside the gRPC service.

gRPC frames every page in HTTP/2 and protobuf and hands it over through its own buffers: from
another host it moved pages at about half a raw TCP stream's speed (docs/PERFORMANCE.md). The bulk
Get carries the same pages with only a length in front of each: a client reads each straight into
a buffer it reuses, the server writes each from the blob it holds. Only a faster Get: the same
keys, token and namespace rules (a connection authenticates once) and fingerprint filter; every
page is still a self-checking blob the client verifies. Plain TCP: a server with TLS offers none.
Clients learn the port from Attach (`AttachResponse.bulk_port`).

The conversation, all integers little-endian:
- client: `MAGIC`, u16 n + the `authorization` value it would send to gRPC (`Bearer TOKEN`, or
  empty), u16 n + the namespace it asks for (empty: the token's first);
- server: u8 status (`OK` or `REFUSED`), u16 n + a message (why it refused; empty when OK);
- then any number of requests: client u32 number of keys (at most the server's `max_keys`, at
  least 1), 32 bytes of fingerprint (zeros: any model), the keys (32 bytes each); server, for
  each key in order: u32 length (0: not held) and that many bytes of blob. A request the server
  cannot take is answered with `FAILED` (u32) + u16 n + a message, and the connection closes.
"""

from __future__ import annotations

import socket
import struct

from tiered_cache.index.keys import KEY_BYTES

MAGIC = b"TCBULK01"
OK, REFUSED = 0, 1
FAILED = 0xFFFFFFFF  # in place of a length: the request failed, a message follows
NO_FINGERPRINT = bytes(KEY_BYTES)
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
MAX_TEXT = 4096  # bytes of a token, namespace or message


class BulkError(ConnectionError):
    """The bulk connection failed or was refused; the message says which and why."""


def read_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`: BulkError when it closes first (timeouts raise `TimeoutError`)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise BulkError(f"the connection closed after {got:,} of {n:,} bytes")
        got += k


def read_exact(sock: socket.socket, n: int) -> bytes:
    """`n` bytes from `sock` (as `read_into`)."""
    out = bytearray(n)
    read_into(sock, memoryview(out))
    return bytes(out)


def text(value: str) -> bytes:
    data = value.encode()[:MAX_TEXT]
    return _U16.pack(len(data)) + data


def read_text(sock: socket.socket) -> str:
    (n,) = _U16.unpack(read_exact(sock, 2))
    return read_exact(sock, n).decode(errors="replace")


def hello(authorization: str, namespace: str) -> bytes:
    """What a client sends first."""
    return MAGIC + text(authorization) + text(namespace)


def answer(status: int, message: str = "") -> bytes:
    """The server's answer to a hello."""
    return bytes([status]) + text(message)


def request(keys: list[bytes], fingerprint: bytes) -> bytes:
    """A Get of `keys` (each `KEY_BYTES`), for pages of the model `fingerprint` names (b"": any)."""
    return _U32.pack(len(keys)) + (fingerprint or NO_FINGERPRINT) + b"".join(keys)


def length(n: int) -> bytes:
    return _U32.pack(n)


def read_length(sock: socket.socket) -> int:
    return int(_U32.unpack(read_exact(sock, 4))[0])


def failure(message: str) -> bytes:
    """What the server sends in place of a length when a request fails."""
    return _U32.pack(FAILED) + text(message)
