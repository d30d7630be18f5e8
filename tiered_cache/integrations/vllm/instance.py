"""One vLLM engine (CPU, float32) answering questions about the shipped document, with or without
the tiered-cache connector; prints one JSON line. Run in the vLLM venv (`.venv-vllm`):

    python -m tiered_cache.integrations.vllm.instance --model FOLDER --remote HOST:PORT -q "..." [-q ...]
    python -m tiered_cache.integrations.vllm.instance --model FOLDER --no-connector -q "..."

Tests and `bench vllm` start it as a separate process, as a second serving instance would be.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

from tiered_cache.tiers.base import Tier


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a local Hugging Face model folder")
    p.add_argument("-q", "--question", action="append", required=True, help="a question (repeat for several)")
    p.add_argument("--doc-chars", type=int, default=2000, help="leading characters of the document (default 2000)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--no-connector", action="store_true", help="plain vLLM (its own prefix cache only)")
    p.add_argument("--connector", default="TieredCacheConnector", help="TieredCacheConnector or ExampleConnector")
    p.add_argument("--remote", action="append", default=[], help="a store server HOST:PORT")
    p.add_argument("--disk", help="a disk tier folder (or ExampleConnector's storage folder)")
    p.add_argument("--redis", help="a Redis tier URL")
    p.add_argument("--model-id", help="the weights' identity, when the folder cannot give it")
    p.add_argument("--config", help="a tiered-cache YAML of CacheConfig settings (kv_connector_extra_config.config)")
    p.add_argument("--eager", action="store_true", help="no torch.compile: starts in seconds, runs slower")
    p.add_argument("--warmup", action="store_true", help="answer an unrelated prompt first (not reported)")
    p.add_argument("--repeat", action="store_true",
                   help="ask every question twice and report the second pass (with --no-prefix-caching: "
                        "the connector's own RAM tier serves it)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn vLLM's own prefix cache off")
    p.add_argument("--kill-after-first", type=int, metavar="PID",
                   help="(fault tests) SIGKILL this process, e.g. the store server, after the first answer")
    p.add_argument("--layer-groups", help="pages per block: 'auto' (default) or a number dividing the layers")
    p.add_argument("--kv-events", metavar="tcp://HOST:PORT",
                   help="vLLM's KV event publisher at this endpoint (its GPU blocks, and the connector's)")
    p.add_argument("--metrics", action="store_true",
                   help="vLLM's stats on: report the tiered_cache counters its Prometheus registry (/metrics) holds")
    p.add_argument("--doc-per-question", action="store_true",
                   help="question i asks about the i-th slice of the document (no prefix shared between them)")
    return p.parse_args(argv)


def transfer_config(args: argparse.Namespace) -> Any:
    from vllm.config import KVTransferConfig

    if args.connector == "ExampleConnector":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                kv_connector_extra_config={"shared_storage_path": args.disk})
    tiers, extra = [], {}
    if args.disk:
        tiers.append(Tier.DISK.value)
        extra["disk_path"] = args.disk
    if args.redis:
        tiers.append(Tier.REDIS.value)
        extra["redis_url"] = args.redis
    if args.remote:
        tiers.append(Tier.REMOTE.value)
        extra["remote_addresses"] = args.remote
    if tiers or not args.config:
        extra["lower_tiers"] = tiers
    if args.config:
        extra["config"] = args.config
    if args.model_id:
        extra["model_id"] = args.model_id
    if args.layer_groups:
        extra["layer_groups"] = args.layer_groups if args.layer_groups == "auto" else int(args.layer_groups)
    # No module path: the package's vLLM plugin entry point registers the connector by name.
    return KVTransferConfig(kv_connector="TieredCacheConnector", kv_role="kv_both", kv_connector_extra_config=extra)


def events_config(endpoint: str | None) -> Any:
    """vLLM's own KV event publisher (ZMQ) at `endpoint`, or None."""
    if endpoint is None:
        return None
    from vllm.config import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker here: one store
    from vllm import LLM, SamplingParams

    from tiered_cache.integrations.document import document

    timer = None if args.no_connector else _time_hooks(args.connector)

    llm = LLM(model=args.model, dtype="float32", max_model_len=4096, seed=0,
              enable_prefix_caching=not args.no_prefix_caching,
              enforce_eager=args.eager,
              kv_transfer_config=None if args.no_connector else transfer_config(args),
              kv_events_config=events_config(args.kv_events), disable_log_stats=not args.metrics)
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows = []
    if args.warmup:  # first-request costs (allocations, lazy init) stay out of the timed rows
        llm.generate(["Say hello."], greedy, use_tqdm=False)
    asked = list(enumerate(args.question))
    for i, question in asked + asked if args.repeat else asked:
        start = i * args.doc_chars if args.doc_per_question else 0
        content = f"{document()[start:start + args.doc_chars]}\n\nQuestion: {question}\nAnswer in one sentence."
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                               add_generation_prompt=True)
        if timer is not None:
            timer.take()
        started = time.perf_counter()
        out = llm.generate([prompt], greedy, use_tqdm=False)[0]
        latency = time.perf_counter() - started
        rows.append({"question": question, "prompt_tokens": len(out.prompt_token_ids),
                     "num_cached_tokens": out.num_cached_tokens or 0, "tokens": list(out.outputs[0].token_ids),
                     "text": out.outputs[0].text, "latency_s": latency,
                     "connector_s": timer.take()[0] if timer is not None else 0.0})
        if args.kill_after_first and len(rows) == 1:
            os.kill(args.kill_after_first, signal.SIGKILL)
            _wait_dead(args.kill_after_first)
        if args.repeat and len(rows) == len(asked):
            _flush_stores()  # the first pass's saves are written before the second pass asks
    rows = rows[len(asked):] if args.repeat else rows
    flushed = _flush_stores()
    report = {"rows": rows, "flushed": flushed, "stores": _store_figures()}
    if args.metrics:
        report["metrics"] = _scraped("vllm:tiered_cache_")
    print(json.dumps(report), flush=True)
    return 0


