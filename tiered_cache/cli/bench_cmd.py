"""`tiered-cache bench WHAT`: benchmarks that print each figure beside a same-run baseline."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any

_TIER_PAGES = {"host": 256, "disk": 64, "redis": 128}
_PLOTS = {"ttft", "cluster", "remote", "host", "disk", "redis", "tensor", "keys", "radix"}  # take --plot FILE


class _DefaultsFormatter(argparse.HelpFormatter):
    """Says each option's default where its help does not already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default {action.default})"


# Benches renamed for what they time, old name -> new: the old names still run, unlisted (one line
# on stderr says the new one).
_RENAMED = {"promote": "pool-load", "load": "store-traffic"}


def new_names(argv: list[str]) -> list[str]:
    """`argv` with a renamed bench's old name replaced by its new one (said on stderr)."""
    if len(argv) > 1 and argv[0] == "bench" and argv[1] in _RENAMED:
        print(f"tiered-cache: `bench {argv[1]}` is now `bench {_RENAMED[argv[1]]}`", file=sys.stderr)
        return [argv[0], _RENAMED[argv[1]], *argv[2:]]
    return argv


def _add(which: Any, name: str, help: str) -> argparse.ArgumentParser:
    """A bench subcommand whose `--help` starts with what it measures (its description)."""
    return which.add_parser(name, help=help, description=f"tiered-cache bench {name}: {help}.",
                            formatter_class=_DefaultsFormatter)


