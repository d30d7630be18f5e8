"""`tiered-cache bench ttft`: time to first token on SmolLM2-135M for prefixes of 512 to 4,096
tokens, recomputed vs loaded from each tier, in one run; and a labelled projection of the
speed-up for a large model from KVSpec sizes and the tier bandwidths measured here."""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.integrations.transformers import generate, spec_for

TIERS = ("device", "host", "disk", "remote")
# Projection assumptions (not measured here): H100 SXM dense bf16 peak and a typical prefill MFU.
H100_BF16_FLOPS = 989e12
PREFILL_MFU = 0.4


@dataclass(frozen=True)
class TtftRow:
    prefix_tokens: int
    recompute_s: float
    tier_s: dict[str, float]
    kv_bytes: int

    def speedup(self, tier: str) -> float:
        return self.recompute_s / self.tier_s[tier]


def _cache(tier: str, spec: Any, folder: Path, store: str) -> TieredCache:
    lower: dict[str, Any] = {"disk": {"lower_tiers": ["disk"], "disk_path": str(folder / "disk")},
                             "remote": {"lower_tiers": ["remote"], "remote_addresses": [store]}}.get(tier, {})
    return TieredCache(spec, CacheConfig(pool_capacity="512MiB", host_capacity="512MiB", write_policy="write_through",
                                         **lower))


def measure(lengths: tuple[int, ...] = (512, 1024, 2048, 4096), repeat: int = 3) -> list[TtftRow]:
    from tiered_cache.integrations.document import document
    from tiered_cache.integrations.smollm2 import load_model
    from tiered_cache.server.process import StoreProcess

    model, tokenizer = load_model()
    spec = spec_for(model, "fp16", model_id="smollm2-ttft")
    text_ids = tokenizer(document()).input_ids
    question = tokenizer("\nQ: When was the light automated?\nA:").input_ids
    # Shorter than a page, so a prompt's only full pages are its prefix: every run reuses exactly it.
    assert len(question) < spec.page_size, len(question)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, StoreProcess(["--no-disk", "--ram", "1GiB"]) as store:
        for length in lengths:
            prefix = (text_ids * (length // len(text_ids) + 1))[:length]
            prompt = prefix + question
            print(f"prefix of {length:,} tokens: recompute ...", file=sys.stderr, flush=True)
            recompute = min(generate(model, prompt, None, 1).ttft_s for _ in range(repeat))
            times = {}
            for tier in TIERS:
                writer = _cache(tier, spec, Path(tmp) / f"{tier}-{length}", store.address)
                generate(model, prefix, writer, 1)  # cache the prefix
                writer.flush()  # write-through copies run in the background
                reader = _cache(tier, spec, Path(tmp) / f"{tier}-{length}", store.address) if tier == "remote" \
                    else writer
                best = float("inf")
                for _ in range(repeat):
                    reader.flush()
                    if tier != "device":
                        reader.evict()
                    if tier in ("disk", "remote"):
                        reader.host.delete(list(reader.host.index))
                    result = generate(model, prompt, reader, 1)
                    assert result.reused_tokens == length and tier in result.sources, (tier, result.sources)
                    best = min(best, result.ttft_s)
                times[tier] = best
                print(f"  {tier}: {best * 1e3:,.0f} ms", file=sys.stderr, flush=True)
            rows.append(TtftRow(length, recompute, times, spec.bytes_for_tokens(length)))
    return rows


def projection(rows: list[TtftRow], model: str = "llama-3-70b",
               extra_lengths: tuple[int, ...] = (16384, 32768)) -> list[dict[str, Any]]:
    """Projected TTFT speed-up for `model`: prefill FLOPs at an assumed H100 rate vs moving its KV
    at the rate each tier reached here, end to end through this CPU pipeline: prefix bytes over
    (TTFT from the tier - TTFT from the device pool) for the longest measured prefix. Longer
    prefixes reuse that rate (prefill grows faster than linearly; moving KV does not)."""
    from tiered_cache.model.presets import get_preset

    preset = get_preset(model)
    cfg = preset.config
    longest = max(rows, key=lambda r: r.prefix_tokens)
    # A tier within 5% of the device row is within run-to-run noise: no rate can be derived.
    device = longest.tier_s["device"]
    rates = {t: (longest.kv_bytes / (longest.tier_s[t] - device) if longest.tier_s[t] - device > 0.05 * device
                 else None) for t in TIERS[1:]}
    out = []
    for n in sorted({r.prefix_tokens for r in rows} | set(extra_lengths)):
        flops = 2 * preset.num_params * n + 2 * cfg.num_layers * n * n * cfg.num_attention_heads * cfg.head_dim
        recompute = flops / (H100_BF16_FLOPS * PREFILL_MFU)
        kv = preset.spec.bytes_for_tokens(n)
        entry = {"model": model, "prefix_tokens": n, "kv_bytes": kv, "projected_recompute_s": recompute}
        for tier in TIERS[1:]:
            rate = rates[tier]
            entry[f"{tier}_GBps"] = None if rate is None else rate / 1e9
            entry[f"{tier}_projected_speedup"] = None if rate is None else recompute / (kv / rate)
        out.append(entry)
    return out


def _projected(entry: dict[str, Any], tier: str) -> str:
    if entry[f"{tier}_GBps"] is None:
        return "n/a: within noise of device"
    return f"{entry[f'{tier}_GBps']:.2f} GB/s -> {entry[f'{tier}_projected_speedup']:.1f}x"


def render(rows: list[TtftRow], projected: list[dict[str, Any]]) -> str:
    from tiered_cache.model.units import format_binary
    from tiered_cache.report.table import render_table

    measured = render_table(
        [[f"{r.prefix_tokens:,}", format_binary(r.kv_bytes), f"{r.recompute_s * 1e3:,.0f} ms",
          *[f"{r.tier_s[t] * 1e3:,.0f} ms ({r.speedup(t):.1f}x)" for t in TIERS]] for r in rows],
        ["prefix", "KV", "recompute", *[f"from {t}" for t in TIERS]], align_right=range(0, 7))
    proj = render_table(
        [[f"{p['prefix_tokens']:,}", format_binary(p["kv_bytes"]), f"{p['projected_recompute_s'] * 1e3:,.0f} ms",
          *[_projected(p, t) for t in TIERS[1:]]]
         for p in projected],
        ["prefix", "KV (70B)", "prefill (assumed)", *[f"{t}: measured rate -> speed-up" for t in TIERS[1:]]],
        align_right=range(0, 6))
    return (f"Measured on SmolLM2-135M (fp32 compute, fp16 KV), TTFT best of runs, speed-up vs recompute:\n"
            f"{measured}\n\nPROJECTION (not measured): Llama-3-70B on one H100 at {PREFILL_MFU:.0%} MFU of "
            f"{H100_BF16_FLOPS / 1e12:.0f} TFLOP/s for prefill; KV moved at the marginal rate each tier reached above "
            f"(bytes / (TTFT from tier - TTFT from device) at the longest prefix):\n"
            f"{proj}")


def rows_as_dicts(rows: list[TtftRow]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
