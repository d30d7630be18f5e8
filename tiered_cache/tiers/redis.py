"""Redis tier: page blobs in a real Redis or a Redis Cluster (redis-py + hiredis), keys under a prefix.

URLs:
- `redis://[[user]:password@]host:port/db` (or `rediss://` for TLS): one Redis server.
- `redis+cluster://[[user]:password@]host:port[,host:port...]` (or `rediss+cluster://`): a Redis
  Cluster through redis-py's `RedisCluster`. Any listed node that answers gives the slot map;
  list several so that the tier can start while one is down. Pages spread over the masters by
  the hash slot of their key (the prefix may not hold a `{` hash tag, which would put every page
  on one master); each batch is grouped by master and pipelined to each, the masters in
  parallel (one MGET per slot, SET / EXISTS per key, DEL per slot).

Redis bounds itself (`maxmemory` + an LRU `maxmemory-policy`, see deploy/redis.conf). Every call
has a socket timeout. Retries are in two places only, neither hand-written here:
- inside a call, redis-py's own `Retry`, pinned here: one retry, after a few ms, of a broken
  connection, never of a timeout (the default object redis-py builds allows ten retries with up
  to a second between them, timeouts included; a hung Redis must cost one timeout, no more);
- across calls, a circuit breaker per server or cluster master (breaker.py): one that fails
  answers misses and drops puts at once, counts an error, and is probed again after a cooldown,
  so the other masters of a cluster keep serving. A failure or a MOVED reply also re-reads the
  slot map on the next call.
Nothing raises into the request path.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote

from tiered_cache.tiers.base import TierStats, leading_run
from tiered_cache.tiers.breaker import BreakerPolicy, CircuitBreaker, breaker_states
from tiered_cache.tiers.resp_reader import ReplyReader
from tiered_cache.wire.codec import (
    BlobError,
    PageDest,
    check_raw_pieces,
    decode_into,
    dest_parts,
    raw_blob_size,
    raw_header_size,
    verify_blob,
)

if TYPE_CHECKING:
    from tiered_cache.model.spec import KVSpec

_INFO_MAX_AGE_S = 1.0  # stats() asks Redis (INFO, DBSIZE) at most once a second

T = TypeVar("T")
# A large read buffer: the default 32 KiB measured at half the throughput for MiB values.
SOCKET_READ_SIZE = 1 << 20
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS
# Threads beside the caller's that pipeline to a cluster's masters at once: 256 x 1 MiB through 3
# masters measured ~1.4x put and ~1.2x get against one master after another.
_FANOUT_THREADS = 7
_GET_PARTS = 4  # a large get is fetched in this many MGETs, each checked while the next arrives
_MIN_GET_PART = 8  # keys; a get of fewer is one MGET, checked on the caller's thread
# get_into asks for about this many bytes per MGET, the next MGET sent before this one's reply is
# read: Redis writes a reply only once its whole command has run, and one MGET of 256 values of
# 1 MiB ran at half the speed of MGETs of 16 MiB (docs/PERFORMANCE.md, issue 33 item 3).
MGET_INTO_BYTES = 16 << 20


class _NoSocket(Exception):
    """A redis-py connection without the socket `get_into` reads replies from."""


def _intact(check: Callable[[], None]) -> bool:
    """Whether `check` passes (it raises BlobError for a blob that must not be used)."""
    try:
        check()
    except BlobError:
        return False
    return True


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]] | None:
    """The startup nodes (host, port) and connection settings of a `redis+cluster://` URL, or
    None for any other URL. Raises ValueError for a cluster URL that is not of the form above."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        return None
    netloc, _, path = rest.partition("/")
    if path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0 and takes no options; got '/{path}' in its URL")
    userinfo, at, hosts = netloc.rpartition("@")
    settings: dict[str, Any] = {"ssl": True} if CLUSTER_SCHEMES[scheme.lower()] else {}
    if at:
        user, colon, password = userinfo.partition(":")
        settings.update({"username": unquote(user) or None, "password": unquote(password) if colon else None})
    nodes = []
    for part in hosts.split(","):
        host, colon, port = part.strip().rpartition(":")
        if not (colon and host and port.isdigit()):
            raise ValueError(f"expected HOST:PORT[,HOST:PORT...] in a {scheme}:// URL, got {part.strip()!r}")
        nodes.append((host.strip("[]"), int(port)))
    return nodes, settings


def retry_policy() -> Any:
    """redis-py's retry inside one call: once, after 2-10 ms, and only for a broken connection."""
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.retry import Retry

    return Retry(ExponentialBackoff(cap=0.01, base=0.002), 1, supported_errors=(RedisConnectionError,))