def add_parser(commands: Any) -> None:
    p = commands.add_parser("bench", help="benchmarks (each beside a baseline measured in the same run)")
    which = p.add_subparsers(dest="bench", required=True, metavar="WHAT")
    radix = _add(which, "radix", help="radix tree match/insert/evict per operation")
    radix.add_argument("--nodes", default="1000,10000,100000", help="tree sizes (default 1000,10000,100000)")
    radix.add_argument("--ops", type=int, default=2000, help="operations timed per size (default 2000)")
    keys = _add(which, "keys", help="page-key hashing throughput")
    keys.add_argument("--tokens", type=int, default=32768, help="prompt length (default 32768)")
    tensor = _add(which, "tensor", help="tensor API (pool store/read_tokens, cache put/get, load) vs memcpy")
    tensor.add_argument("--model", default="llama-3.1-8b", help="preset whose KV is moved")
    tensor.add_argument("--tokens", type=int, default=2048, help="prefix length, whole pages (default 2048: "
                                                                  "256 MiB for llama-3.1-8b in fp16)")
    tensor.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    tensor.add_argument("--layout", choices=["nhd", "hnd"], default="nhd", help="page layout (default nhd)")
    tensor.add_argument("--repeat", type=int, default=5, help="runs per figure, best kept (default 5)")
    engine = _add(which, "engine", help="request-path latency while every request forces demotion: "
                                             "host RAM only vs Redis vs a store server below")
    engine.add_argument("--model", default="smollm2-135m", help="preset whose pages are moved")
    engine.add_argument("--pages", type=int, default=32, help="pages each request stores and demotes (default 32)")
    engine.add_argument("--requests", type=int, default=200,
                        help="requests per configuration and round, the first tenth not counted (default 200)")
    engine.add_argument("--rounds", type=int, default=3,
                        help="rounds: the configurations take turns, each on a fresh cache (default 3)")
    engine.add_argument("--gap-ms", type=float, default=20.0,
                        help="idle host CPU between requests, as while a GPU computes (default 20; 0: saturated)")
    engine.add_argument("--below", default="redis,remote",
                        help="tiers under host RAM to compare with host RAM alone, comma-separated: redis, remote, "
                             "or none (default redis,remote)")
    engine.add_argument("--device", default="cpu", help="the page pool's device: cpu or cuda (default cpu)")
    subs = [radix, keys, tensor, engine]
    for name, what in (("host", "host RAM tier vs memcpy"), ("disk", "disk tier vs write+fsync / read"),
                       ("redis", "Redis tier vs raw redis-py SET/MGET")):
        sub = _add(which, name, help=what)
        sub.add_argument("--model", default="llama-3.1-8b", help="preset whose pages are moved")
        sub.add_argument("--page-size", type=int, default=8, help="tokens per page (default 8: 1 MiB pages)")
        sub.add_argument("--pages", type=int, default=_TIER_PAGES[name], help="pages per batch")
        if name == "disk":
            sub.add_argument("--dir", help="folder to write in (default: a temporary folder)")
        if name == "redis":
            sub.add_argument("--url", help="an existing Redis (default: start a throwaway redis-server)")
        subs.append(sub)
    remote = _add(which, "remote", help="get and put through the remote tier vs bare gRPC and Redis; lookup latency")
    remote.add_argument("--model", default="llama-3.1-8b", help="preset whose pages are moved")
    remote.add_argument("--page-size", type=int, default=8, help="tokens per page (default 8: 1 MiB pages)")
    remote.add_argument("--pages", type=int, default=256, help="pages in the prefix (default 256)")
    remote.add_argument("--lookup-tokens", type=int, default=32768, help="prompt length for the lookup latency")
    remote.add_argument("--clients", help="comma list of client process counts, e.g. 1,4,16: each count's aggregate "
                                          "get GiB/s and lookup latency during it, beside as many bare gRPC "
                                          "streams (1 is always measured: the scaling baseline)")
    remote.add_argument("--duration", type=float, default=5.0, help="seconds each --clients round runs (default 5)")
    remote.add_argument("--long-prefix", type=float, metavar="GIB",
                        help="get a prefix of GIB GiB through the remote tier on its default settings")
    remote.add_argument("--netns", action="store_true",
                        help="(root) the store in another network namespace (veth): new prefixes of --pages pages "
                             "into a full pool vs a raw TCP stream and a bare gRPC stream between the namespaces")
    subs.append(remote)
    fork = _add(which, "fork", help="pool pages of n parallel samples with copy-on-write forks vs each its own copy")
    fork.add_argument("--model", default="smollm2-135m", help="preset whose pages are counted")
    fork.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length (default 2048)")
    fork.add_argument("--new-tokens", type=int, default=64, help="tokens each sample writes (default 64)")
    fork.add_argument("--samples", default="1,4,16", help="parallel sample counts (default 1,4,16)")
    subs.append(fork)
    swap = _add(which, "swap", help="swap_out + swap_in of a SmolLM2 request vs recomputing its prefill")
    swap.add_argument("--tokens", default="512,2048", help="request lengths (default 512,2048)")
    swap.add_argument("--repeat", type=int, default=3, help="runs per figure, best kept (default 3)")
    subs.append(swap)
    retention = _add(which, "retention", help="a SmolLM2 generation under SinkWindow vs every token kept: "
                                              "peak pool pages, decode time per token")
    retention.add_argument("--tokens", type=int, default=512, help="tokens generated (default 512)")
    retention.add_argument("--window", type=int, default=128, help="SinkWindow's window (default 128)")
    retention.add_argument("--sink", type=int, default=4, help="SinkWindow's sink tokens (default 4)")
    subs.append(retention)
    kernels = _add(which, "kernels", help="(CUDA) gather/scatter kernels vs D2D copy; offload and the vLLM "
                   "connector's save/load vs pinned copy")
    kernels.add_argument("--model", default="llama-3.1-8b", help="preset whose pages are moved")
    kernels.add_argument("--pages", type=int, default=1024, help="pages moved per call (default 1024)")
    kernels.add_argument("--connector-tokens", type=int, default=8192,
                         help="tokens of the vLLM connector's save and load rows (default 8192)")
    subs.append(kernels)
    ttft = _add(which, "ttft", help="TTFT on SmolLM2-135M: recompute vs each tier, and a 70B projection")
    ttft.add_argument("--lengths", default="512,1024,2048,4096", help="prefix lengths in tokens")
    ttft.add_argument("--repeat", type=int, default=3, help="runs per measurement (best is kept)")
    subs.append(ttft)
    int8 = _add(which, "int8", help="how much int8 storage changes SmolLM2's answers (KL, greedy diffs)")
    int8.add_argument("--prompts", type=int, default=8, help="questions about the document (default 8)")
    subs.append(int8)
    codec = _add(which, "codec", help="ratio and MB/s of each codec on real KV and random data")
    codec.add_argument("--kv", help="a .pt file of real KV (layers, 2, tokens, heads, dim); default: "
                                    "SmolLM2-135M's KV of a shipped text when the demo extra is installed")
    subs.append(codec)
    vllm = _add(which, "vllm", help="TTFT of a second vLLM instance: recompute vs tiered-cache (store "
                                         "server, disk, Redis) vs vLLM's ExampleConnector")
    vllm.add_argument("--doc-chars", type=int, default=3000, help="document characters in each prompt (default 3000)")
    vllm.add_argument("--rounds", type=int, default=3,
                      help="times each way's second instance runs, the ways taking turns (default 3: fewer "
                           "requests a way than 9 cannot tell the ways apart on a shared machine)")
    vllm.add_argument("--shm", metavar="on|off", help="the store server's RAM tier as a shared-memory arena "
                                                      "instance B reads in place (default on)")
    subs.append(vllm)
    sgl = _add(which, "sglang", help="TTFT of a second SGLang instance: no L3 vs SGLang's file backend vs "
                                     "tiered-cache (store server), in .venv-sglang")
    sgl.add_argument("--prompts", type=int, default=4, help="prompts each instance asks (default 4)")
    sgl.add_argument("--chars", type=int, default=1200, help="document characters in each prompt (default 1200)")
    sgl.add_argument("--rounds", type=int, default=1, help="rounds, the ways taking turns (default 1)")
    subs.append(sgl)
    clus = _add(which, "cluster", help="shared-prefix workload on a Ray cluster: workers alone vs a shared "
                                            "store with round robin, the prefix router, the event router, vs recompute")
    clus.add_argument("--address", help="an existing Ray cluster (default: start a local one for the run)")
    clus.add_argument("--workers", type=int, default=2, help="cache workers (default 2)")
    clus.add_argument("--shards", type=int, default=1, help="store shards in the shared ways (default 1)")
    clus.add_argument("--docs", type=int, default=8, help="documents (default 8)")
    clus.add_argument("--questions", type=int, default=8, help="questions per document (default 8)")
    clus.add_argument("--concurrency", type=int, help="requests in flight (default: 2 per worker)")
    clus.add_argument("--max-new-tokens", type=int, default=4, help="tokens generated per request (default 4)")
    clus.add_argument("--doc-chars", type=int, default=1200, help="characters of each document (default 1200)")
    clus.add_argument("--seed", type=int, default=0, help="order of the requests (default 0)")
    clus.add_argument("--pool-capacity", default="16MiB",
                      help="each worker's device pool (default 16MiB: a few documents, so pages are evicted)")
    clus.add_argument("--host-capacity", default="32MiB", help="each worker's host RAM (default 32MiB)")
    subs.append(clus)
    srv = _add(which, "serve", help="Ray Serve LLM with vLLM replicas under open-loop load, each way: Serve's "
                                    "routers without and with our connector, our router, our HF workers "
                                    "(in .venv-vllm)")
    srv.add_argument("--ways", default="abcde", help="which ways, in order (default abcde: see bench/serve/bench.py)")
    srv.add_argument("--replicas", type=int, default=2, help="vLLM replicas, and HF workers in way e (default 2)")
    srv.add_argument("--docs", type=int, default=4, help="shared documents (default 4)")
    srv.add_argument("--questions", type=int, default=6, help="questions per document (default 6)")
    srv.add_argument("--doc-chars", type=int, default=2000, help="characters of each document (default 2000)")
    srv.add_argument("--chats", type=int, default=2, help="multi-turn chats (default 2)")
    srv.add_argument("--turns", type=int, default=3, help="turns per chat (default 3)")
    srv.add_argument("--rate", type=float, default=1.0, help="requests a second, open-loop (default 1)")
    srv.add_argument("--max-tokens", type=int, default=16, help="tokens each answer generates (default 16)")
    srv.add_argument("--seed", type=int, default=0, help="the workload's order and arrivals (default 0)")
    srv.add_argument("--address", help="an existing Ray cluster (default: start a local one for the run)")
    srv.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                     help="a vLLM engine argument for every replica of every vLLM way, VALUE as JSON where it "
                          "parses (repeatable; e.g. block_size=128)")
    srv.add_argument("--outcomes", metavar="FILE",
                     help="also write every request's outcome per way (arrival, TTFT, cached tokens) as JSON")
    subs.append(srv)
    traffic = _add(which, "store-traffic", help="N client processes in a serving-like mix against a store server (or, "
                                                "with --ray, a cluster's router): p50/p99/p999, errors, RSS over time")
    traffic.add_argument("--clients", type=int, default=8, help="client processes (default 8)")
    traffic.add_argument("--duration-s", type=float, default=60.0, help="seconds of the mix (default 60)")
    traffic.add_argument("--ram", default="256MiB", help="the started server's RAM tier (default 256MiB: a "
                                                         "fraction of the pages the mix makes, so it evicts)")
    traffic.add_argument("--disk", metavar="SIZE", help="give the started server a disk tier of SIZE in a "
                                                        "temporary folder (default: RAM only)")
    traffic.add_argument("--page-kib", type=int, default=64, help="KiB per page (default 64)")
    traffic.add_argument("--prompts", type=int, default=32, help="shared system prompts, 4-32 pages each (default 32)")
    traffic.add_argument("--histories", type=int, default=16, help="conversations each client keeps going (default 16)")
    traffic.add_argument("--zipf-s", type=float, default=1.1, help="popularity exponent: rank k drawn with weight "
                                                                   "1/k^s (default 1.1)")
    traffic.add_argument("--seed", type=int, default=0, help="tokens, page contents and choices (default 0)")
    traffic.add_argument("--timeout-s", type=float, help="each call's deadline (default 10; with --ray, each "
                                                         "request's: 120)")
    traffic.add_argument("--address", help="HOST:PORT of a running store server, or with --ray a running Ray cluster "
                                           "(default: start one)")
    traffic.add_argument("--server-pid", type=int, help="that server's process id, to sample its RSS")
    traffic.add_argument("--ray", action="store_true", help="chat prompts through the router of a Ray cluster (its "
                                                            "own local one unless --address), recompute first")
    ray_traffic = traffic.add_argument_group("with --ray", "a cluster these start (one already running in --namespace "
                                                           "is used as it is and left running)")
    ray_traffic.add_argument("--namespace", default="tiered-cache-store-traffic", help="the cluster's Ray namespace")
    ray_traffic.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    ray_traffic.add_argument("--shards", type=int, default=1, help="store shards (default 1); --ram and --disk "
                                                                   "size each one's tiers")
    ray_traffic.add_argument("--worker-pool", default="64MiB", help="each worker's device pool (default 64MiB: "
                                                                    "small, so pages go down to the shards)")
    ray_traffic.add_argument("--worker-host", default="128MiB", help="each worker's host RAM tier (default 128MiB)")
    ray_traffic.add_argument("--max-new-tokens", type=int, default=2, help="tokens per answer (default 2)")
    ray_traffic.add_argument("--verify", type=int, default=32, help="prompts answered from the cache that the baseline "
                                                                    "did not ask, recomputed afterwards to compare "
                                                                    "answers (default 32)")
    traffic.add_argument("--plot", "--png", dest="png", metavar="FILE",
                         help="also write a PNG of latency and server memory over time here (--png: the old name)")
    subs.append(traffic)
    gpu = _add(which, "gpu", help="TTFT on a real-shape model with random weights (bf16 on CUDA), recomputed vs "
                                  "reused from each tier, each load beside a same-run pinned copy")
    from tiered_cache.bench.gpu_args import add_arguments as add_gpu_arguments

    add_gpu_arguments(gpu)
    subs.append(gpu)
    pool_load = _add(which, "pool-load", help="a prefix loaded into the pool through TieredCache from host RAM, "
                                              "disk, Redis and a store server, each beside the tier's raw read; "
                                              "evict vs memcpy")
    from tiered_cache.bench.pool_load.bench import add_arguments as add_pool_load_arguments

    add_pool_load_arguments(pool_load)
    subs.append(pool_load)
    for sub in subs:
        sub.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
        if sub.prog.rsplit(" ", 1)[-1] in _PLOTS:
            sub.add_argument("--plot", metavar="FILE", help="also write a PNG of the figures here")
        sub.set_defaults(run=run)


