"""`tiered-cache bench gpu`: time to first token through the public API (`TieredCache` and
`integrations.transformers.generate`) on a model of a real shape with random weights, for
prompts of 2k-32k tokens, recomputed and reused from each tier, each load beside the same-run
copy limit and each first token's logits beside recomputation's. Table: gpu_table.py."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from itertools import repeat
from typing import Any

import torch

from tiered_cache.bench.gpu_args import DEFAULT_TOKENS, PAGE_SIZE, REUSE_ROWS, SUFFIX
from tiered_cache.bench.gpu_fit import DoesNotFit
from tiered_cache.bench.gpu_model import load_random_model
from tiered_cache.bench.gpu_rows import GpuRow, Progress, copy_limit, measure_recompute, measure_reuse
from tiered_cache.bench.gpu_serving import measure_serving
from tiered_cache.bench.gpu_sources import TIER_OF, LowerSource, Servers, UpperSource, cache_config, fill_tier
from tiered_cache.cache import TieredCache
from tiered_cache.integrations.transformers import generate, spec_for
from tiered_cache.model.spec import KVSpec
from tiered_cache.wire import checked_copy, checksum


def bench_gpu(model_name: str, tokens: list[int], device: str, dtype: str, rounds: int, rows: tuple[str, ...],
              progress: Progress, state: str = "serving",
              pool_prefixes: int = 8) -> tuple[dict[str, Any], list[GpuRow]]:
    """(the setup, the rows of every prefix length in `tokens`, shortest first), in `state`:
    `serving` (gpu_serving.py) or `warm` (one prefix read again and again by a cache with room)."""
    torch_dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype])
    progress(f"building {model_name} with random weights, {dtype} on {device} ...")
    pools = pool_prefixes if state == "serving" else 1
    built = load_random_model(model_name, device, torch_dtype, max(tokens) + SUFFIX, pools)
    cut = f" (cut from {built.total_layers} to fit the device)" if built.layers < built.total_layers else ""
    progress(f"{model_name}: {built.layers} layers{cut}")
    spec = spec_for(built.model, dtype, page_size=PAGE_SIZE, model_id=built.model_id)
    assert all(n > 0 and n % spec.page_size == 0 for n in tokens), tokens
    setup = {"model": model_name, "layers": built.layers, "total_layers": built.total_layers, "dtype": dtype,
             "device": _device_name(device), "page_size": spec.page_size, "bytes_per_token": spec.bytes_per_token,
             "bytes_per_page": spec.bytes_per_page, "suffix_tokens": SUFFIX, "rounds": rounds, "rows": list(rows),
             "state": state, "pool_prefixes": pools,
             "checks": f"CRC-32C by {checksum.IMPLEMENTATION} on {checksum.checker_threads()} threads, native page "
                       f"copy {'on' if checked_copy.NATIVE else 'off'}"}
    results = []
    for n in sorted(tokens):
        progress(f"{n:,}-token prefix ({spec.bytes_for_tokens(n) / 2**30:.2f} GiB of KV):")
        # The tiers below keep every prefix of this length a row reads, so none is evicted.
        servers = Servers.start(rows, spec.bytes_for_tokens(n) * (rounds + 1 if state == "serving" else 1))
        try:
            results += measure_length(built.model, spec, n, rows, rounds, device, state, pools, servers, progress,
                                      seed=n)
        finally:
            servers.close()
    return setup, results


def measure_length(model: Any, spec: KVSpec, n: int, rows: tuple[str, ...], rounds: int, device: str, state: str,
                   pool_prefixes: int, servers: Servers, progress: Progress, seed: int) -> list[GpuRow]:
    """Every row for prefixes of `n` random tokens (seeded) and an uncached suffix."""
    ids = torch.randint(0, model.config.vocab_size, (n + SUFFIX,), generator=torch.Generator().manual_seed(seed))
    prompt = ids.tolist()
    recompute, reference = measure_recompute(model, prompt, n, rounds, progress)
    limit_name, limit_s = copy_limit(spec.bytes_for_tokens(n), device, max(3, rounds))
    out = [recompute]
    if state == "serving":
        out += measure_serving(model, spec, n, rows, rounds, device, pool_prefixes, servers, recompute, progress, seed)
    else:
        out += _measure_warm(model, spec, prompt, reference, n, rows, rounds, device, servers, recompute, progress)
    for row in out[1:]:
        row.limit_name, row.limit_s, row.limit_bytes = limit_name, limit_s, spec.bytes_for_tokens(n)
    return out


def _measure_warm(model: Any, spec: KVSpec, prompt: list[int], reference: torch.Tensor, n: int, rows: tuple[str, ...],
                  rounds: int, device: str, servers: Servers, recompute: GpuRow, progress: Progress) -> list[GpuRow]:
    """The reuse rows with one prefix, put back in its tier before every round (gpu_sources.py)."""
    prefix = prompt[:n]
    pool = spec.bytes_for_tokens(n) + 4 * spec.bytes_per_page
    out = []
    settings = cache_config(device, pool, pool)
    lower = [r for r in rows if r not in ("device", "host")]
    with TieredCache(spec, settings) as upper:
        generate(model, prefix, upper, 1)  # computes the prefix and caches it
        _, kv = upper.get(prefix)
        for row in lower:
            progress(f"  {row}: a writer cache puts the prefix there ...")
            fill_tier(spec, settings.replace(**servers.lower_settings(row, n)), prefix, kv)
        del kv
        for row in (r for r in rows if r in ("device", "host")):
            source = UpperSource(row, upper)
            out.append(measure_reuse(model, source, TIER_OF[row], repeat((prompt, reference)), n, rounds, recompute,
                                     device, progress))
            if source.evictions:  # the first reset was the unmeasured round's
                measured = source.evictions[1:]
                out[-1].evict_bytes = max(nbytes for nbytes, _ in measured)
                out[-1].evict_s = [seconds for _, seconds in measured]
                out[-1].evict_limit_s = copy_limit(out[-1].evict_bytes, device, max(3, rounds), to_device=False)[1]
    for row in lower:
        source = LowerSource(row, spec, settings.replace(**servers.lower_settings(row, n)))
        try:
            out.append(measure_reuse(model, source, TIER_OF[row], repeat((prompt, reference)), n, rounds, recompute,
                                     device, progress))
        finally:
            source.close()
    return out


def _device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def _choose_rows(text: str | None) -> tuple[str, ...]:
    """The reuse rows asked for (all by default; redis only where `redis-server` is installed)."""
    has_redis = shutil.which("redis-server") is not None
    if text is None:
        return tuple(r for r in REUSE_ROWS if r != "redis" or has_redis)
    rows = tuple(r.strip() for r in text.split(",") if r.strip() and r.strip() != "recompute")
    unknown = [r for r in rows if r not in REUSE_ROWS]
    if unknown:
        raise SystemExit(f"tiered-cache bench gpu: unknown --rows {unknown}; choose from recompute (always run), "
                         f"{', '.join(REUSE_ROWS)}")
    if "redis" in rows and not has_redis:
        raise SystemExit("tiered-cache bench gpu: --rows redis needs redis-server on the PATH")
    return tuple(r for r in REUSE_ROWS if r in rows)  # in the table's order


def run_gpu_bench(args: argparse.Namespace) -> int:
    from tiered_cache.bench.gpu_table import render

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tiered-cache bench gpu: --device cuda but torch sees no CUDA device")
    text = args.tokens or DEFAULT_TOKENS[device]
    try:
        tokens = [int(x) for x in text.split(",")]
    except ValueError:
        tokens = []
    if not tokens or any(n <= 0 or n % PAGE_SIZE for n in tokens):
        raise SystemExit(f"tiered-cache bench gpu: --tokens takes positive multiples of the page size ({PAGE_SIZE}), "
                         f"comma-separated, got {text!r}")
    if args.pool_prefixes < 1:
        raise SystemExit(f"tiered-cache bench gpu: --pool-prefixes must be at least 1, got {args.pool_prefixes}")
    if args.rounds < 1:
        raise SystemExit(f"tiered-cache bench gpu: --rounds must be at least 1, got {args.rounds}")
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    try:
        setup, rows = bench_gpu(args.model, tokens, device, dtype, args.rounds, _choose_rows(args.rows),
                                lambda m: print(m, file=sys.stderr, flush=True), args.state, args.pool_prefixes)
    except DoesNotFit as exc:
        raise SystemExit(f"tiered-cache bench gpu: {exc}") from None
    print(json.dumps({"setup": setup, "rows": [r.to_dict() for r in rows]}, indent=2) if args.json
          else render(setup, rows))
    return 0
