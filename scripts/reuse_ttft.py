"""TTFT under the reuse policy against recompute, with a real store server (issue 33, item 5).

A writer instance caches two prompts' KV in a store server (`tiered-cache serve`, RAM only). Then
fresh reader instances (host RAM + the store, nothing on the device), one per policy, each first
prefill an unrelated prompt (teaching the prefill rate) and answer the first cached prompt
(teaching the store's load rate), then answer the second: TTFT of that last request is compared
with recomputing the prompt with no cache (median of 3). Random weights: TTFT depends on the
shape, not on the values.

    python scripts/reuse_ttft.py --device cuda --shape llama-3.1-8b --tokens 8192
    python scripts/reuse_ttft.py                      # tiny model on the CPU: a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.integrations.transformers import generate, spec_for
from tiered_cache.server.process import StoreProcess

SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
}


def build(shape: str, device: str, dtype: torch.dtype) -> object:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=131072)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in the compute dtype, on the device: 16 GB, not 32 + a copy
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=512)
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    model = build(args.shape, args.device, torch.bfloat16 if cuda else torch.float32)
    spec = spec_for(model, "bf16" if cuda else "fp16", page_size=16, model_id=f"random-{args.shape}")
    gen = torch.Generator().manual_seed(1)
    other, warm, prompt = (torch.randint(0, SHAPES[args.shape]["vocab_size"], (args.tokens,), generator=gen).tolist()
                           for _ in range(3))
    kv = spec.bytes_for_tokens(args.tokens)
    room = max(4 * kv, 64 * 2**20)  # three prompts' KV, in the pool, host RAM and the store
    print(f"{args.shape} on {torch.cuda.get_device_name() if cuda else 'cpu'}, {args.tokens:,} tokens, "
          f"{kv / 2**20:,.0f} MiB of KV per prompt", flush=True)
    with StoreProcess(["--no-disk", "--ram", str(room)]) as store:
        base = dict(device=args.device, pool_capacity=room, host_capacity=room, lower_tiers=["remote"],
                    remote_addresses=[store.address])
        with TieredCache(spec, CacheConfig(**base, write_policy="write_through")) as writer:
            for tokens in (warm, prompt):
                generate(model, tokens, writer, max_new_tokens=1)
            assert writer.flush(600), "the writer did not finish putting the pages into the store"
        generate(model, other, None, max_new_tokens=1)  # warm the kernels
        recompute = statistics.median(generate(model, prompt, None, max_new_tokens=1).ttft_s for _ in range(3))
        print(f"recompute: TTFT {1e3 * recompute:,.1f} ms", flush=True)
        for policy in ("always", "faster"):
            with TieredCache(spec, CacheConfig(**base, reuse=policy)) as reader:
                generate(model, other, reader, max_new_tokens=1)  # a prefill: teaches its rate
                generate(model, warm, reader, max_new_tokens=1)  # a load from the store: teaches its rate
                result = generate(model, prompt, reader, max_new_tokens=1)
                reuse = reader.stats().reuse
            rates = ", ".join(f"{t} {r.per_s / 1e9:.2f} GB/s + {1e3 * r.latency_s:.2f} ms"
                              for t, r in reuse.load_rates.items())
            prefill = f"{reuse.prefill_tokens_per_s:,.0f}" if reuse.prefill_tokens_per_s else "?"
            print(f"{policy}: TTFT {1e3 * result.ttft_s:,.1f} ms = {result.ttft_s / recompute:.2f}x of recompute; "
                  f"reused {result.reused_tokens:,} tokens {dict(result.sources)}; estimates: prefill "
                  f"{prefill} tokens/s, {rates}; skipped pages {reuse.skipped_pages}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
