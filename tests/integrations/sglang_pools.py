"""Real SGLang host KV pools (the ones HiCache hands a storage backend), small, on the CPU. Importing
this puts the stand-ins SGLang's CPU engine needs (`tests/sglang_cpu/`, README "Use with SGLang")
on the path, so import it before SGLang."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

STANDINS = Path(__file__).resolve().parents[1] / "sglang_cpu"
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang takes its CPU paths only with this
if str(STANDINS) not in sys.path:
    sys.path.insert(0, str(STANDINS))

PAGE = 4  # tokens per page
LAYERS, HEADS, HEAD_DIM = 3, 2, 8


def host_pool(layout: str = "layer_first", heads: int = HEADS, dtype: torch.dtype = torch.float16) -> Any:
    """An MHA host pool of SGLang's own, beside a device pool of 64 tokens, every byte random."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(64, PAGE, dtype, heads, HEAD_DIM, LAYERS, "cpu", False, start_layer=0,
                              end_layer=LAYERS)
    pool = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout, pin_memory=False,
                                device="cpu", device_capacity_tokens=device.size, start_layer=0, end_layer=LAYERS,
                                write_back_staging=device.hicache_write_back_staging)
    pool.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 256, pool.kv_buffer.view(torch.uint8).shape,
                                                         dtype=torch.uint8))
    return pool


def mla_pool(layout: str = "layer_first", dtype: torch.dtype = torch.bfloat16) -> Any:
    """An MLA host pool of SGLang's own (one latent per token and layer, shared by every TP rank)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device = MLATokenToKVPool(64, PAGE, dtype, 16, 8, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
    pool = MLATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout, pin_memory=False,
                                device="cpu", device_capacity_tokens=device.size, start_layer=0, end_layer=LAYERS,
                                target_layer_num=LAYERS)
    pool.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 256, pool.kv_buffer.view(torch.uint8).shape,
                                                         dtype=torch.uint8))
    return pool


def slots(pages: list[int]) -> torch.Tensor:
    """The token slots of these host pages, as SGLang passes `host_indices`."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to(torch.int64)


def page_bytes(pool: Any, page: int) -> bytes:
    return pool.get_data_page(page * PAGE, flat=True).view(torch.uint8).numpy().tobytes()