def _run_rows(args: argparse.Namespace) -> tuple[list[Any], str]:
    if args.bench == "radix":
        from tiered_cache.bench.radix_bench import bench_radix

        rows = []
        for n in (int(x) for x in args.nodes.split(",")):
            print(f"building a tree of {n:,} nodes and timing {args.ops:,} operations ...", file=sys.stderr)
            rows += bench_radix(n, ops=args.ops)
        return rows, "nodes"
    if args.bench == "keys":
        from tiered_cache.bench.keys_bench import bench_keys

        return bench_keys(args.tokens), "prompt"
    if args.bench == "tensor":
        from tiered_cache.bench.tensor_bench import bench_tensor
        from tiered_cache.model.presets import preset_spec

        spec = preset_spec(args.model, page_size=args.page_size, layout=args.layout)
        if args.tokens <= 0 or args.tokens % spec.page_size:
            raise SystemExit(f"tiered-cache bench tensor: --tokens must be a positive multiple of the page "
                             f"size ({spec.page_size}); the cache keeps whole pages only")
        return bench_tensor(spec, args.tokens, args.repeat), "prefix"
    if args.bench in ("fork", "swap", "retention"):
        return _feature_rows(args)
    from tiered_cache.bench import tiers_bench
    from tiered_cache.model.presets import get_preset

    if args.bench == "kernels":
        import torch

        from tiered_cache.bench.kernels_bench import bench_kernels

        if not torch.cuda.is_available():
            print("tiered-cache bench kernels: needs a CUDA device (none here); the CPU runs the torch "
                  "reference path, which the other benches measure", file=sys.stderr)
            raise SystemExit(2)
        from tiered_cache.bench.connector_copy_bench import bench_connector_copy
        from tiered_cache.device import cupy_ops

        spec = get_preset(args.model).spec
        kernels = cupy_ops.launch_blocks if cupy_ops.available() else None
        connector = bench_connector_copy(spec, args.connector_tokens, "cuda", kernels)
        return bench_kernels(spec, args.pages) + connector, "batch"
    if args.bench == "remote":
        return _remote_rows(args, get_preset(args.model).spec.with_options(page_size=args.page_size)), "batch"

    spec = get_preset(args.model).spec.with_options(page_size=args.page_size)
    print(f"moving {args.pages} pages of {spec.bytes_per_page:,} bytes ({args.model}) ...", file=sys.stderr)
    if args.bench == "host":
        return tiers_bench.bench_host(spec, args.pages), "batch"
    if args.bench == "disk":
        return tiers_bench.bench_disk(spec, args.pages, args.dir), "batch"
    return tiers_bench.bench_redis(spec, args.pages, args.url), "batch"


