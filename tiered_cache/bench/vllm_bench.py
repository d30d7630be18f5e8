"""`tiered-cache bench vllm`: time to first token of a second vLLM instance asking what a first
one asked, each way in one run: recompute (plain vLLM), our connector through a store server
(whole blocks, the default on the CPU, and layer by layer), disk and Redis, and vLLM's own
`ExampleConnector` (disk).

Each way: instance A (its own process, forked from one that imported vLLM once) answers the
questions, storing the blocks; instance B (a fresh process, cold vLLM prefix cache) answers them
again with `max_tokens=1`, so its request latency is its TTFT. With several rounds, every way's
B runs once a round, the ways taking turns, so a slow spell of a shared machine falls on all of
them; the median over every B request is the figure (the mean is shown beside it). The RAM tier
is per process, so its way is one process asking twice with vLLM's own prefix cache off. Each
question is about another slice of the document, so vLLM's own prefix cache cannot help between
them. Both run vLLM's CPU build in `.venv-vllm`, eager mode. Exact repeats, since
`ExampleConnector` only finds a prompt it stored whole.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_cache.integrations.vllm.forkserver import InstanceLauncher

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = ["In what year was the lighthouse's lamp first lit?", "Who was the first keeper of the light?",
             "In what year was the light automated?"]


@dataclass
class VllmRow:
    way: str
    prompt_tokens: float
    cached_tokens: float
    latencies_s: list[float]  # every B request of every round
    answers: list[list[list[int]]]  # each round's greedy tokens, question by question
    connector_s: list[float] = field(default_factory=list)  # of each request, inside the connector's hooks

    @property
    def ttft_s(self) -> float:
        return statistics.median(self.latencies_s)

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.latencies_s)

    @property
    def hooks_s(self) -> float | None:
        """Median time a request spent inside the connector's hooks (None: no connector)."""
        return statistics.median(self.connector_s) if any(self.connector_s) else None

    def same_answers(self, recompute: VllmRow) -> bool:
        return all(answers == recompute.answers[0] for answers in self.answers + recompute.answers)

    def to_dict(self, recompute: VllmRow) -> dict[str, Any]:
        return {"way": self.way, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "ttft_s": self.ttft_s, "mean_ttft_s": self.mean_s, "latencies_s": self.latencies_s,
                "connector_s": self.hooks_s, "connector_latencies_s": self.connector_s,
                "speedup_vs_recompute": recompute.ttft_s / self.ttft_s,
                "answers_match_recompute": self.same_answers(recompute)}


def _instance(launcher: InstanceLauncher, model: str, args: list[str], doc_chars: int) -> list[dict[str, Any]]:
    argv = ["--model", model, "--eager", "--warmup", "--max-tokens", "1", "--doc-chars", str(doc_chars),
            "--doc-per-question", *args]
    for q in QUESTIONS:
        argv += ["-q", q]
    return launcher.run_json(argv, timeout_s=900)["rows"]


def _add_round(rows: dict[str, VllmRow], way: str, results: list[dict[str, Any]]) -> None:
    n = len(results)
    row = rows.setdefault(way, VllmRow(way, sum(r["prompt_tokens"] for r in results) / n,
                                       sum(r["num_cached_tokens"] for r in results) / n, [], []))
    row.latencies_s += [r["latency_s"] for r in results]
    row.connector_s += [r.get("connector_s", 0.0) for r in results]
    row.answers.append([r["tokens"] for r in results])


def bench_vllm(doc_chars: int = 3000, rounds: int = 3, shm: str | None = None,
               progress: Callable[[str], None] = lambda _: None) -> list[VllmRow]:
    """`shm`: whether the store server's RAM tier is a shared-memory arena that instance B reads
    in place (`serve --shm on|off`; None: the server's default, on)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    server_args = ["--no-disk", "--ram", "1GiB"]
    if shm is not None:
        if str(shm).lower() not in ("on", "off"):
            raise ValueError(f"shm must be on or off (the arena is the store's RAM tier), got {shm!r}")
        server_args += ["--shm", shm]
    from tiered_cache.bench.redis_process import RedisServer
    from tiered_cache.integrations.smollm2 import MODEL_DIR, cache_dir, load_model
    from tiered_cache.server.process import StoreProcess

    python = REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python} is missing: run `make install-vllm`")
    load_model()  # the safetensors folder vLLM loads
    model = str(cache_dir() / MODEL_DIR)
    rows: dict[str, VllmRow] = {}
    with (tempfile.TemporaryDirectory(prefix="tiered-cache-bench-vllm-") as tmp,
          InstanceLauncher(python) as launcher):
        redis = RedisServer(Path(tmp), maxmemory="1gb")
        redis.start()
        try:
            with StoreProcess(server_args) as store:
                ways = [("recompute (plain vLLM)", ["--no-connector"]),
                        ("tiered-cache: RAM tier, same process", ["--repeat", "--no-prefix-caching"]),
                        ("tiered-cache: store server", ["--remote", store.address]),
                        ("  same, layer by layer (6 groups of 5 layers)", ["--remote", store.address,
                                                                           "--layer-groups", "6"]),
                        ("tiered-cache: disk", ["--disk", f"{tmp}/disk"]),
                        ("tiered-cache: Redis", ["--redis", redis.url]),
                        ("vLLM ExampleConnector: disk", ["--connector", "ExampleConnector", "--disk", f"{tmp}/ex"])]
                for way, args in ways:
                    if "--no-connector" not in args and "--repeat" not in args:
                        progress(f"{way}: instance A stores ...")
                        _instance(launcher, model, args, doc_chars)
                for round_ in range(1, rounds + 1):
                    for way, args in ways:
                        progress(f"round {round_}/{rounds}, {way}: instance B asks again ...")
                        _add_round(rows, way, _instance(launcher, model, args, doc_chars))
        finally:
            redis.stop()
    return list(rows.values())


def render(rows: list[VllmRow]) -> str:
    from tiered_cache.report.table import render_table

    base = rows[0]
    table = render_table([[r.way, f"{r.prompt_tokens:,.0f}", f"{r.cached_tokens:,.0f}", f"{r.ttft_s * 1e3:,.0f} ms",
                           f"{r.mean_s * 1e3:,.0f} ms", "-" if r.hooks_s is None else f"{r.hooks_s * 1e3:,.1f} ms",
                           f"{base.ttft_s / r.ttft_s:.2f}x", "yes" if r.same_answers(base) else "NO"]
                          for r in rows],
                         ["way (instance B, a fresh process)", "prompt tokens", "cached tokens", "median TTFT",
                          "mean", "in connector", "vs recompute", "same tokens"], align_right=range(1, 7))
    rounds = len(base.answers)
    return (f"{table}\n(SmolLM2-135M, vLLM {sys.platform} CPU build, eager; {len(QUESTIONS)} questions per instance, "
            f"{rounds} round{'s' if rounds > 1 else ''}: median of {len(base.latencies_s)} requests per way;\n"
            " in connector: median time a request spent inside the connector's hooks (lookup, load, save),\n"
            " the part a connector controls: the forward pass is the same compute for every way)")
