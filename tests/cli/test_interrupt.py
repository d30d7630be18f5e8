"""Ctrl-C during `bench cluster` (which starts a Ray cluster of its own): one line, exit 130, and
no Ray process left behind, also with a second Ctrl-C while it cleans up. SIGINT goes to the
command's whole process group, as a terminal's Ctrl-C does. In `make test-long` (a Ray cluster's
start and stop, twice)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.long


def ray_processes() -> list[str]:
    found = subprocess.run(["pgrep", "-fa", "raylet|gcs_server|dashboard/agent|ray::|default_worker"],
                           capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_during_bench_cluster_says_so_in_one_line_and_leaves_no_ray_process(presses):
    before = set(ray_processes())
    cmd = [sys.executable, "-m", "tiered_cache.cli.main", "bench", "cluster", "--workers", "1", "--shards", "1",
           "--docs", "2", "--questions", "4", "--doc-chars", "2000"]
    # SIGINT as a terminal's command has it: a run started in the background (`make test-long &`,
    # a CI runner's shell) inherits it ignored, and Python then never raises KeyboardInterrupt.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip() for line in proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 180
    while not any("requests" in line and "in flight" in line for line in list(lines)):
        assert proc.poll() is None and time.monotonic() < deadline, "\n".join(lines)
        time.sleep(0.2)
    for _ in range(presses):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.5)
    try:
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(10)
    output = "\n".join(lines)
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert "tiered-cache bench: interrupted" in output, output
    deadline = time.monotonic() + 30
    while (left := set(ray_processes()) - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left
