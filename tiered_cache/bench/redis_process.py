"""Throwaway Redis processes on free loopback ports, for tests and benchmarks (never for production):
one `redis-server`, or an N-master Redis Cluster of them."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1 that were free a moment ago (all held while choosing)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


class RedisServer:
    """`redis-server` bound to 127.0.0.1 with nothing persisted; `start()` waits until it answers.
    `extra_args` are appended to its command line (e.g. cluster settings)."""

    def __init__(self, workdir: Path, maxmemory: str = "256mb", port: int | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed: run `make test`, which installs it")
        self.port = port or free_port()
        self.workdir = workdir
        self.maxmemory = maxmemory
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--maxmemory", self.maxmemory,
             "--maxmemory-policy", "allkeys-lru", "--loglevel", "warning", *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever, as a crashed host would."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None


class RedisClusterServers:
    """A Redis Cluster of `masters` redis-servers (no replicas) on free loopback ports, each in its
    own folder under `workdir`. `start()` creates the cluster and waits until every node says
    `cluster_state:ok`. `url` is the `redis+cluster://` URL of the Redis tier.

    `cluster-require-full-coverage no`: by default a cluster in which some slot has no live master
    (a master died and had no replica to fail over to) stops serving every key on every node
    (CLUSTERDOWN) once the others mark it failed. A cache would rather lose only that master's
    pages, so the live masters keep serving theirs. `node_timeout_ms` is how long the others wait
    before they mark a silent master failed (Redis's default is 15 s)."""

    def __init__(self, workdir: Path, masters: int = 3, maxmemory: str = "256mb",
                 node_timeout_ms: int = 15000) -> None:
        if shutil.which("redis-cli") is None:
            raise RuntimeError("redis-cli is not installed: run `make test`, which installs it")
        assert masters >= 3, f"redis-cli --cluster create needs at least 3 masters, got {masters}"
        ports = free_ports(2 * masters)  # a client port and a cluster bus port each
        self.nodes: list[RedisServer] = []
        for port, bus_port in zip(ports[:masters], ports[masters:], strict=True):
            folder = workdir / f"node-{port}"
            folder.mkdir(mode=0o700, exist_ok=True)  # owner-only, as the cache's own files are
            self.nodes.append(RedisServer(folder, maxmemory, port, [
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-port", str(bus_port), "--cluster-node-timeout", str(node_timeout_ms),
                "--cluster-require-full-coverage", "no"]))

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def start(self, timeout_s: float = 30.0) -> None:
        try:
            for node in self.nodes:
                node.start()
            made = subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                                   "--cluster-replicas", "0", "--cluster-yes"],
                                  capture_output=True, text=True, timeout=timeout_s)
            if made.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create exited {made.returncode}:\n{made.stdout}{made.stderr}")
            self.wait_ok(self.ports, timeout_s)
        except BaseException:
            self.stop()
            raise

    def wait_ok(self, ports: Sequence[int], timeout_s: float = 30.0) -> None:
        """Wait until each of `ports` answers `cluster_state:ok` (raises RuntimeError after `timeout_s`)."""
        import redis

        deadline = time.monotonic() + timeout_s
        for port in ports:
            client = redis.Redis(port=port, socket_timeout=1)
            try:
                while client.cluster("info").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"Redis Cluster node {port} did not reach cluster_state:ok "
                                           f"in {timeout_s} s: {client.cluster('info')}")
                    time.sleep(0.1)
            finally:
                client.close()

    def kill(self, node_index: int) -> None:
        """SIGKILL one node (its folder, with its cluster config, stays)."""
        self.nodes[node_index].kill()

    def pause(self, node_index: int) -> None:
        """SIGSTOP one node: it keeps its sockets but answers nothing, as a hung host would."""
        self.nodes[node_index].proc.send_signal(signal.SIGSTOP)

    def resume(self, node_index: int, timeout_s: float = 30.0) -> None:
        """SIGCONT a paused node and wait until every node says `cluster_state:ok`."""
        self.nodes[node_index].proc.send_signal(signal.SIGCONT)
        self.wait_ok(self.ports, timeout_s)

    def wait_failed(self, node_index: int, timeout_s: float = 30.0) -> None:
        """Wait until every other live node flags node `node_index` as failed (`fail`, not `fail?`)."""
        import redis

        name = f"127.0.0.1:{self.nodes[node_index].port}"
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            if node.proc is None or node is self.nodes[node_index]:
                continue
            client = redis.Redis(port=node.port, socket_timeout=1)
            try:
                while "fail" not in client.cluster("nodes")[name]["flags"].split(","):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"node {node.port} did not mark {name} failed in {timeout_s} s")
                    time.sleep(0.05)
            finally:
                client.close()

    def restart(self, node_index: int, timeout_s: float = 30.0) -> None:
        """Start a stopped or killed node again (empty: nothing is persisted) and wait until every
        node says `cluster_state:ok`."""
        self.nodes[node_index].start()
        self.wait_ok(self.ports, timeout_s)

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None:
                node.proc.send_signal(signal.SIGCONT)  # a paused node would not act on SIGTERM
            node.stop()
