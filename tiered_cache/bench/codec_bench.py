"""`tiered-cache bench codec`: what each codec gives (ratio) and costs (MB/s) per page, on real KV
and on random data, beside the raw codec (a framed copy with a checksum) in the same run."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.wire.codec import Codec, decode_page, encode_page


@dataclass(frozen=True)
class CodecRow:
    data: str
    codec: str
    ratio: float  # page bytes / blob bytes
    encode_mb_s: float
    decode_mb_s: float
    max_rel_error: float  # max |decoded - original| / max |original|; 0 for lossless codecs


def _pages_from_kv(kv: torch.Tensor, spec: KVSpec) -> torch.Tensor:
    """(layers, 2, n, heads, dim) -> page-first (pages, layers, 2, page_size, heads, dim)."""
    n = spec.full_pages(kv.shape[2]) * spec.page_size
    paged = kv[:, :, :n].reshape(kv.shape[0], 2, -1, spec.page_size, *kv.shape[3:])
    return paged.permute(2, 0, 1, 3, 4, 5).contiguous()


def measure(pages: torch.Tensor, spec: KVSpec, label: str) -> list[CodecRow]:
    keys = PageKeyer(spec, "bench").keys(list(range(pages.shape[0] * spec.page_size)))
    total = pages.shape[0] * spec.bytes_per_page
    rows = []
    for codec in Codec:
        decode_page(encode_page(pages[0], spec, keys[0], codec, min_saving=-1.0), spec, keys[0])  # imports, warm-up
        start = time.perf_counter()
        # min_saving=-1 forces the codec even where it does not pay, to show what it gives.
        blobs = [encode_page(p, spec, k, codec, min_saving=-1.0) for p, k in zip(pages, keys, strict=True)]
        encode_s = time.perf_counter() - start
        start = time.perf_counter()
        decoded = [decode_page(b, spec, k) for b, k in zip(blobs, keys, strict=True)]
        decode_s = time.perf_counter() - start
        back = torch.stack([torch.from_numpy(d).view(spec.dtype.torch) for d in decoded]).reshape(pages.shape)
        err = ((back.float() - pages.float()).abs().max() / pages.float().abs().max()).item()
        rows.append(CodecRow(label, codec.value, total / sum(len(b) for b in blobs),
                             total / encode_s / 1e6, total / decode_s / 1e6, err))
    return rows


def _real_kv(path: str | None) -> tuple[torch.Tensor, str] | None:
    if path:
        return torch.load(path), path
    try:
        from tiered_cache.integrations.document import sample_kv
    except ImportError:
        return None
    try:
        return sample_kv(), "SmolLM2-135M KV"
    except ImportError as exc:
        print(f"real KV unavailable ({exc}); install the demo extra", file=sys.stderr)
        return None


def run_codec_bench(args: argparse.Namespace) -> int:
    from tiered_cache.model.presets import get_preset
    from tiered_cache.report.table import render_table

    spec16 = get_preset("smollm2-135m").spec
    rows: list[CodecRow] = []
    real = _real_kv(args.kv)
    if real is not None:
        kv, label = real
        print(f"real KV: {label}, {kv.shape[2]} tokens", file=sys.stderr)
        for dtype in (DType.FP16, DType.BF16):
            spec = spec16.with_options(dtype=dtype, num_layers=kv.shape[0])
            rows += measure(_pages_from_kv(kv.to(dtype.torch), spec), spec, f"real KV, {dtype.value}")
    gen = torch.Generator().manual_seed(0)
    random = torch.randn(spec16.staging_shape(64), generator=gen).half()
    rows += measure(random, spec16, "random normal, float16")
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return 0
    print(f"page: {spec16.page_size} tokens of {spec16.model_id} KV ({spec16.bytes_per_page:,} bytes in 16-bit)")
    print(render_table([[r.data, r.codec, f"{r.ratio:.3f}x", f"{r.encode_mb_s:,.0f}", f"{r.decode_mb_s:,.0f}",
                         f"{r.max_rel_error:.1e}"] for r in rows],
                       ["data", "codec", "ratio", "encode MB/s", "decode MB/s", "max rel error"],
                       align_right=(2, 3, 4, 5)))
    print("baseline: the raw codec rows (a framed copy with a CRC-32), measured in the same run")
    return 0


