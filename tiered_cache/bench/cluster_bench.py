"""`tiered-cache bench cluster`: a chat service's shared-prefix workload on W workers, five ways in
one run: recompute (no cache, the baseline), each worker alone (no shared store, round robin),
a shared store with round robin, with the prefix router (what it sent where), and with the event
router (where the workers' and shards' KV events say the pages are, by expected TTFT).

Workers' device pools and host RAM are small by default (`pool_capacity`, `host_capacity`): a few
documents fit, so pages are evicted and demoted as in a serving cluster, and what a router
recorded sending somewhere is not always still there.

The workload is D documents x Q questions in a seeded random order, `concurrency` requests in
flight at once (as a service sees them). With one in flight, each request's pages reach the store
(write-through, in the background) before the next request is sent, as for requests further apart
than a write: what each way reuses is then the same in every run, not a race with the writer.
One cluster runs every way, in the bench's own namespace, and is stopped afterwards; before each
way it is made cold (`cold_start`: workers reset to empty caches keyed in a namespace of that
way's own, so the shards hold none of its pages, and the router reset to that way's policy), so
workers load their model once, not once per way. Reported per way: prefill tokens saved (prompt
tokens whose KV came from a cache) and the tier they came from (device, host, remote: the store),
TTFT as a client sees it (waiting for the worker plus the worker's TTFT) p50 and p99, the mean
TTFT and its ratio to recompute, and the KV bytes read from the store (moved between nodes).
Greedy answers must be identical in every way: a cache changes speed, never text.

Ray and `workers/` are imported when the bench runs, so the module imports without them.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tiered_cache.bench.timing import quantile
from tiered_cache.integrations.document import document

NAMESPACE = "tiered-cache-bench"
QUESTIONS = [
    "Summarise this in one sentence.", "What is the main subject?", "Which years are mentioned?",
    "Who are the people named?", "What happened first?", "What happened last?",
    "Give one surprising detail.", "What place is described?",
]


@dataclass
class WayResult:
    way: str
    prompt_tokens: int = 0
    reused_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    routes: Counter[str] = field(default_factory=Counter)  # worker -> requests
    reused_from: Counter[str] = field(default_factory=Counter)  # tier -> reused tokens
    answers: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    waits_s: list[float] = field(default_factory=list)  # queued on the worker + its TTFT, per request
    bytes_per_token: int = 0  # of KV, to turn tokens read from the store into bytes moved

    @property
    def saved_share(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_ttft_s(self) -> float:
        return sum(self.ttft_s) / len(self.ttft_s)

    @property
    def p99_ttft_s(self) -> float:
        return quantile(self.ttft_s, 0.99)

    @property
    def p50_wait_s(self) -> float:
        return quantile(self.waits_s, 0.5)

    @property
    def p99_wait_s(self) -> float:
        return quantile(self.waits_s, 0.99)

    @property
    def store_bytes(self) -> int:
        return self.reused_from.get("remote", 0) * self.bytes_per_token

    def to_dict(self, recompute: WayResult | None = None) -> dict[str, Any]:
        out = {"way": self.way, "requests": len(self.ttft_s), "prompt_tokens": self.prompt_tokens,
               "reused_tokens": self.reused_tokens, "saved_share": self.saved_share,
               "mean_ttft_s": self.mean_ttft_s, "p99_ttft_s": self.p99_ttft_s, "p50_client_ttft_s": self.p50_wait_s,
               "p99_client_ttft_s": self.p99_wait_s, "store_bytes": self.store_bytes, "wall_s": self.wall_s,
               "routes": dict(self.routes), "reused_from": dict(self.reused_from)}
        if recompute is not None:
            out["mean_ttft_vs_recompute"] = recompute.mean_ttft_s / self.mean_ttft_s
            out["answers_match_recompute"] = self.answers == recompute.answers
        return out


def workload(docs: int, questions: int, doc_chars: int, seed: int) -> list[tuple[int, int, str]]:
    """(document, question, prompt) for every pair, shuffled; documents are slices of the shipped text."""
    text = document()
    if docs * doc_chars > len(text):
        text = text * (docs * doc_chars // len(text) + 1)
    asks = QUESTIONS * (questions // len(QUESTIONS) + 1)
    pairs = [(d, q, f"{text[d * doc_chars:(d + 1) * doc_chars]}\n\nQuestion: {asks[q]}")
             for d in range(docs) for q in range(questions)]
    random.Random(seed).shuffle(pairs)
    return pairs


def _drive(requests: list[tuple[int, int, str]], way: str, use_cache: bool, concurrency: int,
           max_new_tokens: int) -> WayResult:
    """Send every request through the router, `concurrency` in flight at once. With one in flight,
    the worker that answered writes its new pages through to the store before the next request
    (`CacheWorker.flush`, not counted in `wall_s`)."""
    import ray

    from tiered_cache.workers.names import ROUTER

    router = ray.get_actor(ROUTER)
    result = WayResult(way)
    pending: dict[Any, tuple[int, int]] = {}
    queue = list(requests)
    settling = 0.0  # seconds waiting for write-through between requests
    started = time.perf_counter()
    while queue or pending:
        while queue and len(pending) < concurrency:
            d, q, prompt = queue.pop(0)
            pending[router.generate.remote(prompt, max_new_tokens, use_cache)] = (d, q)
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            answer = ray.get(ref)
            result.answers[pending.pop(ref)] = answer["tokens"]
            result.prompt_tokens += answer["prompt_tokens"]
            result.reused_tokens += answer["reused_tokens"]
            result.ttft_s.append(answer["ttft_s"])
            result.waits_s.append(answer.get("queued_s", 0.0) + answer["ttft_s"])
            result.routes[answer["worker"]] += 1
            result.reused_from.update(answer["sources"])
            if use_cache and concurrency == 1:
                flushed = time.perf_counter()
                if not ray.get(ray.get_actor(answer["worker"]).flush.remote()):
                    raise RuntimeError(f"{answer['worker']}: its write-through did not finish in 60 s")
                settling += time.perf_counter() - flushed
    result.wall_s = time.perf_counter() - started - settling
    return result


def bench_cluster(address: str | None = None, workers: int = 2, shards: int = 1, docs: int = 8,
                  questions: int = 8, concurrency: int | None = None, max_new_tokens: int = 4,
                  doc_chars: int = 1200, seed: int = 0, pool_capacity: str = "16MiB", host_capacity: str = "32MiB",
                  progress: Callable[[str], None] = lambda _: None) -> list[WayResult]:
    """Run the five ways; returns [recompute, alone, shared_round_robin, shared_prefix, shared_events]."""
    import ray

    from tiered_cache.workers import cluster
    from tiered_cache.workers.config import WorkerSettings

    if min(workers, shards, docs, questions, doc_chars) <= 0:
        raise ValueError("workers, shards, docs, questions and doc_chars must be positive")
    concurrency = concurrency or 2 * workers
    joined = not ray.is_initialized()
    if address is None:
        ray.init(num_cpus=workers + shards + 1, namespace=NAMESPACE, include_dashboard=False,
                 object_store_memory=200 * 2**20, logging_level="WARNING", log_to_driver=False)
    else:
        cluster.connect(address, NAMESPACE)
    try:
        worker = WorkerSettings(max_new_tokens=max_new_tokens, pool_capacity=pool_capacity,
                                host_capacity=host_capacity)
        return _run_ways(workers, shards, docs, questions, concurrency, worker, doc_chars, seed, progress)
    finally:
        if joined:  # a cluster it started is gone with it; one it joined goes on
            ray.shutdown()


def _run_ways(workers: int, shards: int, docs: int, questions: int, concurrency: int, worker: Any,
              doc_chars: int, seed: int, progress: Callable[[str], None]) -> list[WayResult]:
    import ray

    from tiered_cache.workers import cluster
    from tiered_cache.workers.config import ClusterConfig, RouterSettings, RoutingPolicyName, ShardSettings
    from tiered_cache.workers.names import worker_name

    requests = workload(docs, questions, doc_chars, seed)
    max_new_tokens = worker.max_new_tokens
    ways = [("alone", False, RoutingPolicyName.ROUND_ROBIN),
            ("shared_round_robin", True, RoutingPolicyName.ROUND_ROBIN),
            ("shared_prefix", True, RoutingPolicyName.PREFIX),
            ("shared_events", True, RoutingPolicyName.EVENTS)]
    results = []
    with tempfile.TemporaryDirectory(prefix="tiered-cache-bench-cluster-") as folder:

        def config_for(policy: RoutingPolicyName) -> ClusterConfig:
            return ClusterConfig(namespace=NAMESPACE, shards=shards, workers=workers, worker=worker,
                                 shard=ShardSettings(disk_path=folder, ram_capacity="1GiB"),
                                 router=replace(RouterSettings(), policy=policy), kv_events="tcp://127.0.0.1:0")

        # One cluster for every way (the workers load their model once); each way then starts
        # cold: empty shards, workers with empty caches and rings of the shards or none, a router
        # with that way's policy and nothing recorded.
        progress(f"starting {workers} worker(s) and {shards} shard(s) ...")
        cluster.start(config_for(RoutingPolicyName.ROUND_ROBIN))
        bytes_per_token = ray.get(ray.get_actor(worker_name(0)).info.remote())["bytes_per_token"]
        try:
            for way, use_shards, policy in ways:
                config = config_for(policy)
                progress(f"{way}: cold caches, {'the' if use_shards else 'no'} shards, {policy.value} routing ...")
                cold_start(config, use_shards, f"bench-cluster-{way}-{seed}")
                if not results:  # the baseline, on the first (cold) cluster: caches untouched
                    progress(f"recompute: {len(requests)} requests, no cache ...")
                    results.append(_drive(requests, "recompute", False, concurrency, max_new_tokens))
                progress(f"{way}: {len(requests)} requests, {concurrency} in flight ...")
                results.append(_drive(requests, way, True, concurrency, max_new_tokens))
                results[-1].bytes_per_token = bytes_per_token
        finally:
            cluster.stop(NAMESPACE)
    return results


def cold_start(config: Any, use_shards: bool, namespace: str) -> None:
    """Make the running cluster cold for the next way, with no new process: every worker reset
    (`CacheWorker.reset`) to an empty cache whose pages live in `namespace` (so the shards hold
    none of them), with the shards as its ring or none, and the router reset to `config`'s policy."""
    import ray

    from tiered_cache.workers.names import ROUTER, worker_name

    sizes = ray.get([ray.get_actor(worker_name(i)).reset.remote(use_shards, namespace)
                     for i in range(config.workers)])
    ray.get(ray.get_actor(ROUTER).reset.remote(config.router))  # after the workers: it meets their new caches
    expected = config.shards if use_shards else 0
    if any(size != expected for size in sizes):
        raise RuntimeError(f"workers' rings after the reset: {sizes}, expected {expected} shard(s) each")


def render(results: list[WayResult]) -> str:
    from tiered_cache.report.table import render_table

    recompute = results[0]
    rows = []
    for r in results:
        rows.append([r.way, f"{len(r.ttft_s)}", f"{r.reused_tokens:,} / {r.prompt_tokens:,}",
                     f"{r.saved_share:.1%}", f"{r.p50_wait_s * 1e3:,.0f} ms", f"{r.p99_wait_s * 1e3:,.0f} ms",
                     f"{r.mean_ttft_s * 1e3:,.0f} ms", f"{recompute.mean_ttft_s / r.mean_ttft_s:.2f}x",
                     f"{r.store_bytes / 2**20:,.0f} MiB",
                     ", ".join(f"{w} {n}" for w, n in sorted(r.routes.items()))])
    table = render_table(rows, ["way", "requests", "prefill saved", "saved", "client TTFT p50", "p99",
                                "mean TTFT", "vs recompute", "from the store", "requests per worker"],
                         align_right=range(1, 9))
    same = all(r.answers == recompute.answers for r in results)
    return f"{table}\n\ngreedy answers identical in every way: {'yes' if same else 'NO'}"