class _Node:
    """One Redis server (the only one, or a cluster master): its client and its breaker."""

    def __init__(self, client: Any, address: str, breaker: CircuitBreaker) -> None:
        self.client = client
        self.address = address
        self.breaker = breaker


def _single_node(client: Any, breaker: CircuitBreaker) -> _Node:
    """The node of a one-server URL, named host:port (never the URL: it may hold a password)."""
    kwargs = client.connection_pool.connection_kwargs
    address = kwargs.get("path") or f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
    breaker.name = breaker.name or f"Redis {address}"
    return _Node(client, address, breaker)


class RedisTier:
    name = "redis"
    thread_safe = True  # redis-py's connection pools serve every thread

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "tiered-cache",
                 ttl_s: float | None = None, timeout_s: float = 1.0, breaker: BreakerPolicy | None = None) -> None:
        """Raises ValueError for a malformed URL, or a cluster key prefix with a `{`."""
        import redis

        self._redis_errors = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)
        self._options: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                             socket_read_size=SOCKET_READ_SIZE, retry=retry_policy())
        self.url = url
        self._startup = parse_cluster_url(url)
        self.cluster = self._startup is not None
        if self.cluster and "{" in prefix:
            raise ValueError(f"a Redis Cluster key prefix may not contain '{{' (a hash tag would put every "
                             f"page on one master), got {prefix!r}")
        self.prefix = prefix.encode() + b":"
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else None
        self._policy = breaker or BreakerPolicy(cooldown_s=0.05)
        self._single = None if self.cluster else _single_node(redis.Redis.from_url(url, **self._options),
                                                              CircuitBreaker(self._policy))
        self._cluster: Any = None  # RedisCluster, connected on first use
        self._topology = CircuitBreaker(self._policy)  # (re)reading the slot map
        self._stale = True  # the slot map must be (re)read before the next call
        self._nodes: dict[str, _Node] = {}  # cluster masters by "host:port"
        self._last_failed: str | None = None  # the master that failed last: asked last for the slot map
        self._lock = threading.Lock()  # the cluster client, slot map, `_nodes` and `_fanout`
        self._fanout: ThreadPoolExecutor | None = None  # asks a cluster's masters in parallel
        self._checks: ThreadPoolExecutor | None = None  # checks a part of a get while the next arrives
        self._stats = TierStats(self.name)
        self._info_at = -_INFO_MAX_AGE_S  # when stats() last asked the servers
        self._scratch = threading.local()  # get_into's reused blob buffer, one per calling thread

    def _k(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def name_of(self, key: bytes) -> bytes:
        """The Redis key `key`'s blob is stored under: for tools that read it raw (benches)."""
        return self._k(key)

    @property
    def available(self) -> bool:
        """False while the breaker is open (a cluster: while every known master's is)."""
        if self._single is not None:
            return self._single.breaker.available
        return any(n.breaker.available for n in list(self._nodes.values())) or self._topology.available

    # --- routing -------------------------------------------------------------------------------
    def _failed(self, breaker: CircuitBreaker, node: _Node | None = None) -> None:
        self._stats.errors += 1
        if breaker.failed():
            self._stats.breaker_trips += 1
        self._stale = True
        if node is not None:
            self._last_failed = node.address

    def _read_slot_map(self) -> None:
        """Connect to the cluster, or re-read its slot map, when a failure may have changed it."""
        if not self._stale or not self._topology.allow():
            return
        from redis.cluster import ClusterNode, RedisCluster

        try:
            if self._cluster is None:
                nodes, settings = self._startup
                # A failed master is this tier's breaker's to skip, not redis-py's to wait on.
                self._cluster = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes],
                                             require_full_coverage=False, **settings, **self._options)
            else:  # the master that failed last may be hung: asking it first could cost a timeout
                self._cluster.nodes_manager.initialize(last_failed_node_name=self._last_failed)
        except self._redis_errors:
            self._failed(self._topology)
            return
        self._topology.succeeded()
        self._stale = False

    def _node(self, cluster_node: Any) -> _Node:
        node = self._nodes.get(cluster_node.name)
        if node is None or node.client is not cluster_node.redis_connection:
            # Same address, new client: it keeps its breaker (the server is the same).
            breaker = node.breaker if node is not None else CircuitBreaker(self._policy,
                                                                              name=f"Redis {cluster_node.name}")
            node = self._nodes[cluster_node.name] = _Node(cluster_node.redis_connection, cluster_node.name, breaker)
        return node

    def _route(self, names: Sequence[bytes], positions: Sequence[int] | None = None) -> dict[_Node, list[list[int]]]:
        """Positions of `names` (those given, else all) grouped by node, then by hash slot (one
        server: one group). Names whose slot has no known master are left out, as are all names
        while no slot map is known."""
        positions = range(len(names)) if positions is None else positions
        if self._single is not None:
            return {self._single: [list(positions)]}
        from redis.crc import key_slot
        from redis.exceptions import SlotNotCoveredError

        by_node: dict[_Node, dict[int, list[int]]] = {}
        with self._lock:
            self._read_slot_map()
            if self._cluster is None:
                return {}
            manager = self._cluster.nodes_manager
            for i in positions:
                slot = key_slot(names[i])
                try:
                    node = self._node(manager.get_node_from_slot(slot))
                except SlotNotCoveredError:
                    self._stale = True
                    continue
                by_node.setdefault(node, {}).setdefault(slot, []).append(i)
        return {node: list(slots.values()) for node, slots in by_node.items()}

    def _masters(self) -> list[_Node]:
        if self._single is not None:
            return [self._single]
        with self._lock:
            self._read_slot_map()
            if self._cluster is None:
                return []
            return [self._node(n) for n in self._cluster.get_primaries()]

    def _on(self, node: _Node, fn: Callable[[Any], T], default: T) -> T:
        """`fn(node's client)` unless the node's breaker is open; on a Redis or socket error count
        it, tell the breaker and return `default`."""
        if not node.breaker.allow():
            return default
        try:
            result = fn(node.client)
        except self._redis_errors:
            self._failed(node.breaker, node)
            return default
        node.breaker.succeeded()
        return result

    def _each_node(self, routes: dict[_Node, list[list[int]]], fn: Callable[[_Node, list[list[int]]], T]
                   ) -> list[T]:
        """`fn(node, groups)` for every node of `routes`, in parallel (the caller's thread runs the first)."""
        items = list(routes.items())
        if len(items) <= 1:
            return [fn(node, groups) for node, groups in items]
        if self._fanout is None:
            with self._lock:
                if self._fanout is None:
                    self._fanout = ThreadPoolExecutor(max_workers=_FANOUT_THREADS, thread_name_prefix="redis-tier")
        futures = [self._fanout.submit(fn, node, groups) for node, groups in items[1:]]
        return [fn(*items[0]), *(future.result() for future in futures)]

    def _pipelined(self, names: Sequence[bytes], queue: Callable[[Any, list[int]], object],
                   positions: Sequence[int] | None = None) -> list[tuple[list[int], list[Any]]]:
        """For each slot group of `names` (of those at `positions`, else all), `queue(pipeline,
        positions)` queues its commands; each node runs its groups in one pipeline. Returns
        (positions, replies) of the groups answered: not those of a node that is down, nor a group
        with an error reply (MOVED, CLUSTERDOWN, OOM), which also backs its node off."""
        answered: list[tuple[list[int], list[Any]]] = []
        if not names:
            return answered

        def run(node: _Node, groups: list[list[int]]) -> list[list[Any]] | None:
            def send(client: Any) -> list[list[Any]]:
                pipe = client.pipeline(transaction=False)
                ends = []
                for positions in groups:
                    queue(pipe, positions)
                    ends.append(len(pipe))
                replies = pipe.execute(raise_on_error=False)
                return [replies[start:end] for start, end in zip([0, *ends], ends, strict=False)]

            return self._on(node, send, None)

        routes = self._route(names, positions)
        for (node, groups), per_group in zip(routes.items(), self._each_node(routes, run), strict=True):
            if per_group is None:
                continue
            failed = [any(isinstance(r, Exception) for r in replies) for replies in per_group]
            if any(failed):
                self._failed(node.breaker, node)
            answered.extend((positions, replies) for positions, replies, bad in zip(groups, per_group, failed,
                                                                                strict=True) if not bad)
        return answered

    # --- interface -------------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        names = [self._k(k) for k in keys]
        out = [False] * len(keys)
        for positions, replies in self._pipelined(names, lambda pipe, group: [pipe.exists(names[i]) for i in group]):
            for i, found in zip(positions, replies, strict=True):
                out[i] = bool(found)
        return out

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        return leading_run(self.contains(keys))

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Verified blobs (None: missing or corrupt). A large get is fetched in `_GET_PARTS` MGETs,
        one after another, and each part's checksums run on a helper thread while the next part
        arrives (CRC-32C releases the GIL): the check costs about one copy of the blobs, ~10% of
        an MGET here, and would otherwise come after the whole reply."""
        names = [self._k(k) for k in keys]
        out: list[bytes | None] = [None] * len(keys)
        size = max(_MIN_GET_PART, -(-len(keys) // _GET_PARTS))
        corrupt: list[bytes] = []
        checking = []
        for start in range(0, len(keys), size):
            part = range(start, min(len(keys), start + size))
            for positions, (blobs,) in self._pipelined(names, lambda pipe, group: pipe.mget([names[i] for i in group]),
                                                       part):
                for i, blob in zip(positions, blobs, strict=True):
                    out[i] = blob
            if part.stop == len(keys):  # the last part (or the only one): checked here, beside the others
                corrupt += self._check(keys, out, part)
            else:
                checking.append(self._checker().submit(self._check, keys, out, part))
        corrupt += [key for check in checking for key in check.result()]
        self._stats.record_reads(out)
        if corrupt:
            self._stats.corrupt += len(corrupt)
            self.delete(corrupt)
        return out

    def get_into(self, keys: Sequence[bytes], dests: Sequence[PageDest], spec: KVSpec) -> list[int]:
        """Write each key's page of `spec`, verified, into `dests[i]` (codec.py's destinations);
        returns the stored size of each blob whose page arrived, 0 for a miss. From one Redis
        server the MGET replies are read off the socket straight into the destinations
        (`resp_reader.py`: no blob per page, no fresh memory), each page checked where it lands;
        from a cluster, the blobs of `get` are decoded. A blob that is corrupt, or no page of
        `spec`, is a miss: counted and deleted."""
        if self._single is None:
            return self._decoded_into(keys, dests, spec)
        corrupt: list[bytes] = []
        try:
            got = self._on(self._single, lambda client: self._mget_into(client, keys, dests, spec, corrupt), None)
        except _NoSocket:  # a redis-py that keeps its socket elsewhere: its blobs, decoded here
            return self._decoded_into(keys, dests, spec)
        arrived = got if got is not None else [0] * len(keys)
        self._stats.hits += sum(1 for n in arrived if n)
        self._stats.misses += sum(1 for n in arrived if not n)
        self._stats.bytes_out += sum(arrived)
        if corrupt:
            self._stats.corrupt += len(corrupt)
            self.delete(corrupt)
        return arrived

    def _mget_into(self, client: Any, keys: Sequence[bytes], dests: Sequence[PageDest], spec: KVSpec,
                   corrupt: list[bytes]) -> list[int]:
        """`get_into` on one server: MGETs of ~`MGET_INTO_BYTES`, one ahead, read by hand on a
        connection of the client's pool. Raises what the socket raises (the caller's `_on` counts
        it); a connection left mid-reply is closed, never given back dirty."""
        names = [self._k(k) for k in keys]
        arrived = [0] * len(keys)
        step = max(1, MGET_INTO_BYTES // raw_blob_size(spec))
        pool = client.connection_pool
        conn = pool.get_connection()  # connected, with nothing pending (the pool checks)
        sock = getattr(conn, "_sock", None)  # where redis-py (8.x) keeps the connection's socket
        if not isinstance(sock, socket.socket):  # (an ssl.SSLSocket is one too)
            pool.release(conn)
            raise _NoSocket
        clean = False
        try:
            reader = ReplyReader(sock)
            conn.send_command("MGET", *names[:step])
            for start in range(0, len(keys), step):
                if start + step < len(keys):  # Redis builds the next reply while this one is read
                    # No health check here: its PING's reply would be read in place of this MGET's.
                    conn.send_command("MGET", *names[start + step:start + 2 * step], check_health=False)
                part = range(start, min(start + step, len(keys)))
                if reader.array_len() != len(part):
                    raise ConnectionError("Redis answered an MGET with another number of values than asked")
                for i in part:
                    length = reader.bulk_len()
                    if length is None:
                        continue
                    if self._land(reader, length, keys[i], dests[i], spec):
                        arrived[i] = length
                    else:
                        corrupt.append(keys[i])
            clean = True
            return arrived
        finally:
            if not clean:
                conn.disconnect()
            pool.release(conn)

    def _land(self, reader: ReplyReader, length: int, key: bytes, dest: PageDest, spec: KVSpec) -> bool:
        """Read the next value (`length` bytes) into `dest` and check it there; False if refused.
        A raw blob: header, payload and trailer read apart, the payload straight into `dest`
        (a page's strided blocks in a CPU pool too: one `recvmsg_into` scatters over them), its
        checksum computed where the bytes landed. A compressed blob, or strided blocks over TLS:
        into this thread's reused buffer, checked and decoded from there. Checked here, not on a
        helper thread: Redis needs the other core (a helper measured 0.84x of MGET, this 0.96x)."""
        parts = dest_parts(dest) if length == raw_blob_size(spec) else None
        if parts is not None and (reader.scatters or len(parts) == 1):
            header, trailer = bytearray(raw_header_size(spec)), bytearray(4)
            reader.read_into_all([header, *parts, trailer])
            reader.end_bulk()
            return _intact(lambda: check_raw_pieces(header, parts, trailer, spec, key))
        blob = self._scratch_for(length)[:length]
        reader.read_into(blob)
        reader.end_bulk()
        return _intact(lambda: decode_into(blob, spec, key, dest))

    def _scratch_for(self, nbytes: int) -> memoryview:
        """This thread's reused buffer, at least `nbytes` long (kept: touched once, then in cache)."""
        buffer = getattr(self._scratch, "buffer", None)
        if buffer is None or len(buffer) < nbytes:
            buffer = self._scratch.buffer = memoryview(bytearray(nbytes))
        return buffer

    def _decoded_into(self, keys: Sequence[bytes], dests: Sequence[PageDest], spec: KVSpec) -> list[int]:
        """`get_into` over a cluster: `get`'s verified blobs, decoded here."""
        arrived = [0] * len(keys)
        refused = []
        for i, blob in enumerate(self.get(keys)):
            if blob is None:
                continue
            try:
                decode_into(blob, spec, keys[i], dests[i], check_crc=False)  # `get` checked it
                arrived[i] = len(blob)
            except BlobError:
                refused.append(keys[i])
        if refused:
            self._stats.corrupt += len(refused)
            self.delete(refused)
        return arrived

    @staticmethod
    def _check(keys: Sequence[bytes], out: list[bytes | None], positions: range) -> list[bytes]:
        """Verify the blobs at `positions` of `out`; a corrupt one becomes None. Returns its keys."""
        corrupt = []
        for i in positions:
            blob = out[i]
            if blob is not None:
                try:
                    verify_blob(blob, keys[i])
                except BlobError:
                    corrupt.append(keys[i])
                    out[i] = None
        return corrupt

    def _checker(self) -> ThreadPoolExecutor:
        if self._checks is None:
            with self._lock:
                if self._checks is None:
                    self._checks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="redis-tier-crc")
        return self._checks

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        names = [self._k(k) for k, _ in items]

        def set_each(pipe: Any, group: list[int]) -> None:
            for i in group:
                pipe.set(names[i], items[i][1], px=self.ttl_ms)

        stored = [i for positions, _ in self._pipelined(names, set_each) for i in positions]
        self._stats.bytes_in += sum(len(items[i][1]) for i in stored)
        return len(stored)

    def delete(self, keys: Sequence[bytes]) -> None:
        names = [self._k(k) for k in keys]
        self._pipelined(names, lambda pipe, group: pipe.delete(*[names[i] for i in group]))

    def stats(self) -> TierStats:
        """Capacity, used bytes and pages summed over the servers that answer (INFO, DBSIZE),
        asked at most once every `_INFO_MAX_AGE_S`: a dashboard polling stats must not load Redis."""
        nodes = [self._single] if self._single is not None else list(self._nodes.values())
        self._stats.open_breakers, self._stats.breakers = breaker_states({n.address: n.breaker for n in nodes})
        now = time.monotonic()
        if now - self._info_at < _INFO_MAX_AGE_S:
            return self._stats
        self._info_at = now

        def ask(client: Any) -> list[Any]:
            return client.pipeline(transaction=False).info("memory").dbsize().execute()

        replies = [r for r in (self._on(n, ask, None) for n in self._masters()) if r is not None]
        if replies:
            self._stats.capacity_bytes = sum(int(info.get("maxmemory", 0)) for info, _ in replies)
            self._stats.used_bytes = sum(int(info.get("used_memory", 0)) for info, _ in replies)
            self._stats.pages = sum(int(pages) for _, pages in replies)
        return self._stats

    def close(self) -> None:
        if self._single is not None:
            self._single.client.close()
        with self._lock:
            if self._fanout is not None:
                self._fanout.shutdown(wait=True)
            if self._checks is not None:
                self._checks.shutdown(wait=True)
            if self._cluster is not None:
                self._cluster.close()
