"""Reading a Redis reply off the socket straight into caller-given buffers (RESP2 and RESP3).

redis-py with hiredis reads a reply into its own buffer, then copies each value into a fresh
`bytes`: for 1 MiB page blobs that is a second copy per page and fresh memory per call. The
Redis tier's `get_into` reads an MGET reply here instead: the few bytes of framing through a
small buffer, each value's bytes with `recv_into` where the caller wants them (a page's header,
its payload in its destination, its checksum). It understands only what an MGET answers: one
array of bulk strings or nulls, or an error.
"""

from __future__ import annotations

import ssl
from typing import Any

_BUFFER_BYTES = 16 << 10  # framing is read through this; values go past it
_MAX_IOV = 1024  # buffers one recvmsg_into takes (Linux's IOV_MAX)


class ReplyError(ConnectionError):
    """The reply was not what an MGET answers (an error reply, or bytes out of protocol): the
    connection is unusable afterwards (its reply is half read), so its owner closes it."""


class ReplyReader:
    """Reads one connection's replies; `sock` is a connected socket with nothing pending on it."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        # A socket that scatters one read over many buffers (a page's blocks in a CPU pool); a TLS
        # socket does not (its recvmsg_into raises): there each buffer is read on its own.
        self.scatters = hasattr(sock, "recvmsg_into") and not isinstance(sock, ssl.SSLSocket)
        self._data = bytearray(_BUFFER_BYTES)
        self._view = memoryview(self._data)
        self._start = self._end = 0  # unread bytes are _data[_start:_end]

    def array_len(self) -> int:
        """The element count of the array reply that comes next (`*N`)."""
        line = self._line()
        if line[:1] != b"*":
            raise self._unexpected(line, "an array")
        return _count(line)

    def bulk_len(self) -> int | None:
        """The length of the bulk string that comes next (`$N`), or None for a null (`$-1`,
        RESP3's `_`). The N bytes and their CRLF are then read with `read_into` + `end_bulk`."""
        line = self._line()
        if line[:1] == b"_" or line == b"$-1":
            return None
        if line[:1] != b"$":
            raise self._unexpected(line, "a bulk string")
        return _count(line)

    def read_into(self, target: Any) -> None:
        """Fill `target` (any writable buffer) with the next len(target) bytes."""
        view = memoryview(target).cast("B")
        pos = min(len(view), self._end - self._start)
        if pos:  # what the framing reads took in already
            view[:pos] = self._view[self._start:self._start + pos]
            self._start += pos
        while pos < len(view):
            got = self.sock.recv_into(view[pos:])
            if not got:
                raise ReplyError("Redis closed the connection in the middle of a reply")
            pos += got

    def read_into_all(self, targets: list[Any]) -> None:
        """Fill each of `targets` in turn with the next bytes, one `recvmsg_into` over many of
        them at a time where the socket scatters."""
        views = [memoryview(t).cast("B") for t in targets]
        if not self.scatters:
            for view in views:
                self.read_into(view)
            return
        first = 0
        while first < len(views) and self._start < self._end:  # what the framing reads took in already
            take = min(len(views[first]), self._end - self._start)
            views[first][:take] = self._view[self._start:self._start + take]
            self._start += take
            if take == len(views[first]):
                first += 1
            else:
                views[first] = views[first][take:]
        while first < len(views):
            got = self.sock.recvmsg_into(views[first:first + _MAX_IOV])[0]
            if not got:
                raise ReplyError("Redis closed the connection in the middle of a reply")
            while got:
                if got >= len(views[first]):
                    got -= len(views[first])
                    first += 1
                else:
                    views[first] = views[first][got:]
                    got = 0

    def end_bulk(self) -> None:
        """The CRLF after a bulk string's bytes."""
        crlf = bytearray(2)
        self.read_into(crlf)
        if crlf != b"\r\n":
            raise ReplyError(f"expected CRLF after a bulk string, got {bytes(crlf)!r}")

    def _line(self) -> bytes:
        while True:
            at = self._data.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._view[self._start:at])
                self._start = at + 2
                return line
            self._fill()

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start:  # keep the partial line, at the front
            self._data[:self._end - self._start] = self._data[self._start:self._end]
            self._end -= self._start
            self._start = 0
        if self._end == len(self._data):
            raise ReplyError(f"a reply line longer than {len(self._data)} bytes")
        got = self.sock.recv_into(self._view[self._end:])
        if not got:
            raise ReplyError("Redis closed the connection in the middle of a reply")
        self._end += got

    @staticmethod
    def _unexpected(line: bytes, wanted: str) -> ReplyError:
        if line[:1] == b"-":
            return ReplyError(f"Redis answered an error: {line[1:].decode(errors='replace')}")
        return ReplyError(f"expected {wanted} in the reply, got {line[:40]!r}")


def _count(line: bytes) -> int:
    """The number after a reply's type byte (`*N`, `$N`); ReplyError (a connection error, so the
    tier counts it as one and never raises into the request path) for anything else."""
    try:
        count = int(line[1:])
    except ValueError:
        raise ReplyError(f"Redis sent {bytes(line[:40])!r} where a length was due") from None
    if count < -1:
        raise ReplyError(f"Redis sent a negative length {count}")
    return count
