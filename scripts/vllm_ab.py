"""A/B of the store-server way under vLLM: this checkout against another (BASE, e.g. a
`git worktree add /tmp/base <commit>`), with vLLM's ExampleConnector beside, B processes taking
turns. Each side runs its own store server and fork server from its own code (PYTHONPATH), so
the two client and server versions never meet. Prints per round and then medians: TTFT per
question, time inside the connector's hooks, and the scheduler's lookup (from
TIERED_CACHE_VLLM_TIMING).

    .venv/bin/python scripts/vllm_ab.py /tmp/base --rounds 4 [--shm on|off] [--base-shm 1GiB]

BASE needs `.venv-vllm` reachable (a symlink to this checkout's is enough).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tiered_cache.bench.vllm_bench import QUESTIONS  # noqa: E402
from tiered_cache.integrations.smollm2 import MODEL_DIR, cache_dir, load_model  # noqa: E402
from tiered_cache.integrations.vllm.forkserver import InstanceLauncher  # noqa: E402
from tiered_cache.server.process import StoreProcess  # noqa: E402

LOOKUP = re.compile(r"lookup [1-9]\d* blocks: \d+ held, ([\d.]+) ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", type=Path)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--shm", default="on", help="this checkout's store server: its arena on or off")
    p.add_argument("--base-shm", default="1GiB", help="the base's `serve --shm` (a ring size before the arena)")
    p.add_argument("--timing-dir", help="append each way's timing lines (TIERED_CACHE_VLLM_TIMING) to WAY.log here")
    args = p.parse_args()
    os.environ["TIERED_CACHE_VLLM_TIMING"] = "1"
    load_model()
    model = str(cache_dir() / MODEL_DIR)
    python = REPO / ".venv-vllm" / "bin" / "python"
    server_args = {False: ["--no-disk", "--ram", "1GiB", "--shm", args.shm],
                   True: ["--no-disk", "--ram", "1GiB", "--shm", args.base_shm]}

    def argv(extra: list[str]) -> list[str]:
        out = ["--model", model, "--eager", "--warmup", "--max-tokens", "1", "--doc-chars", "3000",
               "--doc-per-question", *extra]
        for q in QUESTIONS:
            out += ["-q", q]
        return out

    def side(pythonpath: str | None) -> tuple[InstanceLauncher, StoreProcess]:
        if pythonpath:
            os.environ["PYTHONPATH"] = pythonpath
        try:
            launcher, store = InstanceLauncher(python), StoreProcess(server_args[pythonpath is not None])
            store.start()
        finally:
            os.environ.pop("PYTHONPATH", None)
        return launcher, store

    with tempfile.TemporaryDirectory() as tmp:
        # `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH: from a
        # checkout's root both sides would run that checkout's code.
        os.chdir(tmp)
        (new_l, new_s), (base_l, base_s) = side(None), side(str(args.base.resolve()))
        check = "import tiered_cache, sys; sys.stdout.write(tiered_cache.__file__)"
        for name, path in (("this checkout", REPO), ("base", args.base.resolve())):
            env = dict(os.environ, PYTHONPATH=str(path)) if path != REPO else os.environ
            found = subprocess.run([str(python), "-c", check], env=env, capture_output=True, text=True).stdout
            if not found.startswith(str(path)):
                raise SystemExit(f"{name} imports tiered_cache from {found}, not from {path}")
        ways = {"base": (base_l, ["--remote", base_s.address]), "new": (new_l, ["--remote", new_s.address]),
                "example": (new_l, ["--connector", "ExampleConnector", "--disk", f"{tmp}/ex"])}
        ttft: dict[str, list[list[float]]] = {w: [] for w in ways}
        hooks: dict[str, list[float]] = {w: [] for w in ways}
        lookups: dict[str, list[float]] = {w: [] for w in ways}
        try:
            for launcher, extra in ways.values():  # instance A of each way stores
                launcher.run(argv(extra), timeout_s=900)
            for r in range(args.rounds):
                for way, (launcher, extra) in ways.items():
                    done = launcher.run(argv(extra), timeout_s=900)
                    rows = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
                    ttft[way].append([row["latency_s"] * 1e3 for row in rows])
                    hooks[way] += [row.get("connector_s", 0.0) * 1e3 for row in rows]
                    lookups[way] += [float(m) for m in LOOKUP.findall(done.stderr)]
                    if args.timing_dir:
                        with open(Path(args.timing_dir) / f"{way}.log", "a") as out:
                            out.writelines(line + "\n" for line in done.stderr.splitlines()
                                           if line.startswith("[tiered-cache]"))
                    print(f"round {r + 1} {way:8s} TTFT {[round(t) for t in ttft[way][-1]]} ms", flush=True)
            for way in ways:
                per_question = [round(statistics.median(q), 1) for q in zip(*ttft[way], strict=True)]
                print(f"{way:8s} median TTFT per question {per_question} ms, sum of all "
                      f"{sum(map(sum, ttft[way])):,.0f} ms; in hooks {statistics.median(hooks[way]):.1f} ms; "
                      f"lookup {statistics.median(lookups[way]) if lookups[way] else '-'} ms")
        finally:
            for launcher, store in ((new_l, new_s), (base_l, base_s)):
                store.stop()
                launcher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
