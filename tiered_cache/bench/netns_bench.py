"""`tiered-cache bench remote --netns`: the store's gRPC path the way another host uses it. Two
network namespaces joined by a veth pair stand for two hosts: the store server (`--shm off`: no
arena; a token, as anything bound beyond loopback must have), a bare gRPC server and a raw TCP
server run in one, the reader in the other, so every byte crosses the veth. The reader loads
prefixes it never read into a full pool (the serving rounds of `bench pool-load`), beside a raw TCP
stream of the same bytes between the same two namespaces (the wire's limit from Python), a bare
gRPC stream of them (kept, as a load must), and the same load from a second server without the
bulk Get (`--bulk-port off`: gRPC's Get); last, a new reader process's first load after `settle_s`
against its steady ones (`bench pool-load`'s first loads, across the veth). Needs root and
iproute2 (`ip netns`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

_LISTENING = re.compile(r"listening on (\S+):(\d+)")


@dataclass(frozen=True)
class NetnsFigures:
    """Seconds per prefix (medians) of the store's load and the two limits, and the bytes moved."""

    load_s: float
    grpc_load_s: float  # the same from a server without the bulk Get: gRPC's Get
    raw_tcp_s: float
    bare_grpc_s: float
    nbytes: int  # KV bytes of a prefix
    wire_bytes: int  # blob bytes of a prefix (what the limits move)
    rounds: int
    first_s: float  # a new reader process's first load (the bulk Get's server)
    steady_s: float  # the median of its next loads
    memcpy_first_over_steady: float  # what the same pause costs a memcpy in that process
    settle_s: float  # how long after its start that reader loaded first

    def rows(self) -> list[tuple[str, float, float]]:
        """(limit, load GB/s, limit GB/s) per limit."""
        load = self.nbytes / self.load_s / 1e9
        return [("raw TCP stream, same bytes", load, self.wire_bytes / self.raw_tcp_s / 1e9),
                ("bare gRPC stream, same bytes, kept", load, self.wire_bytes / self.bare_grpc_s / 1e9),
                ("the same load over gRPC's Get (--bulk-port off)", load, self.nbytes / self.grpc_load_s / 1e9)]

    def first_row(self) -> tuple[str, float, float]:
        """(baseline, first load GB/s, steady load GB/s): a new reader's first load against its
        steady ones (a speed ratio: 1/1.3 = 0.77x is "within 1.3x")."""
        return (f"its steady loads (a memcpy's first/steady there: {self.memcpy_first_over_steady:.2f}x)",
                self.nbytes / self.first_s / 1e9, self.nbytes / self.steady_s / 1e9)


def unavailable() -> str | None:
    """Why the bench cannot run here, or None."""
    if os.geteuid() != 0:
        return "bench remote --netns needs root (it makes network namespaces): skipped"
    if shutil.which("ip") is None:
        return "bench remote --netns needs iproute2's `ip` (apt install iproute2): skipped"
    return None


@contextmanager
def two_hosts() -> Iterator[tuple[str, str, str]]:
    """(server namespace, client namespace, server address) joined by a veth pair; removed after."""
    tag = f"{os.getpid() % 100000}"
    server, client = f"tc-srv-{tag}", f"tc-cli-{tag}"
    net = f"10.{200 + os.getpid() % 50}.{os.getpid() // 50 % 250}"
    steps = [["ip", "netns", "add", server], ["ip", "netns", "add", client],
             ["ip", "link", "add", f"tcs{tag}", "type", "veth", "peer", "name", f"tcc{tag}"],
             ["ip", "link", "set", f"tcs{tag}", "netns", server], ["ip", "link", "set", f"tcc{tag}", "netns", client],
             ["ip", "-n", server, "addr", "add", f"{net}.1/30", "dev", f"tcs{tag}"],
             ["ip", "-n", client, "addr", "add", f"{net}.2/30", "dev", f"tcc{tag}"],
             ["ip", "-n", server, "link", "set", f"tcs{tag}", "up"],
             ["ip", "-n", client, "link", "set", f"tcc{tag}", "up"],
             ["ip", "-n", server, "link", "set", "lo", "up"], ["ip", "-n", client, "link", "set", "lo", "up"]]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, text=True, timeout=30)
        yield server, client, f"{net}.1"
    finally:
        for ns in (server, client):  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@contextmanager
def _in_namespace(ns: str, args: list[str], env: dict[str, str] | None = None) -> Iterator[str]:
    """A child process in namespace `ns` that prints "listening on HOST:PORT"; yields HOST:PORT."""
    proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        deadline, lines = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            found = _LISTENING.search(line)
            if found:
                yield f"{found.group(1)}:{found.group(2)}"
                return
        raise RuntimeError(f"{args[0]} did not start in {ns}: {' | '.join(lines[-3:])}")
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.terminate()
        proc.wait(timeout=30)


def bench_netns(spec_dict: dict[str, Any], mib: float, rounds: int, pool_prefixes: int,
                settle_s: float = 5.0) -> NetnsFigures:
    """The figures (see the module doc). Raises RuntimeError when a part fails to start."""
    from tiered_cache.bench.pool_load.bench import FIRST_LOADS
    from tiered_cache.bench.pool_load.prefixes import Prefixes
    from tiered_cache.bench.pool_load.sites import serving_prefixes
    from tiered_cache.model.spec import KVSpec
    from tiered_cache.wire.codec import raw_blob_size

    prefixes = Prefixes(KVSpec.from_dict(spec_dict), mib)
    # The store holds every prefix the reader puts: the serving rounds' and its reader process's.
    total = (serving_prefixes(pool_prefixes, rounds) + FIRST_LOADS) * prefixes.num_pages * raw_blob_size(prefixes.spec)
    token = secrets.token_hex(16)
    env = {**os.environ, "TIERED_CACHE_SERVE_TOKEN": token}
    with two_hosts() as (server_ns, client_ns, host), ExitStack() as stack:
        serve = ["tiered_cache.cli.main", "serve", "--host", host, "--port", "0", "--no-disk", "--shm", "off",
                 "--ram", f"{total * 5 // 4 // 2**20 + 64}MiB"]
        store = stack.enter_context(_in_namespace(server_ns, serve, env))
        grpc_store = stack.enter_context(_in_namespace(server_ns, [*serve, "--bulk-port", "off"], env))
        grpc_at = stack.enter_context(_in_namespace(server_ns, ["tiered_cache.bench.raw_grpc", host]))
        tcp_at = stack.enter_context(_in_namespace(server_ns, ["tiered_cache.bench.raw_tcp", host]))
        job = {"spec": spec_dict, "mib": mib, "rounds": rounds, "pool_prefixes": pool_prefixes, "store": store,
               "grpc_store": grpc_store, "grpc": grpc_at, "tcp": tcp_at, "settle_s": settle_s}
        reader = ["ip", "netns", "exec", client_ns, sys.executable, "-m", "tiered_cache.bench.netns_reader"]
        done = subprocess.run([*reader, json.dumps(job)], capture_output=True, text=True, timeout=1800, env=env)
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}").splitlines()[-1]
            raise RuntimeError(f"the reader in {client_ns} failed: {said}")
        out = json.loads(done.stdout.strip().splitlines()[-1])
    return NetnsFigures(out["load_s"], out["grpc_load_s"], out["raw_tcp_s"], out["bare_grpc_s"], prefixes.nbytes,
                        out["wire_bytes"], rounds, out["first_s"], out["steady_s"], out["memcpy_first_over_steady"],
                        settle_s)
