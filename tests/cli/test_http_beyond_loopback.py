"""The issue-52 sequence against a real local Ray cluster: a front end started beyond loopback with
a token, then `cluster start` run again as the README allows, without --http-host / --http-token.
The re-run is refused in one line naming the running bind, and the front end keeps its token: a
client on another host (a network namespace joined by a veth pair) gets 401 without it and 200
with it. `long` (make test-long): a cluster of its own with a model loaded, and root for `ip netns`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from conftest import run_cli_here as run_cli

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

pytestmark = [pytest.mark.slow, pytest.mark.long]
NAMESPACE = "beyond-loopback"
TOKEN = "beyond-loopback-token-0123"


@contextmanager
def another_host() -> Iterator[tuple[str, str]]:
    """(namespace, this host's address as seen from it): a network namespace joined to this one by
    a veth pair; removed after."""
    tag = f"{os.getpid() % 100000}"
    ns, here, there = f"tc-http-{tag}", f"tch{tag}", f"tcn{tag}"
    net = f"10.{150 + os.getpid() % 50}.{os.getpid() // 50 % 250}"
    steps = [["ip", "netns", "add", ns], ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
             ["ip", "link", "set", there, "netns", ns], ["ip", "addr", "add", f"{net}.1/30", "dev", here],
             ["ip", "-n", ns, "addr", "add", f"{net}.2/30", "dev", there], ["ip", "link", "set", here, "up"],
             ["ip", "-n", ns, "link", "set", there, "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, text=True, timeout=30)
        yield ns, f"{net}.1"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)


def status_from(ns: str, url: str, token: str | None) -> int:
    """The HTTP status a client in network namespace `ns` gets for GET `url`."""
    script = ("import sys, urllib.request, urllib.error\n"
              "auth = {'Authorization': sys.argv[2]} if sys.argv[2] else {}\n"
              "req = urllib.request.Request(sys.argv[1], headers=auth)\n"
              "try:\n    print(urllib.request.urlopen(req, timeout=30).status)\n"
              "except urllib.error.HTTPError as e:\n    print(e.code)\n")
    run = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", script, url,
                          f"Bearer {token}" if token else ""], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return int(run.stdout.strip())


def test_a_re_run_never_opens_a_front_end_bound_beyond_loopback(ray_cluster, tmp_path):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2's `ip` for a network namespace")
    from tiered_cache.bench.redis_process import free_port

    ray.shutdown()
    where = ["--address", ray_cluster.address, "--namespace", NAMESPACE]
    port = str(free_port())
    start = ("cluster", "start", *where, "--shards", "1", "--workers", "1", "--disk", str(tmp_path), "--serve",
             "--http-port", port)
    try:
        first = run_cli(*start, "--http-host", "0.0.0.0", "--http-token", TOKEN)
        assert f"HTTP: http://0.0.0.0:{port}/v1" in first.stdout
        again = run_cli(*start, check=False)  # as the README allows: the same command, no host or token
        assert again.returncode == 2 and f"already listens on 0.0.0.0:{port}" in again.stderr.splitlines()[-1]
        with another_host() as (ns, here):
            url = f"http://{here}:{port}/v1/models"
            assert status_from(ns, url, None) == 401
            assert status_from(ns, url, "wrong") == 401
            assert status_from(ns, url, TOKEN) == 200
    finally:
        run_cli("cluster", "stop", *where, check=False)
        ray.shutdown()