def _time_hooks(connector: str) -> Any:
    """A `HookTimer` on the connector class this instance uses (before the engine makes one)."""
    from tiered_cache.integrations.vllm.hook_timer import HookTimer

    if connector == "ExampleConnector":
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector as cls
    else:
        from tiered_cache.integrations.vllm.connector import TieredCacheConnector as cls
    timer = HookTimer()
    timer.install(cls)
    return timer


def _scraped(prefix: str) -> dict[str, float]:
    """The samples named `prefix`... in the Prometheus text vLLM's `/metrics` serves (its registry)."""
    from prometheus_client import REGISTRY, generate_latest

    samples: dict[str, float] = {}
    for line in generate_latest(REGISTRY).decode().splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            samples[name] = samples.get(name, 0.0) + float(value)
    return samples


def _store_figures() -> list[dict[str, int]]:
    """What this process's block stores did (tests read them)."""
    from tiered_cache.integrations.vllm import block_tiers

    return [{"layer_groups": s.num_groups, "load_failures": s.load_failures, "load_errors": s.load_errors,
             "saves_dropped": s.saves_dropped, "prefetches_taken": s.prefetches_taken, "lent_lost": s.lent_lost}
            for s in list(block_tiers._SHARED.values())]


def _flush_stores() -> bool:
    """Finish the background writes of this process's block stores before exiting."""
    from tiered_cache.integrations.vllm import block_tiers

    return all(s.flush(60.0) for s in list(block_tiers._SHARED.values()))


if __name__ == "__main__":
    sys.exit(main())


def _wait_dead(pid: int, timeout_s: float = 10.0) -> None:
    """Until `pid` has exited (a zombie or gone: its files closed, its mappings dropped), at most
    `timeout_s`. SIGKILL only asks: on a busy machine the process can run on for a while, and the
    fault test means "the store is dead" for the next request, not "dying"."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return
        if state in (b"Z", b"X"):
            return
        time.sleep(0.005)

