"""Remote tier: page blobs in one or more store servers, reached over gRPC.

Keys are spread over the servers by rendezvous (highest random weight) hashing with SHA-256, so
every instance sends a key to the same server and adding a server moves only ~1/n of the keys.
Each server has its own backoff: a server that fails (down, timeout, killed mid-stream) is
skipped for a while and its keys read as misses; nothing raises into the request path, and no
call waits past `timeout_s`. Every blob received is verified before it is returned.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import grpc

from tiered_cache.service.client import StoreClient
from tiered_cache.tiers.base import TierStats, leading_run
from tiered_cache.tiers.codec import BlobError, verify_blob

T = TypeVar("T")


def owner(key: bytes, addresses: Sequence[str]) -> int:
    """Index of the server that owns `key`: the highest SHA-256(address || key)."""
    return max(range(len(addresses)),
               key=lambda i: hashlib.sha256(addresses[i].encode() + key).digest()[:8])


class _Server:
    def __init__(self, client: StoreClient, backoff_s: float, max_backoff_s: float) -> None:
        self.client = client
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.delay = 0.0
        self.retry_at = 0.0

    @property
    def available(self) -> bool:
        return time.monotonic() >= self.retry_at

    def failed(self) -> None:
        self.delay = min(self.max_backoff_s, max(self.backoff_s, self.delay * 2))
        self.retry_at = time.monotonic() + self.delay

    def succeeded(self) -> None:
        self.delay = 0.0


class RemoteTier:
    name = "remote"
    thread_safe = True  # gRPC channels serve every thread; each call keeps its own state

    def __init__(self, addresses: Sequence[str], token: str | None = None, tls_ca: str | None = None,
                 timeout_s: float = 5.0, fingerprint: bytes = b"", backoff_s: float = 0.1,
                 max_backoff_s: float = 5.0) -> None:
        if not addresses:
            raise ValueError("the remote tier needs at least one store server address (HOST:PORT)")
        self.addresses = list(addresses)
        self.fingerprint = fingerprint  # when set, servers skip and refuse blobs of other models
        self.servers = [_Server(StoreClient(a, token, tls_ca, timeout_s), backoff_s, max_backoff_s)
                        for a in self.addresses]
        self._stats = TierStats(self.name)
        self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remote-tier-crc")
        self._closed = False

    # --- plumbing ------------------------------------------------------------------------------
    def _by_server(self, keys: Sequence[bytes]) -> dict[int, list[int]]:
        """Positions of `keys` grouped by owning server (one server: no hashing needed)."""
        if len(self.servers) == 1:
            return {0: list(range(len(keys)))}
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(owner(key, self.addresses), []).append(i)
        return groups

    def _call(self, server: _Server, fn: Callable[[StoreClient], T], default: T) -> T:
        if self._closed or not server.available:
            return default
        try:
            result = fn(server.client)
        except grpc.RpcError:
            self._stats.errors += 1
            server.failed()
            return default
        server.succeeded()
        return result

    # --- interface -----------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        out = [False] * len(keys)
        for index, positions in self._by_server(keys).items():
            reply = self._call(self.servers[index], lambda c, p=positions: c.lookup([keys[i] for i in p]), None)
            if reply is not None:
                for i, tier in zip(positions, reply.tiers, strict=False):
                    out[i] = tier != 0
        return out

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        if len(self.servers) == 1:  # the server computes the leading run itself
            reply = self._call(self.servers[0], lambda c: c.lookup(list(keys)), None)
            return reply.leading if reply is not None else 0
        return leading_run(self.contains(keys))

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)
        checks: list[tuple[int, Future[bytes | None]]] = []
        for index, positions in self._by_server(keys).items():
            wanted = {keys[i]: i for i in positions}

            def fetch(client: StoreClient, wanted: dict[bytes, int] = wanted) -> None:
                # Checksums run on another thread (zlib releases the GIL) while the stream flows.
                # Blobs received before a stream breaks stay usable: each is verified on its own.
                for item in client.get(list(wanted), self.fingerprint):
                    key = bytes(item.key)
                    i = wanted.pop(key, None)
                    if i is not None:
                        checks.append((i, self._checker.submit(self._verified, key, item.blob)))

            self._call(self.servers[index], fetch, None)
        for i, check in checks:
            out[i] = check.result()
        self._stats.record_reads(out)
        return out

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        stored = 0
        for index, positions in self._by_server([k for k, _ in items]).items():
            batch = [items[i] for i in positions]
            reply = self._call(self.servers[index], lambda c, b=batch: c.put(b, self.fingerprint), None)
            if reply is not None:
                stored += reply.stored + reply.already_held
                self._stats.bytes_in += sum(len(b) for _, b in batch)
                self._stats.errors += len(reply.refused)
        return stored

    def delete(self, keys: Sequence[bytes]) -> None:
        """Stores are shared and content-addressed: a client never deletes (the server evicts)."""

    def stats(self) -> TierStats:
        return self._stats

    def close(self) -> None:
        """Close the channels; afterwards every call is a miss (never an error)."""
        self._closed = True
        for server in self.servers:
            server.client.close()
        self._checker.shutdown(wait=False)

    def _verified(self, key: bytes, blob: bytes) -> bytes | None:
        try:
            verify_blob(blob, key)
        except BlobError:
            self._stats.corrupt += 1
            return None
        return blob