def _feature_rows(args: argparse.Namespace) -> tuple[list[Any], str]:
    from tiered_cache.bench import features_bench

    if args.bench == "retention":
        if args.tokens <= 0 or args.window <= 0 or args.sink < 0:
            raise SystemExit("tiered-cache bench retention: --tokens and --window must be positive, --sink >= 0")
        print(f"loading SmolLM2-135M; {args.tokens} tokens under SinkWindow({args.sink}, {args.window}), then "
              "with every token kept ...", file=sys.stderr)
        return features_bench.bench_retention(args.tokens, args.window, args.sink), "generation"
    counts = (_positive_counts(args.samples, "fork --samples") if args.bench == "fork"
              else _positive_counts(args.tokens, "swap --tokens"))
    if args.bench == "swap":
        print("loading SmolLM2-135M; each length: prefill, then swap out and in, then the prefill again ...",
              file=sys.stderr)
        return features_bench.bench_swap(counts, max(1, args.repeat)), "request"
    from tiered_cache.model.presets import get_preset

    if args.prompt_tokens <= 0 or args.new_tokens <= 0:
        raise SystemExit("tiered-cache bench fork: --prompt-tokens and --new-tokens must be positive")
    return features_bench.bench_fork(get_preset(args.model).spec, args.prompt_tokens, args.new_tokens,
                                     counts), "samples"


