"""A command whose stdout is its answer (`--json` of `bench cluster`, `bench store-traffic --ray`, `stats
--ray`, `tree --ray`, `cluster ...`) keeps Ray's driver chatter off it: a real actor dies in the
middle of a task, the driver prints "(raylet) Task ... failed ... retries remaining" from a thread
of its own, and after `cluster.stdout_for_the_answer` that lands on stderr while the command's
answer, printed to the stdout it returned, is all stdout gets."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from tiered_cache.workers import cluster  # noqa: E402

pytestmark = pytest.mark.slow


def test_ray_task_failures_go_to_stderr_and_the_answer_alone_to_stdout(ray_cluster, capsys):
    class Mortal:  # defined here, so Ray ships it by value (the test module is not importable there)
        def ok(self) -> int:
            return 1

        def die(self) -> None:
            os._exit(1)  # a worker process lost mid-task: what a stopped or crashed actor looks like

    out = err = ""
    # As `run_cli_here` runs a command in this process: sys.stdout is put back afterwards.
    with contextlib.redirect_stdout(sys.stdout):
        answer = cluster.stdout_for_the_answer()
        cluster.connect(ray_cluster.address, "test-driver-output")
        try:
            actor = ray.remote(Mortal).options(max_restarts=1, max_task_retries=1, num_cpus=0).remote()
            ray.get(actor.ok.remote(), timeout=120)
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.die.remote(), timeout=120)
            deadline = time.monotonic() + 30
            while "retries remaining" not in err + out and time.monotonic() < deadline:
                time.sleep(0.2)
                captured = capsys.readouterr()
                out, err = out + captured.out, err + captured.err
            print("progress, on stdout by habit")  # anything but the answer goes to stderr too
            print('{"answer": 1}', file=answer)
        finally:
            ray.shutdown()
    captured = capsys.readouterr()
    out, err = out + captured.out, err + captured.err
    assert "retries remaining" in err, "Ray's driver printed no task failure within 30 s"
    assert out == '{"answer": 1}\n'
    assert "progress, on stdout by habit" in err
