"""`tiered-cache demo`, the main job, end to end: a store server and two instance processes."""

import re

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow


def test_demo_runs_the_two_instance_story_and_draws_the_shared_prefix():
    result = run_cli("demo")
    out = result.stdout
    assert "prefix from local host RAM" in out and "prefix from the remote store" in out
    assert out.count("greedy tokens with and without the cache: identical") == 2
    assert "Store server figures after the run:" in out and "ram" in out
    # B reused the document from the store (what it reused and where from, not how fast: timing
    # is the benchmark's job, and a loaded machine must not fail this).
    row = next(line for line in out.splitlines() if line.startswith("B ") and "prefix from the remote store" in line)
    reused, prompt = (int(n.replace(",", "")) for n in re.search(r"([\d,]+) / ([\d,]+)", row).groups())
    assert prompt - reused < 32 and f"remote {reused:,}" in row  # all but the last partial page or two
    # The tree: the document once, as one branch, with each question a leaf under it.
    tree = out.split("Instance B's radix tree", 1)[1].splitlines()
    branch = next(i for i, line in enumerate(tree) if line.startswith("└── "))
    assert "namespace (default): 1 branch" in "\n".join(tree[:branch])
    assert f"({reused:,} tokens)" in tree[branch] and "<|im_start|>" in tree[branch]
    leaves = tree[branch + 1:branch + 3]
    assert leaves[0].startswith("    ├── ") and leaves[1].startswith("    └── ")
    assert any("light automated" in leaf for leaf in leaves) and any("lamp first lit" in leaf for leaf in leaves)


def test_ctrl_c_during_the_demo_is_one_line_and_exit_130():
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO

    demo = subprocess.Popen([sys.executable, "-m", "tiered_cache.cli.main", "demo"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=REPO)
    assert demo.stdout is not None
    seen = []
    while "[A] loading" not in (line := demo.stdout.readline()):  # instance A is running
        assert line, "".join(seen)
        seen.append(line)
    time.sleep(0.5)
    os.killpg(demo.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    out = "".join(seen) + line + demo.communicate(timeout=60)[0]
    assert demo.returncode == 130 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1] == "tiered-cache demo: interrupted; the store server and the instances " \
                                           "were stopped"
