"""The Redis servers behind a `RedisTier`: one server, or a Redis Cluster's masters.

`RedisNodes` owns the connections (redis-py clients, one per server), a circuit breaker per
server (breaker.py), the cluster's slot map, and how a batch of keys reaches them: grouped by
master and hash slot, each master's groups in one pipeline, the masters in parallel. A failure
counts an error, tells that server's breaker, and re-reads the slot map on the next call.
Retries inside a call are redis-py's own, pinned by `retry_policy` (redis_url.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tiered_cache.tiers.breaker import BreakerPolicy, CircuitBreaker
from tiered_cache.tiers.redis_url import parse_cluster_url, retry_policy

T = TypeVar("T")
# A large read buffer: the default 32 KiB reads MiB values slower.
SOCKET_READ_SIZE = 1 << 20
# Threads beside the caller's that pipeline to a cluster's masters at once, faster than asking one
# master after another (docs/PERFORMANCE.md, "Redis Cluster behind the Redis tier").
_FANOUT_THREADS = 7


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


class RedisNodes:
    """The server of a `redis://` URL, or the masters of a `redis+cluster://` one (connected on
    first use). Thread-safe. `errors` and `breaker_trips` count failed calls and breakers opened."""

    def __init__(self, url: str, timeout_s: float, policy: BreakerPolicy) -> None:
        """Raises ValueError for a malformed cluster URL."""
        import redis

        self.redis_errors = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)
        self.options: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            socket_read_size=SOCKET_READ_SIZE, retry=retry_policy())
        self._startup = parse_cluster_url(url)
        self.cluster = self._startup is not None
        self._policy = policy
        self.single = None if self.cluster else _single_node(redis.Redis.from_url(url, **self.options),
                                                            CircuitBreaker(policy))
        self._cluster: Any = None  # RedisCluster, connected on first use
        self._topology = CircuitBreaker(policy)  # (re)reading the slot map
        self._stale = True  # the slot map must be (re)read before the next call
        self._nodes: dict[str, _Node] = {}  # cluster masters by "host:port"
        self._last_failed: str | None = None  # the master that failed last: asked last for the slot map
        self._lock = threading.Lock()  # the cluster client, slot map, `_nodes` and `_fanout`
        self._fanout: ThreadPoolExecutor | None = None  # asks a cluster's masters in parallel
        self.errors = 0  # failed calls
        self.breaker_trips = 0  # times a server's breaker opened

    @property
    def available(self) -> bool:
        """False while the breaker is open (a cluster: while every known master's is)."""
        if self.single is not None:
            return self.single.breaker.available
        return any(n.breaker.available for n in list(self._nodes.values())) or self._topology.available

    def breakers(self) -> dict[str, CircuitBreaker]:
        """Each known server's breaker, by address."""
        nodes = [self.single] if self.single is not None else list(self._nodes.values())
        return {n.address: n.breaker for n in nodes}

    def failed(self, breaker: CircuitBreaker, node: _Node | None = None) -> None:
        self.errors += 1
        if breaker.failed():
            self.breaker_trips += 1
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
                                             require_full_coverage=False, **settings, **self.options)
            else:  # the master that failed last may be hung: asking it first could cost a timeout
                self._cluster.nodes_manager.initialize(last_failed_node_name=self._last_failed)
        except self.redis_errors:
            self.failed(self._topology)
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

    def route(self, names: Sequence[bytes], positions: Sequence[int] | None = None) -> dict[_Node, list[list[int]]]:
        """Positions of `names` (those given, else all) grouped by node, then by hash slot (one
        server: one group). Names whose slot has no known master are left out, as are all names
        while no slot map is known."""
        positions = range(len(names)) if positions is None else positions
        if self.single is not None:
            return {self.single: [list(positions)]}
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

    def masters(self) -> list[_Node]:
        if self.single is not None:
            return [self.single]
        with self._lock:
            self._read_slot_map()
            if self._cluster is None:
                return []
            return [self._node(n) for n in self._cluster.get_primaries()]

    def on(self, node: _Node, fn: Callable[[Any], T], default: T) -> T:
        """`fn(node's client)` unless the node's breaker is open; on a Redis or socket error count
        it, tell the breaker and return `default`."""
        if not node.breaker.allow():
            return default
        try:
            result = fn(node.client)
        except self.redis_errors:
            self.failed(node.breaker, node)
            return default
        node.breaker.succeeded()
        return result

    def each_node(self, routes: dict[_Node, list[list[int]]], fn: Callable[[_Node, list[list[int]]], T]
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

    def pipelined(self, names: Sequence[bytes], queue: Callable[[Any, list[int]], object],
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

            return self.on(node, send, None)

        routes = self.route(names, positions)
        for (node, groups), per_group in zip(routes.items(), self.each_node(routes, run), strict=True):
            if per_group is None:
                continue
            failed = [any(isinstance(r, Exception) for r in replies) for replies in per_group]
            if any(failed):
                self.failed(node.breaker, node)
            answered.extend((positions, replies) for positions, replies, bad in zip(groups, per_group, failed,
                                                                                strict=True) if not bad)
        return answered

    def close(self) -> None:
        if self.single is not None:
            self.single.client.close()
        with self._lock:
            if self._fanout is not None:
                self._fanout.shutdown(wait=True)
            if self._cluster is not None:
                self._cluster.close()
