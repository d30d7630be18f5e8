"""`tiered-cache stats` as operators use it: default port, numbers in JSON, a refused token said
so, a non-zero exit when any server is down, JSON lines under --watch, rates beside totals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, ctrl_c_able, run_cli
from tier_helpers import SPEC, blobs_for

from tiered_cache.client.store_client import StoreClient
from tiered_cache.server.process import StoreProcess
from tiered_cache.wire.options import DEFAULT_PORT, normalize_address


def test_addresses_get_serves_port_and_bad_ports_are_named():
    assert normalize_address("localhost") == f"localhost:{DEFAULT_PORT}"
    assert normalize_address(" 10.0.0.5:7000 ") == "10.0.0.5:7000"
    assert normalize_address("[::1]") == f"[::1]:{DEFAULT_PORT}" and normalize_address("::1") == f"[::1]:{DEFAULT_PORT}"
    assert normalize_address("[::1]:9") == "[::1]:9"
    for bad in ("host:99999", "host:0", "host:http", ""):
        with pytest.raises(ValueError):
            normalize_address(bad)
    refused = run_cli("stats", "--address", "127.0.0.1:99999", check=False)
    assert refused.returncode == 2 and "must be a number in 1..65535, got '99999'" in refused.stderr


def test_figures_are_numbers_rates_are_shown_and_one_server_down_fails_the_command():
    with StoreProcess(["--no-disk", "--ram", "8MiB"]) as store:
        with StoreClient(store.address) as client:
            client.put(blobs_for(4), bytes.fromhex(SPEC.fingerprint))
            list(client.get([k for k, _ in blobs_for(4)], bytes.fromhex(SPEC.fingerprint)))
        data = json.loads(run_cli("stats", "--address", store.address, "--json").stdout)
        table = run_cli("stats", "--address", store.address).stdout
        both = run_cli("stats", "--address", store.address, "--address", "127.0.0.1:1", "--timeout", "1",
                       check=False)
    assert isinstance(data["server"]["requests"], int) and data["server"]["requests"] >= 2
    ram = data["tiers"][0]
    assert isinstance(ram["hits"], int) and ram["hits"] == 4 and ram["rates"]["hits"] > 0
    assert "hits/s" in table and "rates since the server started" in table
    assert both.returncode == 1 and "127.0.0.1:1: unreachable" in both.stdout and "ram" in both.stdout


def test_a_refused_token_is_said_so_and_the_token_comes_from_the_environment():
    env_name = "TIERED_CACHE_SERVE_TOKEN"
    with StoreProcess(["--no-disk", "--token", "stats-secret"]) as store:
        refused = run_cli("stats", "--address", store.address, check=False)
        env = {**os.environ, env_name: "stats-secret"}
        good = subprocess.run([sys.executable, "-m", "tiered_cache.cli.main", "stats", "--address", store.address,
                               "--json"], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert refused.returncode == 1 and "refused (UNAUTHENTICATED" in refused.stdout and "--token" in refused.stdout
    assert good.returncode == 0 and json.loads(good.stdout)["tiers"][0]["name"] == "ram"


def _watch(address: str, *extra: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tiered_cache.cli.main", "stats", "--address", address,
                             "--watch", "0.3", *extra], stdout=stdout, text=True, cwd=REPO,
                            preexec_fn=ctrl_c_able)


def _read_until(fd: int, text: str, timeout: float = 60.0) -> str:
    """What a terminal's other end wrote, read until `text` appears (or `timeout` passes)."""
    seen, deadline = "", time.monotonic() + timeout
    while text not in seen and time.monotonic() < deadline:
        seen += os.read(fd, 65536).decode(errors="replace")
    return seen


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the terminal's other end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def test_watch_prints_json_lines_plain_blocks_into_a_pipe_and_redraws_a_terminal():
    import pty

    with StoreProcess(["--no-disk"]) as store:
        master, slave = pty.openpty()
        watchers = [_watch(store.address, "--json"), _watch(store.address), _watch(store.address, stdout=slave)]
        os.close(slave)
        # Interrupt only once each has drawn (a fixed sleep raced a slow start on a loaded machine).
        firsts = [w.stdout.readline() for w in watchers[:2]]
        screen = _read_until(master, "hits/s")
        time.sleep(1.0)  # a few more refreshes
        for w in watchers:
            w.send_signal(signal.SIGINT)
        (json_out, _), (plain_out, _) = (w.communicate(timeout=30) for w in watchers[:2])
        json_out, plain_out = firsts[0] + json_out, firsts[1] + plain_out
        watchers[2].wait(timeout=30)
        screen += _read_all(master)
        os.close(master)
    assert all(w.returncode == 0 for w in watchers)
    lines = json_out.splitlines()
    assert len(lines) >= 2 and "\x1b" not in json_out
    docs = [json.loads(line) for line in lines]
    assert all(d["address"] == store.address and "rates" in d["tiers"][0] for d in docs)
    # Into a pipe: one block per refresh under a "# HH:MM:SS" line, no escape codes.
    assert "\x1b" not in plain_out and plain_out.count("# ") >= 2 and plain_out.count("hits/s") >= 2
    # On a terminal: rich's Live in the alternate screen, left again on Ctrl-C.
    assert "\x1b[?1049h" in screen and "\x1b[?1049l" in screen and "hits/s" in screen


def test_every_command_takes_the_logging_flags():
    from tiered_cache.cli.main import build_parser

    parser = build_parser()
    for argv in (["size", "-vv"], ["stats", "--address", "h", "--log-level", "info"], ["bench", "keys", "-v"],
                 ["tree", "--url", "http://x", "--log-level", "debug"], ["serve", "-v"], ["demo", "-v"]):
        args = parser.parse_args(argv)
        assert args.verbose >= 1 or args.log_level in ("info", "debug"), argv
    down = run_cli("stats", "--address", "127.0.0.1:1", "--timeout", "0.5", "-v", check=False)
    assert down.returncode == 1 and "unreachable" in down.stdout


def test_tree_at_a_store_servers_metrics_port_and_an_unknown_tokenizer_say_what_is_wrong():
    from tiered_cache.cli.tree_cmd import _decoder

    port = _free_port()
    with StoreProcess(["--no-disk", "--ram", "8MiB", "--metrics-port", str(port)]):
        result = run_cli("tree", "--url", f"http://127.0.0.1:{port}", check=False)
    assert result.returncode == 2 and "not a tree" in result.stderr and "Expecting value" not in result.stderr
    with pytest.raises(RuntimeError, match="tokenizer 'nope': not a local folder"):
        _decoder("nope")  # local files only: no minute of retries against a Hub it cannot reach


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_reader_that_stops_reading_ends_watch_quietly():
    """`stats --json --watch 1 | head -1`: the first line, then an exit with no Broken-pipe error."""
    with StoreProcess(["--no-disk"]) as store:
        run = subprocess.run(f"{sys.executable} -m tiered_cache.cli.main stats --address {store.address} --json "
                             "--watch 0.2 | head -1", shell=True, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert json.loads(run.stdout)["address"] == store.address
    assert "Broken pipe" not in run.stderr and "Traceback" not in run.stderr and "error" not in run.stderr
