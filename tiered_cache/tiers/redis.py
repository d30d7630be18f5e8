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
Nothing raises into the request path. The servers, their breakers and the pipelines to them are
`RedisNodes` (redis_nodes.py); this file is the tier over them: reads, writes, checks, figures.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tiered_cache.tiers.base import Tier, TierStats, leading_run
from tiered_cache.tiers.breaker import BreakerPolicy, breaker_states
from tiered_cache.tiers.redis_nodes import RedisNodes
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
_GET_PARTS = 4  # a large get is read in this many MGETs, each checked while the next arrives
_MIN_GET_PART = 8  # keys; a get of fewer is one MGET, checked on the caller's thread
# get_into asks for about this many bytes per MGET, the next MGET sent before this one's reply is
# read: Redis writes a reply only once its whole command has run, and one MGET of 256 values of
# 1 MiB is slower than MGETs of 16 MiB (docs/PERFORMANCE.md, "Issue 33, item 3").
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


class RedisTier:
    name = Tier.REDIS.value
    thread_safe = True  # redis-py's connection pools serve every thread

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "tiered-cache",
                 ttl_s: float | None = None, timeout_s: float = 1.0, breaker: BreakerPolicy | None = None) -> None:
        """Raises ValueError for a malformed URL, or a cluster key prefix with a `{`."""
        self.url = url
        self._nodes = RedisNodes(url, timeout_s, breaker or BreakerPolicy(cooldown_s=0.05))  # connects on use
        self.cluster = self._nodes.cluster
        if self.cluster and "{" in prefix:
            raise ValueError(f"a Redis Cluster key prefix may not contain '{{' (a hash tag would put every "
                             f"page on one master), got {prefix!r}")
        self.prefix = prefix.encode() + b":"
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else None
        self._lock = threading.Lock()  # `_checks`
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
        return self._nodes.available

    # --- interface -------------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        names = [self._k(k) for k in keys]
        out = [False] * len(keys)
        def exists(pipe: Any, group: list[int]) -> object:
            return [pipe.exists(names[i]) for i in group]

        for positions, replies in self._nodes.pipelined(names, exists):
            for i, found in zip(positions, replies, strict=True):
                out[i] = bool(found)
        return out

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        return leading_run(self.contains(keys))

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Verified blobs (None: missing or corrupt). A large get is read in `_GET_PARTS` MGETs,
        one after another, and each part's checksums run on a helper thread while the next part
        arrives (CRC-32C releases the GIL): the check costs about one copy of the blobs, a
        fraction of an MGET, and would otherwise come after the whole reply."""
        names = [self._k(k) for k in keys]
        out: list[bytes | None] = [None] * len(keys)
        size = max(_MIN_GET_PART, -(-len(keys) // _GET_PARTS))
        corrupt: list[bytes] = []
        checking = []
        for start in range(0, len(keys), size):
            part = range(start, min(len(keys), start + size))
            for positions, (blobs,) in self._nodes.pipelined(names, lambda pipe, group: pipe.mget(
                    [names[i] for i in group]), part):
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
        (`resp_reader.py`: no blob per page, no fresh memory), each page checked where it is placed;
        from a cluster, the blobs of `get` are decoded. A blob that is corrupt, or no page of
        `spec`, is a miss: counted and deleted."""
        single = self._nodes.single
        if single is None:
            return self._decoded_into(keys, dests, spec)
        corrupt: list[bytes] = []
        try:
            got = self._nodes.on(single, lambda client: self._mget_into(client, keys, dests, spec, corrupt), None)
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
                    if self._place(reader, length, keys[i], dests[i], spec):
                        arrived[i] = length
                    else:
                        corrupt.append(keys[i])
            clean = True
            return arrived
        finally:
            if not clean:
                conn.disconnect()
            pool.release(conn)

    def _place(self, reader: ReplyReader, length: int, key: bytes, dest: PageDest, spec: KVSpec) -> bool:
        """Read the next value (`length` bytes) into `dest` and check it there; False if refused.
        A raw blob: header, payload and trailer read apart, the payload straight into `dest`
        (a page's strided blocks in a CPU pool too: one `recvmsg_into` scatters over them), its
        checksum computed where the bytes were placed. A compressed blob, or strided blocks over TLS:
        into this thread's reused buffer, checked and decoded from there. Checked here, not on a
        helper thread: a same-host Redis needs the CPU a helper would take (docs/PERFORMANCE.md,
        "Issue 33, item 3")."""
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

    def warm(self) -> None:
        """Connect to every node now (a PING each) and start the checker thread, so the first
        load does not pay for them. A node that does not answer opens its breaker, as on any call."""
        for node in self._nodes.masters():
            self._nodes.on(node, lambda client: client.ping(), None)
        self._checker().submit(lambda: None).result()

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

        stored = [i for positions, _ in self._nodes.pipelined(names, set_each) for i in positions]
        self._stats.bytes_in += sum(len(items[i][1]) for i in stored)
        return len(stored)

    def delete(self, keys: Sequence[bytes]) -> None:
        names = [self._k(k) for k in keys]
        self._nodes.pipelined(names, lambda pipe, group: pipe.delete(*[names[i] for i in group]))

    def stats(self) -> TierStats:
        """Capacity, used bytes and pages summed over the servers that answer (INFO, DBSIZE),
        asked at most once every `_INFO_MAX_AGE_S`: a dashboard polling stats must not load Redis."""
        nodes = self._nodes
        self._stats.open_breakers, self._stats.breakers = breaker_states(nodes.breakers())
        now = time.monotonic()
        if now - self._info_at >= _INFO_MAX_AGE_S:
            self._info_at = now

            def ask(client: Any) -> list[Any]:
                return client.pipeline(transaction=False).info("memory").dbsize().execute()

            replies = [r for r in (nodes.on(n, ask, None) for n in nodes.masters()) if r is not None]
            if replies:
                # maxmemory 0 is "no limit": Redis then grows to its host's memory, which is its capacity.
                self._stats.capacity_bytes = sum(
                    int(info.get("maxmemory", 0)) or int(info.get("total_system_memory", 0)) for info, _ in replies)
                self._stats.used_bytes = sum(int(info.get("used_memory", 0)) for info, _ in replies)
                self._stats.pages = sum(int(pages) for _, pages in replies)
        self._stats.errors, self._stats.breaker_trips = nodes.errors, nodes.breaker_trips  # INFO's failures too
        return self._stats

    def close(self) -> None:
        self._nodes.close()
        with self._lock:
            if self._checks is not None:
                self._checks.shutdown(wait=True)
