"""gRPC options both ends of the store share, and the message bound they derive from.

A message carries at most one page blob (a Get or Put stream item) plus protobuf framing, or a
request naming many pages (a Lookup, a PutOffered of up to 4096 pages: some 200 KiB), so both ends
bound messages by the largest page the server takes (`serve --max-page-bytes`) plus `FRAMING_BYTES`.
"""

from __future__ import annotations

DEFAULT_PORT = 50551  # `tiered-cache serve`'s
DEFAULT_MAX_PAGE_BYTES = 64 * 2**20  # the largest blob a server takes unless told otherwise
FRAMING_BYTES = 2**20  # framing around a page blob, or a request of thousands of keys, with room to spare


def max_message_bytes(max_page_bytes: int) -> int:
    """The message bound for pages of up to `max_page_bytes`."""
    return max_page_bytes + FRAMING_BYTES


DEFAULT_MAX_MESSAGE = max_message_bytes(DEFAULT_MAX_PAGE_BYTES)  # a server's default page limit + framing


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options both ends share: messages bounded by one page, a large HTTP/2 window for streams
    (16 MiB lookahead: a stream of 1 MiB messages keeps several in flight; docs/PERFORMANCE.md,
    "Remote store")."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.http2.lookahead_bytes", 16 * 2**20)]


# gRPC's own reconnect backoff starts at 1 s and grows 1.6x per failed attempt up to 120 s: a
# server down for 6 s goes unused for about 3 s after it is back (a minute after a longer outage),
# while the breaker (tiers/breaker.py) has long since let calls through to it. Reconnect at most
# 1 s apart: one refused connection a second per client is nothing for a dead server. (Not
# grpc.min_reconnect_backoff_ms: gRPC also takes it as the connect timeout, 20 s by default, and
# 100 ms would fail a handshake with a busy server.)
RECONNECT_BACKOFF_MS = (100, 1000)  # first and largest wait between connection attempts


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Client channel options: shared ones, no transparent retries (the remote tier decides),
    and a reconnect backoff short enough that a restarted server is used within a second."""
    first, largest = RECONNECT_BACKOFF_MS
    return [*message_options(max_message_bytes), ("grpc.enable_retries", 0),
            ("grpc.initial_reconnect_backoff_ms", first), ("grpc.max_reconnect_backoff_ms", largest)]


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Server options: those shared with clients, and no port sharing (a busy port is an error)."""
    return [*message_options(max_message_bytes), ("grpc.so_reuseport", 0)]


def normalize_address(address: str) -> str:
    """HOST:PORT with `serve`'s port when none is given ("localhost" would be port 443 to gRPC).
    Raises ValueError for a port that is not a number in 1..65535."""
    address = address.strip()
    if "://" in address:
        raise ValueError(f"store server address {address!r}: give HOST:PORT, not a URL")
    if not address:
        raise ValueError("an empty --address: give HOST:PORT, e.g. 127.0.0.1:50551")
    if address.startswith("["):  # [IPv6] or [IPv6]:PORT
        host, _, rest = address.partition("]")
        port = rest[1:] if rest.startswith(":") else ""
        host += "]"
    elif address.count(":") == 1:
        host, port = address.split(":")
    else:  # a bare IPv6 address or a host name
        host, port = (f"[{address}]" if ":" in address else address), ""
    if not port:
        return f"{host}:{DEFAULT_PORT}"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"port of {address!r} must be a number in 1..65535, got {port!r}")
    return f"{host}:{int(port)}"
