"""The store servers a `RemoteTier` reaches, and how a call reaches them.

Keys are spread over the servers by rendezvous (highest random weight) hashing with SHA-256, so
every instance sends a key to the same server and adding a server moves only ~1/n of the keys.
Each server has its own circuit breaker (breaker.py): a server that fails (down, stalled, killed
mid-stream) is skipped while its breaker is open and its calls return their default; one probe
call then tells whether it is back. The servers owning keys of one call are asked in parallel.

The set of servers can change while the tier is in use (`set_addresses`): the servers are a
`Ring` replaced whole, and each call works on the ring it started with.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

import grpc

from tiered_cache.client.store_client import StoreClient
from tiered_cache.tiers.breaker import BreakerPolicy, BreakerState, CircuitBreaker
from tiered_cache.wire.tls import TLS_HINT, tls_mismatch

T = TypeVar("T")
_MAX_FANOUT = 16  # threads asking servers in parallel (created only as calls need them)


def owner(key: bytes, addresses: Sequence[str]) -> int:
    """Index of the server that owns `key`: the highest SHA-256(address || key)."""
    return max(range(len(addresses)),
               key=lambda i: hashlib.sha256(addresses[i].encode() + key).digest()[:8])


def owner_address(key: bytes, addresses: Sequence[str]) -> str | None:
    """The address that owns `key` among `addresses` (None when there is none)."""
    return addresses[owner(key, addresses)] if addresses else None


class Server:
    """One store server: its client and its breaker."""

    def __init__(self, client: StoreClient, policy: BreakerPolicy, address: str = "") -> None:
        self.client = client
        self.breaker = CircuitBreaker(policy, name=f"store server {address}" if address else "")

    @property
    def available(self) -> bool:
        return self.breaker.available

    @property
    def closed(self) -> bool:
        """Its breaker is closed: the last calls to it went through."""
        return self.breaker.state is BreakerState.CLOSED


@dataclass(frozen=True)
class Ring:
    """The servers at one moment: replaced whole, never changed in place."""

    addresses: tuple[str, ...]
    servers: tuple[Server, ...]


class StoreServers:
    """The ring of store servers, the calls to them through their breakers, in parallel across
    servers. `errors` and `breaker_trips` count failed calls and breakers opened; after `close()`
    every call returns its default."""

    def __init__(self, token: str | None, tls_ca: str | None, timeout_s: float, shm: bool,
                 policy: BreakerPolicy, namespace: str | None = None) -> None:
        self._client_args = (token, tls_ca, timeout_s)
        self._namespace = namespace
        self._shm = shm
        self._policy = policy
        self._lock = threading.Lock()
        self.ring = Ring((), ())
        self.closed = False
        self.errors = 0
        self.breaker_trips = 0
        # The caller's thread asks one server itself; these threads ask the others.
        self._fanout = ThreadPoolExecutor(max_workers=_MAX_FANOUT, thread_name_prefix="remote-tier")

    def set_addresses(self, addresses: Sequence[str]) -> bool:
        """Make `addresses` the ring (order does not matter; duplicates count once). Servers that
        stay keep their channel and breaker; channels of servers that left are closed (a call
        still streaming from one ends as a miss). Returns whether the ring changed."""
        wanted = tuple(sorted(set(addresses)))
        with self._lock:
            old = self.ring
            if wanted == old.addresses or self.closed:
                return False
            kept = dict(zip(old.addresses, old.servers, strict=True))
            token, tls_ca, timeout_s = self._client_args
            servers = tuple(kept.pop(a, None) or Server(StoreClient(a, token, tls_ca, timeout_s, shm=self._shm,
                                                                     namespace=self._namespace),
                                                        self._policy, a)
                            for a in wanted)
            self.ring = Ring(wanted, servers)
        for server in kept.values():
            server.client.close()
        return True

    @staticmethod
    def by_server(ring: Ring, keys: Sequence[bytes]) -> dict[int, list[int]]:
        """Positions of `keys` grouped by owning server (one server: no hashing; none: no groups)."""
        if len(ring.servers) <= 1:
            return {0: list(range(len(keys)))} if ring.servers and keys else {}
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(owner(key, ring.addresses), []).append(i)
        return groups

    def call(self, server: Server, fn: Callable[[StoreClient], T], default: T) -> T:
        """`fn(server's client)` unless closed or its breaker is open; a gRPC error (or a socket's,
        from the bulk Get) is counted, told to the breaker, and returns `default`."""
        if self.closed or not server.breaker.allow():
            return default
        try:
            result = fn(server.client)
        except (grpc.RpcError, OSError) as exc:
            self.errors += 1
            if server.breaker.failed(_why(exc)):
                self.breaker_trips += 1
            return default
        server.breaker.succeeded()
        return result

    def each_server(self, groups: dict[int, list[int]], fn: Callable[[int, list[int]], T]) -> dict[int, T]:
        """`fn(server index, positions)` for every group, in parallel across servers."""
        items = list(groups.items())
        if len(items) <= 1:
            return {index: fn(index, positions) for index, positions in items}
        futures = {index: self._fanout.submit(fn, index, positions) for index, positions in items[1:]}
        try:
            results = {items[0][0]: fn(*items[0])}
        finally:  # none outlives the call, even when one raised: its stream may still write a caller's buffers
            wait(futures.values())
        results.update({index: future.result() for index, future in futures.items()})
        return results

    def close(self) -> None:
        """Close the channels; afterwards every call returns its default."""
        with self._lock:
            self.closed = True
            ring, self.ring = self.ring, Ring((), ())
        for server in ring.servers:
            server.client.close()
        self._fanout.shutdown(wait=False)


def _why(exc: grpc.RpcError | OSError) -> str:
    """What an operator should read first when a server's calls fail: a refused token or TLS
    is not an outage (the server is up, and says no)."""
    if isinstance(exc, OSError):  # the bulk Get's socket: its own words say what happened
        return f"is down or unreachable (bulk Get: {type(exc).__name__}: {exc})"
    code = exc.code() if hasattr(exc, "code") else None
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return "is up and refuses this client's token (UNAUTHENTICATED: check remote_token)"
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return "is up and refuses this client's namespace (PERMISSION_DENIED: check remote_namespace)"
    details = exc.details() if hasattr(exc, "details") else ""
    if tls_mismatch(details or ""):
        return f"answers, but not in this client's protocol: {TLS_HINT}"
    return f"is down ({code.name if code is not None else type(exc).__name__})"
