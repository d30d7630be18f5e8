"""`Foreground`: requests in progress, so background work can step aside while one runs."""

from __future__ import annotations

import functools
import threading
from typing import Any, TypeVar

YIELD_S = 0.05  # longest a background step waits for requests in progress to finish


class Foreground:
    """Counts requests in progress so that background work can step aside while one runs.

    On a host whose cores also run the request path (and always for memory bandwidth), a
    background encode or network put that overlaps a request slows it; waiting for a quiet
    moment, bounded by a timeout so background work always progresses, keeps that off p99.
    """

    def __init__(self, process: Foreground | None = None) -> None:
        """`process`: a Foreground counting every request of this process too (`PROCESS`), for
        background work shared by the process's caches (an arena map's read-ahead)."""
        self._process = process
        self._active = 0
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()

    def __enter__(self) -> Foreground:
        if self._process is not None:
            self._process.__enter__()
        with self._lock:
            self._active += 1
            self._idle.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._active -= 1
            if not self._active:
                self._idle.set()
        if self._process is not None:
            self._process.__exit__()

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is in progress or `timeout` passed; True if idle."""
        return self._idle.wait(timeout)


PROCESS = Foreground()  # every request of every cache in this process (a cache's own counts here too)

_F = TypeVar("_F", bound=Any)


def request_path(method: _F) -> _F:
    """Mark a method of an object with a `core` (`CacheCore`) as a request in progress: background
    steps wait (briefly) until none is."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.core.foreground:
            return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]
