"""A command whose stdout is its result (`bench cluster --json`, `bench load --ray --json`) keeps
Ray's driver chatter off it: a real actor dies in the middle of a task, the driver prints "(raylet)
Task ... failed ... retries remaining", and inside `cluster.driver_prints_to_stderr` that lands on
stderr while stdout carries only what the command itself printed."""

from __future__ import annotations

import os
import time

import pytest

ray = pytest.importorskip("ray")

from workers import cluster  # noqa: E402

pytestmark = pytest.mark.slow


def test_ray_task_failures_go_to_stderr_not_stdout(ray_cluster, capsys):
    class Mortal:  # defined here, so Ray ships it by value (the test module is not importable there)
        def ok(self) -> int:
            return 1

        def die(self) -> None:
            os._exit(1)  # a worker process lost mid-task: what a stopped or crashed actor looks like

    with cluster.driver_prints_to_stderr():
        ray.init(address=ray_cluster.address, namespace="test-driver-output", logging_level="WARNING",
                 log_to_driver=False)
        try:
            actor = ray.remote(Mortal).options(max_restarts=1, max_task_retries=1, num_cpus=0).remote()
            ray.get(actor.ok.remote(), timeout=120)
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.die.remote(), timeout=120)
            out = err = ""
            deadline = time.monotonic() + 30
            while "retries remaining" not in err + out and time.monotonic() < deadline:
                time.sleep(0.2)
                captured = capsys.readouterr()
                out, err = out + captured.out, err + captured.err
        finally:
            ray.shutdown()
    captured = capsys.readouterr()
    out, err = out + captured.out, err + captured.err
    assert "retries remaining" in err, "Ray's driver printed no task failure within 30 s"
    assert "raylet" not in out and "retries remaining" not in out
    # Redirected only while inside: the command's own print reaches stderr too, so a bench prints
    # its result after leaving (as bench_cluster and bench_load_ray return before the CLI prints).
    print("after")
    assert capsys.readouterr().out == "after\n"
