"""`tiered-cache demo`, the main job, end to end: a store server and two instance processes."""


import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow


def test_demo_runs_the_two_instance_story_and_draws_the_shared_prefix():
    """One run with --json (one TTFT run per row: each repeat of the no-cache row is a full
    prefill; the spread is tested below on figures), on the document's first 4,000 characters
    (~1,000 tokens) with short answers: the whole document's three prefills and 240 decode steps
    took ~50 s here, `make demo` runs them. The tables and the tree are drawn from that JSON by
    the same functions the text output uses."""
    import json

    from tiered_cache.demo.runner import report
    from tiered_cache.report.tree import render_tree

    data = json.loads(run_cli("demo", "--json", "--repeat", "1", "--doc-chars", "4000", "--max-new-tokens", "8").stdout)
    a, b = data["instances"]
    assert data["identical_answers"] is True
    assert [r["label"] for r in a["rows"]] == ["no cache", "cold cache (computes, stores)",
                                               "prefix from local host RAM"]
    assert [r["label"] for r in b["rows"]] == ["no cache", "prefix from the remote store"]
    assert all(len(r["ttft_runs_s"]) == 1 and r["ttft_runs_s"][0] == r["ttft_s"] > 0 for r in a["rows"] + b["rows"])
    assert {t["name"] for t in data["store"]["tiers"]} >= {"ram"}
    out = report(a, b)
    assert "prefix from local host RAM" in out and "prefix from the remote store" in out
    assert out.count("greedy tokens with and without the cache: identical") == 2
    # B reused the document from the store (what it reused and where from, not how fast: timing
    # is the benchmark's job, and a loaded machine must not fail this).
    remote = b["rows"][-1]
    reused = remote["reused_tokens"]
    assert remote["prompt_tokens"] - reused < 32 and remote["sources"] == {"remote": reused}
    # The tree: the document once, as one branch, with each question a leaf under it.
    tree = render_tree(b["tree"]).splitlines()
    branch = next(i for i, line in enumerate(tree) if line.startswith("└── "))
    assert "namespace (default): 1 branch" in "\n".join(tree[:branch])
    assert f"({reused:,} tokens)" in tree[branch] and "<|im_start|>" in tree[branch]
    leaves = tree[branch + 1:branch + 3]
    assert leaves[0].startswith("    ├── ") and leaves[1].startswith("    └── ")
    # Each leaf shows its question from where the two part (after the document and the words they
    # share), marked with "…": two leaves never print the same text.
    assert any('"…light automated?' in leaf for leaf in leaves)
    assert any('"…lighthouse\'s lamp' in leaf for leaf in leaves)


def test_the_report_shows_the_median_and_the_spread_of_repeated_runs():
    from tiered_cache.demo.runner import report

    def row(label, runs, reused=0):
        ordered = sorted(runs)
        return {"label": label, "ttft_s": ordered[len(ordered) // 2], "ttft_runs_s": runs, "sources": {},
                "reused_tokens": reused, "prompt_tokens": 100, "bytes_loaded": 0, "tokens": [1], "answer": "x"}

    a = {"question": "qa", "rows": [row("no cache", [3.0, 2.0, 4.0]), row("cold cache (computes, stores)", [5.0]),
                                    row("prefix from local host RAM", [0.2, 0.1, 0.4], 96)]}
    b = {"question": "qb", "rows": [row("no cache", [2.5, 3.5, 3.0]), row("prefix from the remote store",
                                                                          [0.6, 0.5, 1.5], 96)]}
    lines = report(a, b).splitlines()
    host = next(line for line in lines if "local host RAM" in line)
    assert "200 ms" in host and "100-400 ms" in host and "15.0x" in host  # 3.0 s / 0.2 s, medians
    assert "- " in next(line for line in lines if "cold cache" in line)  # one run: no spread
    assert "500-1,500 ms" in next(line for line in lines if "remote store" in line)
    assert any("median of 3 runs" in line for line in lines)


@pytest.mark.parametrize("option", ["--repeat", "--doc-chars", "--max-new-tokens"])
def test_demo_refuses_counts_below_one(option):
    from conftest import run_cli_here  # refused before anything starts: no interpreter of its own needed

    bad = run_cli_here("demo", option, "0", check=False)
    assert bad.returncode == 2 and f"{option} must be at least 1" in bad.stderr and "Traceback" not in bad.stderr


def test_ctrl_c_during_the_demo_is_one_line_and_exit_130():
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO, ctrl_c_able

    demo = subprocess.Popen([sys.executable, "-m", "tiered_cache.cli.main", "demo"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=REPO,
                            preexec_fn=ctrl_c_able)
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
