"""The two-instance story: a store server, instance A computes a long document's KV and answers a
question; instance B, another process with an empty cache, answers another question about the
same document by loading the document's KV from the store instead of prefilling it."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from typing import Any

from tiered_cache.model.units import format_binary
from tiered_cache.report.table import render_table


def _instance(role: str, address: str, options: list[str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "tiered_cache.demo.instance", role, address, *options],
                          stdout=subprocess.PIPE, text=True, timeout=1800)
    if proc.returncode == 130:  # the child saw Ctrl-C too
        raise KeyboardInterrupt
    if proc.returncode != 0:
        raise RuntimeError(f"instance {role.upper()} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_demo(repeat: int = 3, as_json: bool = False, doc_chars: int | None = None,
             max_new_tokens: int | None = None) -> int:
    """The story, each TTFT measured `repeat` times (median and spread printed); `as_json`: one
    JSON document (both instances' rows, the store's figures, B's tree) instead of tables.
    `doc_chars`: only the document's first characters (default all: ~2,800 tokens);
    `max_new_tokens`: the answers' length (default 48).
    Exit 0 when both instances' greedy answers are identical with and without the cache."""
    from tiered_cache.client.stats import server_stats
    from tiered_cache.integrations.smollm2 import gguf_path
    from tiered_cache.report.stats import render_stats
    from tiered_cache.server.process import StoreProcess

    for name, value in (("--repeat", repeat), ("--doc-chars", doc_chars), ("--max-new-tokens", max_new_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    options = ["--repeat", str(repeat)]
    options += ["--doc-chars", str(doc_chars)] if doc_chars is not None else []
    options += ["--max-new-tokens", str(max_new_tokens)] if max_new_tokens is not None else []
    gguf_path()  # fail early, with the fix, if the weights package is missing
    started = time.perf_counter()
    progress = sys.stderr if as_json else sys.stdout
    with tempfile.TemporaryDirectory(prefix="tiered-cache-demo-") as folder, \
            StoreProcess(["--disk", folder, "--ram", "256MiB"]) as store:
        print(f"store server: {store.address} (RAM in front of a temporary disk folder)", file=progress, flush=True)
        print("instance A: its own process and cache; reads the document and answers question 1", file=progress,
              flush=True)
        a = _instance("a", store.address, options)
        print("instance B: another process, empty local cache; answers question 2 about the same document",
              file=progress, flush=True)
        b = _instance("b", store.address, options)
        store_stats = server_stats(store.address, None, None, 10)
    same = all(d["rows"][0]["tokens"] == d["rows"][-1]["tokens"] for d in (a, b))
    if as_json:
        print(json.dumps({"instances": [a, b], "store": store_stats, "identical_answers": same,
                          "seconds": time.perf_counter() - started}, indent=2, default=str))
        return 0 if same else 1
    print()
    print(report(a, b))
    print()
    print("Store server figures after the run:")
    print(render_stats(store_stats))
    if b.get("tree"):
        from tiered_cache.report.tree import render_tree

        print("\nInstance B's radix tree after it also answered A's question (`tiered-cache tree`): the document "
              "once, each question a leaf")
        print(render_tree(b["tree"]))
    print(f"\ndemo finished in {time.perf_counter() - started:,.0f} s")
    return 0 if same else 1


def report(a: dict[str, Any], b: dict[str, Any]) -> str:
    rows = []
    for inst, data in (("A", a), ("B", b)):
        base = data["rows"][0]["ttft_s"]
        for r in data["rows"]:
            where = ", ".join(f"{t} {n:,}" for t, n in r["sources"].items()) or "-"
            runs = r.get("ttft_runs_s") or [r["ttft_s"]]
            spread = f"{min(runs) * 1e3:,.0f}-{max(runs) * 1e3:,.0f} ms" if len(runs) > 1 else "-"
            rows.append([inst, r["label"], f"{r['ttft_s'] * 1e3:,.0f} ms", spread, f"{base / r['ttft_s']:.1f}x",
                         f"{r['reused_tokens']:,} / {r['prompt_tokens']:,}", where,
                         format_binary(r["bytes_loaded"]) if r["bytes_loaded"] else "-"])
    table = render_table(rows, ["instance", "run", "TTFT (median)", "spread (min-max)", "vs no cache",
                                "reused / prompt tokens", "from tier", "KV moved"], align_right=(2, 3, 4, 5, 7))
    most = max(len(r.get("ttft_runs_s") or [0]) for d in (a, b) for r in d["rows"])
    lines = [table, f"TTFT: median of {most} runs after a warm-up, each from the same state (the cold-cache "
                    "run happens once); compare the medians, and the spread says how much this machine wobbles", ""]
    for inst, data in (("A", a), ("B", b)):
        nocache, last = data["rows"][0], data["rows"][-1]
        lines.append(f"instance {inst} asked: {data['question']}")
        lines.append(f"   answer without a cache:          {nocache['answer']}")
        lines.append(f"   answer with {last['label']}: {last['answer']}")
        same = "identical" if nocache["tokens"] == last["tokens"] else "DIFFERENT"
        lines.append(f"   greedy tokens with and without the cache: {same}")
    return "\n".join(lines)
