"""`tiered-cache bench sglang`: time to first token of a second SGLang instance asking what a first
one asked, with each L3 in one run: none (recompute), SGLang's own `file` backend (`HiCacheFile`,
the same-run baseline) and tiered-cache through a store server on this host.

Each way: instance A (real SGLang, HiCache on, that L3) answers the prompts and its pages are backed
up; instance B, a fresh server with empty device and host caches, then asks each prompt with one
new token, so its request latency is its TTFT. A and B run the same way's L3; the ways take turns
per round so a slow spell of a shared machine falls on all of them. Each prompt is its own slice
of the document: nothing but L3 can help B. Bytes moved: the KV of the tokens B read from storage.
Then the L3 read alone, without the engine around it (`sglang_l3.py`): what TTFT hides on a CPU,
where computing the prompt's last page and SGLang's scheduling take most of B's time.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_cache.bench.sglang_server import OUR_BACKEND, SGLANG_PYTHON, SGLangServer, model_folder, sglang_env

DOC = Path(__file__).resolve().parents[1] / "data" / "document.txt"
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # SmolLM2-135M: K and V, 30 layers, 3 KV heads of 64, bf16


@dataclass
class SGLangRow:
    way: str
    prompt_tokens: list[int] = field(default_factory=list)
    storage_tokens: list[int] = field(default_factory=list)  # of B's requests, read from L3
    ttft_s: list[float] = field(default_factory=list)
    same_answers: list[bool] = field(default_factory=list)  # B's first token equals A's

    @property
    def median_s(self) -> float:
        return statistics.median(self.ttft_s)

    def to_dict(self, base: SGLangRow, file: SGLangRow | None) -> dict[str, Any]:
        return {"way": self.way, "prompt_tokens": statistics.fmean(self.prompt_tokens),
                "storage_tokens": statistics.fmean(self.storage_tokens), "ttft_s": self.median_s,
                "ttft_all_s": self.ttft_s, "bytes_from_storage": sum(self.storage_tokens) * KV_BYTES_PER_TOKEN,
                "speedup_vs_recompute": base.median_s / self.median_s,
                "vs_file_backend": file.median_s / self.median_s if file else None,
                "answers_match": all(self.same_answers)}


def _prompts(n: int, chars: int) -> list[str]:
    text = DOC.read_text()
    return [text[i * chars:(i + 1) * chars] + "\nQuestion: what is this passage about?\nAnswer: It is about"
            for i in range(n)]


def _ways(tmp: Path, store_address: str) -> list[tuple[str, str | None, dict[str, Any] | None]]:
    return [("no L3 (recompute)", None, None),
            ("SGLang file backend (HiCacheFile)", "file", {"file_storage_path": str(tmp / "hicache-file")}),
            ("tiered-cache: store server (v1)", "dynamic",
             {**OUR_BACKEND, "interface_v1": 1, "remote_addresses": store_address})]


def _settle(seconds: float = 3.0) -> None:
    """A's backups to L3 run after its requests return: give them time before B asks."""
    time.sleep(seconds)


def l3_reads(store_address: str, folder: Path) -> dict[str, Any]:
    """`sglang_l3.py`'s figures, in SGLang's venv (with the CPU stand-ins)."""
    out = subprocess.run([str(SGLANG_PYTHON), "-m", "tiered_cache.bench.sglang_l3", store_address, str(folder)],
                         capture_output=True, text=True, env=sglang_env(), timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the L3 read bench failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_sglang(prompts: int = 4, chars: int = 1200, rounds: int = 1,
                 progress: Callable[[str], None] = lambda _: None) -> tuple[list[SGLangRow], dict[str, Any]]:
    if prompts < 1 or rounds < 1:
        raise ValueError("prompts and rounds must be at least 1")
    from tiered_cache.server.process import StoreProcess

    model = model_folder()
    rows: dict[str, SGLangRow] = {}
    with tempfile.TemporaryDirectory(prefix="tiered-cache-bench-sglang-") as name, \
            StoreProcess(["--no-disk", "--ram", "1GiB"]) as store:
        tmp = Path(name)
        for round_ in range(rounds):
            texts = _prompts(prompts * (round_ + 1), chars)[prompts * round_:]  # new prompts every round
            for way, storage, extra in _ways(tmp, store.address):
                row = rows.setdefault(way, SGLangRow(way))
                progress(f"round {round_ + 1}/{rounds}, {way}: instance A ...")
                with SGLangServer(model, tmp / f"a-{round_}.log", storage, extra) as first:
                    answers = [first.generate(t, max_new_tokens=1)["text"] for t in texts]
                    _settle()
                progress(f"round {round_ + 1}/{rounds}, {way}: instance B (fresh) asks again ...")
                with SGLangServer(model, tmp / f"b-{round_}.log", storage, extra) as second:
                    for text, answer in zip(texts, answers, strict=True):
                        start = time.perf_counter()
                        got = second.generate(text, max_new_tokens=1)
                        row.ttft_s.append(time.perf_counter() - start)
                        row.prompt_tokens.append(got["prompt"])
                        row.storage_tokens.append(got["storage"])
                        row.same_answers.append(got["text"] == answer)
        progress("the L3 read alone ...")
        reads = l3_reads(store.address, tmp / "l3-file")
    return list(rows.values()), reads


def render_reads(reads: dict[str, Any]) -> str:
    from tiered_cache.report.table import render_table

    times, nbytes = reads["median_s"], reads["prefix_bytes"]
    file = times["SGLang file backend"]
    table = render_table([[way, f"{t * 1e3:.2f} ms", f"{nbytes / t / 1e9:.1f} GB/s", f"{file / t:.2f}x"]
                          for way, t in times.items()],
                         ["into SGLang's host pool", "median per prefix", "rate", "vs file backend"],
                         align_right=range(1, 4))
    return (f"{table}\n(the L3 read alone: {reads['prefixes']} prefixes of {reads['pages']} pages "
            f"({nbytes / 2**20:.1f} MiB, SmolLM2-135M's KV, layer-first), each read once, after the batch_exists "
            "SGLang asks first;\n ours checks every page's checksum, key and model; the file backend checks "
            "nothing, and its files sit in the page cache)")


def render(rows: list[SGLangRow]) -> str:
    from tiered_cache.report.table import render_table

    base, file = rows[0], next((r for r in rows if "file" in r.way), None)
    table = render_table(
        [[r.way, f"{statistics.fmean(r.prompt_tokens):,.0f}", f"{statistics.fmean(r.storage_tokens):,.0f}",
          f"{sum(r.storage_tokens) * KV_BYTES_PER_TOKEN / 2**20:,.1f} MiB", f"{r.median_s * 1e3:,.0f} ms",
          f"{base.median_s / r.median_s:.2f}x", f"{file.median_s / r.median_s:.2f}x" if file else "-",
          "yes" if all(r.same_answers) else "NO"] for r in rows],
        ["L3 of instances A and B", "prompt tokens", "from storage", "bytes from storage", "median TTFT (B)",
         "vs recompute", "vs file backend", "same token"], align_right=range(1, 7))
    return (f"{table}\n(SmolLM2-135M on SGLang's CPU engine; instance B is a fresh server; "
            f"{len(base.ttft_s)} prompts per way, each its own slice of the document)")
