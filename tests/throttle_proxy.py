"""A TCP proxy on loopback that passes bytes at a bounded rate: a slow link, for real.

`with ThrottledProxy("127.0.0.1:PORT", bytes_per_s=1_000_000) as proxy:` starts it in another
process (so its sleeps and copies never share this process's GIL) and `proxy.address` is where
to connect. Each direction of each connection is held to `bytes_per_s`: a chunk is forwarded only
once the link has "sent" the previous ones, and idle time earns no credit, so a burst after a
pause is as slow as a steady stream. Run directly: `python tests/throttle_proxy.py TARGET RATE`
prints `listening on HOST:PORT`.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

_CHUNK = 16 * 1024  # bytes forwarded per step: small enough that the rate holds within a page


def _pump(src: socket.socket, dst: socket.socket, bytes_per_s: float) -> None:
    free_at = time.monotonic()  # when the link is done "sending" what was forwarded so far
    try:
        while data := src.recv(_CHUNK):
            free_at = max(free_at, time.monotonic()) + len(data) / bytes_per_s
            delay = free_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):  # one side closed: close both, so the other pump ends too
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _serve(target: str, bytes_per_s: float) -> None:
    host, port = target.rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"listening on 127.0.0.1:{listener.getsockname()[1]}", flush=True)
    while True:
        client, _ = listener.accept()
        upstream = socket.create_connection((host, int(port)))
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(src, dst, bytes_per_s), daemon=True).start()


class ThrottledProxy:
    """The proxy in a child process, for a `with` block; `address` is HOST:PORT to connect to."""

    def __init__(self, target: str, bytes_per_s: float) -> None:
        self.target = target
        self.bytes_per_s = bytes_per_s
        self.address = ""
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> ThrottledProxy:
        self._proc = subprocess.Popen([sys.executable, str(Path(__file__)), self.target, str(self.bytes_per_s)],
                                      stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line.startswith("listening on "):
            self.__exit__()
            raise RuntimeError(f"the throttling proxy did not start: {line!r}")
        self.address = line.split()[-1]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


if __name__ == "__main__":
    _serve(sys.argv[1], float(sys.argv[2]))