def _positive_counts(text: str, what: str) -> list[int]:
    """A comma list of positive integers, or a one-line exit naming the bench option and the text."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) <= 0:
        raise SystemExit(f"tiered-cache bench {what}: expected positive counts such as 1,4,16, got {text!r}")
    return counts


def _remote_rows(args: argparse.Namespace, spec: Any) -> list[Any]:
    from tiered_cache.bench import remote_bench

    if args.netns:
        return _netns_rows(spec, args.pages)
    if args.clients is None and args.long_prefix is None:
        print(f"getting {args.pages} pages of {spec.bytes_per_page:,} bytes through a store server ...",
              file=sys.stderr)
        return (remote_bench.bench_get(spec, args.pages) + remote_bench.bench_put(spec, args.pages)
                + remote_bench.bench_lookup(args.lookup_tokens))
    rows = []
    if args.clients is not None:
        counts = _positive_counts(args.clients, "remote --clients")
        if args.duration <= 0:
            raise SystemExit(f"tiered-cache bench remote: --duration takes positive seconds, got {args.duration:g}")
        rows += remote_bench.bench_clients(spec, args.pages, counts, args.duration, args.lookup_tokens)
    if args.long_prefix is not None:
        if not args.long_prefix > 0:
            raise SystemExit(f"tiered-cache bench remote: --long-prefix takes GiB > 0, got {args.long_prefix:g}")
        rows += remote_bench.bench_long_prefix(spec, args.long_prefix)
    return rows


def _netns_rows(spec: Any, pages: int) -> list[Any]:
    from tiered_cache.bench import netns_bench
    from tiered_cache.bench.timing import Comparison

    why = netns_bench.unavailable()
    if why is not None:
        print(f"tiered-cache {why}", file=sys.stderr)
        raise SystemExit(0)
    mib = pages * spec.bytes_per_page / 2**20
    print(f"two network namespaces; {mib:,.0f} MiB prefixes, new each round, into a full pool of 8 ...",
          file=sys.stderr)
    figures = netns_bench.bench_netns(spec.to_dict(), mib, rounds=5, pool_prefixes=8)
    scale = f"{mib:,.0f} MiB, another namespace"
    rows = [Comparison(scale, "store -> pool, new prefix, full pool", load, limit_name, limit, "GB/s", True,
                       figures.nbytes, figures.wire_bytes) for limit_name, load, limit in figures.rows()]
    steady_name, first, steady = figures.first_row()
    first_load = f"a new reader's first load ({figures.settle_s:g} s after start)"
    return [*rows, Comparison(scale, first_load, first, steady_name, steady, "GB/s", True,
                              figures.nbytes, figures.nbytes)]


def _run_model_bench(args: argparse.Namespace) -> int:
    if args.bench == "ttft":
        from tiered_cache.bench.ttft_bench import measure, projection, render, rows_as_dicts

        rows = measure(tuple(int(x) for x in args.lengths.split(",")), args.repeat)
        projected = projection(rows)
        if args.plot:
            from tiered_cache.bench.plots import plot_ttft

            plot_ttft(rows, args.plot)
        print(json.dumps({"measured": rows_as_dicts(rows), "projection": projected}, indent=2) if args.json
              else render(rows, projected))
        return 0
    from dataclasses import asdict

    from tiered_cache.bench.int8_quality import int8_quality
    from tiered_cache.integrations.document import chat_prompt
    from tiered_cache.integrations.smollm2 import load_model

    model, tokenizer = load_model()
    questions = _INT8_QUESTIONS[:args.prompts]
    prompts = [chat_prompt(tokenizer, q) for q in questions]
    shared = prompts[0][:min(len(p) for p in prompts) - 1]
    print(f"{len(prompts)} questions about the document, the shared {len(shared):,}-token prefix read back "
          "through int8 blobs ...", file=sys.stderr)
    quality = int8_quality(model, prompts, shared, 32, tokenizer.eos_token_id)
    if args.json:
        print(json.dumps(asdict(quality), indent=2))
    else:
        print(f"int8 KV (per token, per head absmax) on SmolLM2-135M, {quality.prompts} prompts, "
              f"{quality.new_tokens} greedy tokens each:\n"
              f"  greedy continuation differs from no-cache: {quality.greedy_differs} of {quality.prompts}\n"
              f"  KL(no cache || int8) of the next-token distribution: mean {quality.mean_kl:.2e} nats, "
              f"max {quality.max_kl:.2e}")
    return 0


_INT8_QUESTIONS = [
    "In what year was the lighthouse's lamp first lit?", "Who was the first keeper of the light?",
    "In what year was the light automated?", "Which engineer built the lighthouse?",
    "What is the archive's most valuable object?", "How many keepers held the light?",
    "Who is the current archivist?", "How far can the lamp be seen in clear weather?",
]


def run(args: argparse.Namespace) -> int:
    if args.bench in ("ttft", "int8"):
        return _run_model_bench(args)
    if args.bench == "engine":
        from tiered_cache.bench.engine_bench import bench_engine, render

        below = tuple(b.strip() for b in args.below.split(",") if b.strip() and b.strip() != "none")
        rows = bench_engine(args.model, args.pages, args.requests, args.gap_ms, ("host only", *below), args.device,
                            args.rounds)
        print(json.dumps([r.to_dict() for r in rows], indent=2) if args.json else render(rows))
        return 0
    if args.bench == "vllm":
        from tiered_cache.bench.vllm_bench import bench_vllm
        from tiered_cache.bench.vllm_bench import render as render_vllm

        rows = bench_vllm(args.doc_chars, args.rounds, args.shm,
                          progress=lambda m: print(m, file=sys.stderr, flush=True))
        print(json.dumps([r.to_dict(rows[0]) for r in rows], indent=2) if args.json else render_vllm(rows))
        return 0
    if args.bench == "sglang":
        from tiered_cache.bench.sglang_bench import bench_sglang, render_reads
        from tiered_cache.bench.sglang_bench import render as render_sglang

        rows, reads = bench_sglang(args.prompts, args.chars, args.rounds,
                                   progress=lambda m: print(m, file=sys.stderr, flush=True))
        file = next((r for r in rows if "file" in r.way), None)
        if args.json:
            print(json.dumps({"instances": [r.to_dict(rows[0], file) for r in rows], "l3_reads": reads}, indent=2))
        else:
            print(f"{render_sglang(rows)}\n\n{render_reads(reads)}")
        return 0
    if args.bench == "cluster":
        from tiered_cache.bench.cluster_bench import bench_cluster, render
        from tiered_cache.workers.cluster import stdout_for_the_answer

        out = stdout_for_the_answer()  # the results alone on stdout, Ray's driver talking or not
        results = bench_cluster(args.address, args.workers, args.shards, args.docs, args.questions,
                                args.concurrency, args.max_new_tokens, doc_chars=args.doc_chars, seed=args.seed,
                                pool_capacity=args.pool_capacity, host_capacity=args.host_capacity,
                                progress=lambda m: print(m, file=sys.stderr, flush=True))
        print(json.dumps([r.to_dict(results[0]) for r in results], indent=2) if args.json else render(results),
              file=out)
        if args.plot:
            from tiered_cache.bench.plots import plot_cluster

            plot_cluster(results, args.plot)
        return 0
    if args.bench == "serve":
        from tiered_cache.bench.serve.bench import ServeBenchSettings, bench_serve, engine_arg
        from tiered_cache.bench.serve.report import outcomes, render, router_lines, summary
        from tiered_cache.bench.serve.workload import ServeWorkload
        from tiered_cache.workers.cluster import stdout_for_the_answer
        from tiered_cache.workers.serve_llm.settings import engine_missing

        out = stdout_for_the_answer()
        workload = ServeWorkload(args.docs, args.questions, args.doc_chars, args.chats, args.turns, args.rate,
                                 args.seed)
        try:
            engine = dict(engine_arg(a) for a in args.engine_arg)
        except ValueError as exc:
            print(f"bench serve: {exc}", file=sys.stderr)
            return 2
        if set(args.ways) & set("abcd") and (missing := engine_missing()):
            print(f"bench serve: ways a-d run vLLM: {missing}", file=sys.stderr)
            return 2
        settings = ServeBenchSettings(workload, args.ways, args.replicas, args.max_tokens, address=args.address,
                                      engine_kwargs=engine)
        runs = bench_serve(settings, progress=lambda m: print(f"bench serve: {m}", file=sys.stderr, flush=True))
        rows = [summary(r, runs[0]) for r in runs]
        print(json.dumps(rows, indent=2) if args.json else "\n".join([render(rows), *router_lines(runs)]), file=out)
        if args.outcomes:
            with open(args.outcomes, "w") as f:
                json.dump(outcomes(runs, workload.requests()), f, indent=1)
        return 0
    if args.bench == "store-traffic":
        from tiered_cache.bench.store_traffic.bench import run_store_traffic_bench

        return run_store_traffic_bench(args)
    if args.bench == "gpu":
        from tiered_cache.bench.gpu_bench import run_gpu_bench

        return run_gpu_bench(args)
    if args.bench == "pool-load":
        from tiered_cache.bench.pool_load.bench import run_pool_load_bench

        return run_pool_load_bench(args)
    if args.bench == "codec":
        from tiered_cache.bench.codec_bench import run_codec_bench

        return run_codec_bench(args)
    from tiered_cache.bench.timing import render_comparisons

    rows, scale = _run_rows(args)
    if getattr(args, "plot", None):
        from tiered_cache.bench.plots import plot_comparisons

        plot_comparisons(rows, args.plot, f"tiered-cache bench {args.bench}, each beside its same-run baseline")
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        print(f"host: {platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}")
        print(render_comparisons(rows, scale))
    return 0
