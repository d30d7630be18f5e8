"""`tiered-cache size`: KV bytes per token and request, GPU capacity, and what paging saves."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tiered_cache.model.units import format_binary, format_bytes, parse_size
from tiered_cache.report.table import render_table


def add_parser(commands: Any) -> None:
    p = commands.add_parser("size", help="KV cache size and capacity calculator",
                            description="KV cache size and capacity calculator. Exact bytes, binary units.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default="llama-3.1-8b", help="preset name (see --list); default llama-3.1-8b")
    source.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json or model folder")
    p.add_argument("--list", action="store_true", help="list the model presets and exit")
    p.add_argument("--context", type=int, help="tokens per request (default: the model's max context)")
    p.add_argument("--dtype", help="KV dtype: fp16, bf16, fp32, fp8 (default: fp16 for presets)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, e.g. 80GiB (default)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs sharing weights and KV (default 1)")
    p.add_argument("--utilisation", type=float, default=0.9,
                   help="share of GPU memory for weights + KV (default 0.9)")
    p.add_argument("--weights", help="weight bytes, e.g. 16GiB (default: parameters × checkpoint dtype)")
    p.add_argument("--mix", help="request lengths and shares, e.g. 512:50%%,2048:30%%,8192:20%%")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run)


def _list_presets() -> int:
    from tiered_cache.model.presets import get_preset, preset_names

    rows = []
    for name in preset_names():
        preset = get_preset(name)
        s = preset.spec
        rows.append([name, preset.config.model_id, s.num_layers, s.num_kv_heads, s.head_dim,
                     f"{preset.num_params / 1e9:.2f} B", format_binary(s.bytes_per_token)])
    print(render_table(rows, ["preset", "model id", "layers", "kv heads", "head dim", "params", "KV/token"],
                       align_right=(2, 3, 4, 5, 6)))
    return 0


def run(args: argparse.Namespace) -> int:
    from tiered_cache.model.hf_config import read_hf_config, sizing_spec
    from tiered_cache.model.presets import get_preset
    from tiered_cache.model.sizing import RequestMix, size_report
    from tiered_cache.model.spec import DType

    if args.list:
        return _list_presets()
    if args.hf_config:
        config = read_hf_config(args.hf_config)
        # Only sizes: this spec never keys a page, so it needs no identity of the weights.
        spec = sizing_spec(config, dtype=args.dtype, page_size=args.page_size)
        label = config.model_id
    else:
        preset = get_preset(args.model)
        config = preset.config
        spec = preset.spec.with_options(page_size=args.page_size,
                                        **({"dtype": DType.parse(args.dtype)} if args.dtype else {}))
        label = f"{config.model_id} ({preset.name})"
    if args.context is not None and args.context <= 0:
        raise ValueError(f"--context must be a positive number of tokens, got {args.context} (leave it out for the "
                         f"model's maximum)")
    gpu_memory = parse_size(args.gpu_memory)
    if gpu_memory < 2**20:
        raise ValueError(f"--gpu-memory {args.gpu_memory} is {gpu_memory} bytes: give a unit, e.g. 80GiB")
    context = args.context or config.max_context or 4096
    weights = parse_size(args.weights) if args.weights else config.num_params * config.dtype.itemsize
    report = size_report(spec, context=context, weight_bytes=weights, gpu_memory=gpu_memory,
                         num_gpus=args.gpus, memory_utilisation=args.utilisation,
                         mix=RequestMix.parse(args.mix) if args.mix else None, model=label)
    if config.max_context and context > config.max_context:
        report.notes.append(f"--context {context:,} is past the model's max_position_embeddings "
                            f"({config.max_context:,}): it was not trained for requests this long")
    if config.mla_latent:
        report.notes.append(f"MLA: one compressed latent of {config.mla_latent} values per token and layer "
                            f"(kv_lora_rank + qk_rope_head_dim), stored once, not a K and a V per head")
    if not config.weights_estimated and not args.weights:
        report.notes.append("weights are estimated from a dense/Mixtral layout, which this model does not have: "
                            "pass --weights for the capacity figures")
    if args.json:
        out = report.to_dict()
        out["num_params"] = config.num_params
        print(json.dumps(out, indent=2))
        return 0
    print(_render(report, spec, config.num_params, args.weights is not None, config.dtype.value,
                  getattr(config, "mla_latent", None)))
    return 0


def _render(r: Any, spec: Any, num_params: int, weights_given: bool, weight_dtype: str,
            mla_latent: int | None = None) -> str:
    heads = (f"MLA latent of {mla_latent} values" if mla_latent
             else f"{spec.num_kv_heads} KV heads × {spec.head_dim} head dim")
    geometry = f"{spec.num_layers} layers × {heads}, {spec.dtype.value}, {spec.page_size}-token pages"
    weight_label = "weights (given)" if weights_given else f"weights ({num_params / 1e9:.2f} B params, {weight_dtype})"
    gpus = f"{r.num_gpus} × {format_binary(r.gpu_memory)}"
    sections = [
        f"Model: {r.model}\nKV geometry: {geometry}",
        render_table([
            ["KV per token", format_bytes(r.bytes_per_token)],
            [f"KV per page ({spec.page_size} tokens)", format_bytes(r.bytes_per_page)],
            [f"KV per request ({r.context:,} tokens)", format_bytes(r.bytes_per_request)],
            ["pages per request", f"{r.pages_per_request:,}"],
        ], ["KV size", ""]),
        render_table([
            [f"usable memory ({gpus} at {r.memory_utilisation:.0%})", format_bytes(r.usable_memory)],
            [weight_label, format_bytes(r.weight_bytes)],
            ["left for KV", format_bytes(r.kv_budget)],
            ["tokens that fit", f"{r.tokens_fit:,}"],
            ["pages that fit", f"{r.pages_fit:,}"],
            [f"concurrent {r.context:,}-token requests", f"{r.requests_fit:,}"],
        ], [f"Capacity on {gpus}", ""]),
        render_table([
            ["request mix (tokens:share)", r.mix],
            ["mean request", f"{r.mean_request_tokens:,.0f} tokens"],
            ["max-length pre-allocation per request", format_bytes(r.prealloc_bytes_per_request)],
            ["paged, mean per request", format_bytes(round(r.paged_bytes_per_request))],
            ["unused slots in last pages, mean", f"{r.paged_waste_tokens_per_request:,.1f} tokens"],
            ["memory saved by paging", f"{r.paging_saving:.1%}"],
            ["concurrent requests, pre-allocated", f"{r.prealloc_concurrency:,}"],
            ["concurrent requests, paged", f"{r.paged_concurrency:,}"],
        ], ["Paging vs max-length pre-allocation", ""]),
    ]
    sections += [f"note: {n}" for n in r.notes]
    return "\n\n".join(sections)
