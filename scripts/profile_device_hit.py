"""Where a device-pool hit's TTFT goes, stage by stage, on a random-weight model of a real shape:
match + load, the pool read into a tensor (`read_tokens`), the `DynamicCache` built from it
(`cache_of_kv`), and the forward of the uncached suffix over the reused context, each timed alone
(synchronised, median of 5), then the forward's top CUDA ops under torch.profiler. Variants of the
forward show what the context's layout and GQA handling cost.
Usage: python3 scripts/profile_device_hit.py [--model llama-3.1-8b] [--tokens 32768] [--device cuda]"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tiered_cache.bench.gpu_bench import SUFFIX
from tiered_cache.bench.gpu_model import load_random_model
from tiered_cache.bench.gpu_sources import cache_config
from tiered_cache.cache import TieredCache
from tiered_cache.integrations.transformers import cache_keyword, cache_of_kv, generate, last_logits_only, spec_for


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeat: int = 5) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    built = load_random_model(args.model, args.device, dtype, args.tokens + SUFFIX)
    model = built.model
    spec = spec_for(model, "bf16" if args.device == "cuda" else "fp32", page_size=16, model_id=built.model_id)
    n = args.tokens
    seeded = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (n + SUFFIX,), generator=seeded).tolist()
    pool = spec.bytes_for_tokens(n) + 4 * spec.bytes_per_page
    print(f"{args.model} ({built.layers} layers), {n:,} tokens, {spec.bytes_for_tokens(n) / 2**30:.2f} GiB of KV, "
          f"attn {model.config._attn_implementation}, transformers {__import__('transformers').__version__}, "
          f"torch {torch.__version__}")
    with TieredCache(spec, cache_config(args.device, pool, pool)) as cache:
        generate(model, prompt[:n], cache, 1)
        for _ in range(2):
            result = generate(model, prompt, cache, 1)
        print(f"generate (device hit): TTFT {result.ttft_s * 1e3:.1f} ms, reused {result.reused_tokens:,}")
        keyword = cache_keyword(model)
        device = args.device
        inputs = torch.tensor([prompt[n:]], device=model.device)
        handle = cache.match(prompt)
        try:
            cache.prefetch(handle)
            pages = cache.load(handle)
            stages: dict[str, float] = {}
            stages["read_tokens"] = timed(lambda: cache.pool.read_tokens(pages, n), device)
            kv = cache.pool.read_tokens(pages, n)
            stages["cache_of_kv"] = timed(lambda: cache_of_kv(kv, model), device)

            def forward_only(contiguous: bool) -> float:
                times = []
                for _ in range(5):
                    past = cache_of_kv(kv, model)
                    if contiguous:
                        for layer in past.layers:
                            layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
                    sync(device)
                    started = time.perf_counter()
                    with torch.inference_mode():
                        model(inputs, use_cache=True, **{keyword: past}, **last_logits_only(model))
                    sync(device)
                    times.append(time.perf_counter() - started)
                return statistics.median(times[1:])

            stages["forward, context as cache_of_kv leaves it (strided)"] = forward_only(False)
            stages["forward, context made contiguous first"] = forward_only(True)
            with torch.inference_mode():
                stages["forward, no context (the suffix alone)"] = timed(
                    lambda: model(inputs, use_cache=True, **last_logits_only(model)), device)
            for name, seconds in stages.items():
                print(f"  {name:<55} {seconds * 1e3:9.2f} ms")
            if device == "cuda":
                from torch.profiler import ProfilerActivity, profile

                past = cache_of_kv(kv, model)
                sync(device)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, torch.inference_mode():
                    model(inputs, use_cache=True, **{keyword: past}, **last_logits_only(model))
                    sync(device)
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
        finally:
            cache.release(handle)


if __name__ == "__main__":
    main()
