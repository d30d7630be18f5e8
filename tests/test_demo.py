"""`tiered-cache demo`, the main job, end to end: a store server and two instance processes."""

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow


def test_demo_runs_the_two_instance_story():
    result = run_cli("demo")
    out = result.stdout
    assert "prefix from local host RAM" in out and "prefix from the remote store" in out
    assert out.count("greedy tokens with and without the cache: identical") == 2
    assert "Store server figures after the run:" in out and "ram" in out
    for line in out.splitlines():
        if line.startswith("B ") and "prefix from the remote store" in line:
            speedup = float(line.split("ms")[1].split("x")[0])
            assert speedup > 3, line  # B's TTFT is many times below recomputation
