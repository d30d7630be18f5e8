"""The two-instance story: a store server, instance A computes a long document's KV and answers a
question; instance B, another process with an empty cache, answers another question about the
same document by fetching the document's KV from the store instead of prefilling it."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from typing import Any

from tiered_cache.cli.table import render_table
from tiered_cache.model.units import format_binary


def _instance(role: str, address: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "tiered_cache.demo.instance", role, address],
                          stdout=subprocess.PIPE, text=True, timeout=1800)
    if proc.returncode == 130:  # the child saw Ctrl-C too
        raise KeyboardInterrupt
    if proc.returncode != 0:
        raise RuntimeError(f"instance {role.upper()} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_demo() -> int:
    from tiered_cache.cli.stats_cmd import render
    from tiered_cache.integrations.smollm2 import gguf_path
    from tiered_cache.service.process import StoreProcess
    from tiered_cache.service.stats import server_stats

    gguf_path()  # fail early, with the fix, if the weights package is missing
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tiered-cache-demo-") as folder, \
            StoreProcess(["--disk", folder, "--ram", "256MiB"]) as store:
        print(f"store server: {store.address} (RAM in front of a temporary disk folder)", flush=True)
        print("instance A: its own process and cache; reads the document and answers question 1", flush=True)
        a = _instance("a", store.address)
        print("instance B: another process, empty local cache; answers question 2 about the same document",
              flush=True)
        b = _instance("b", store.address)
        store_stats = server_stats(store.address, None, None, 10)
    print()
    print(report(a, b))
    print()
    print("Store server figures after the run:")
    print(render(store_stats))
    if b.get("tree"):
        from tiered_cache.cli.tree_render import render_tree

        print("\nInstance B's radix tree after it also answered A's question (`tiered-cache tree`): the document "
              "once, each question a leaf")
        print(render_tree(b["tree"]))
    print(f"\ndemo finished in {time.perf_counter() - started:,.0f} s")
    same = a["rows"][0]["tokens"] == a["rows"][-1]["tokens"] and b["rows"][0]["tokens"] == b["rows"][-1]["tokens"]
    return 0 if same else 1


def report(a: dict[str, Any], b: dict[str, Any]) -> str:
    rows = []
    for inst, data in (("A", a), ("B", b)):
        base = data["rows"][0]["ttft_s"]
        for r in data["rows"]:
            where = ", ".join(f"{t} {n:,}" for t, n in r["sources"].items()) or "-"
            rows.append([inst, r["label"], f"{r['ttft_s'] * 1e3:,.0f} ms", f"{base / r['ttft_s']:.1f}x",
                         f"{r['reused_tokens']:,} / {r['prompt_tokens']:,}", where,
                         format_binary(r["bytes_loaded"]) if r["bytes_loaded"] else "-"])
    table = render_table(rows, ["instance", "run", "TTFT", "vs no cache", "reused / prompt tokens", "from tier",
                                "KV moved"], align_right=(2, 3, 4, 6))
    lines = [table, ""]
    for inst, data in (("A", a), ("B", b)):
        nocache, last = data["rows"][0], data["rows"][-1]
        lines.append(f"instance {inst} asked: {data['question']}")
        lines.append(f"   answer without a cache:          {nocache['answer']}")
        lines.append(f"   answer with {last['label']}: {last['answer']}")
        same = "identical" if nocache["tokens"] == last["tokens"] else "DIFFERENT"
        lines.append(f"   greedy tokens with and without the cache: {same}")
    return "\n".join(lines)
