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
