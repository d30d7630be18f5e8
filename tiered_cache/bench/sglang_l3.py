"""The L3 read alone, as SGLang's prefetch thread makes it (`bench sglang`'s second table): prefixes a
reader never read, from L3 into SGLang's host pool (SmolLM2-135M's geometry, layer-first), through
our backend (v1: each page checked straight into the pool) and through SGLang's `file` backend
(its generic path: each page read into a flat page, then copied into the pool, as SGLang's cache
controller does for it), each after the `batch_exists` SGLang asks first, beside a memcpy of the
same bytes inside the pool. The file backend's files were just written: the OS page cache holds
them, its best case.

Runs in `.venv-sglang` (`python -m tiered_cache.bench.sglang_l3 STORE_ADDRESS FOLDER`), prints JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch

PAGE, LAYERS, HEADS, HEAD_DIM = 16, 30, 3, 64


def _pool(tokens: int) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(tokens, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False, start_layer=0,
                              end_layer=LAYERS)
    pool = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, "layer_first",
                                pin_memory=False, device="cpu", device_capacity_tokens=device.size, start_layer=0,
                                end_layer=LAYERS, write_back_staging=device.hicache_write_back_staging)
    pool.kv_buffer.view(torch.int16).copy_(torch.randint(-2**15, 2**15 - 1, pool.kv_buffer.shape, dtype=torch.int16))
    return pool


def _config(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name="smollm2-shape", extra_config=extra)


def measure(address: str, folder: str, prefixes: int = 8, pages: int = 18) -> dict[str, Any]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    from tiered_cache.integrations.sglang.backend import TieredCacheStorage

    pool = _pool(prefixes * pages * PAGE * 2)
    ours = TieredCacheStorage(_config({"remote_addresses": address, "model_id": "smollm2-135m-shape"}), {})
    ours.register_mem_pool_host(pool)
    file = HiCacheFile(_config({"file_storage_path": folder}))
    span = pages * PAGE
    src = lambda p: torch.arange(p * span, (p + 1) * span)  # noqa: E731  prefix p's pages, written from here
    dst = lambda p: torch.arange((prefixes + p) * span, (prefixes + p + 1) * span)  # noqa: E731  read into here
    keys = [[f"prefix{p}-page{i}" for i in range(pages)] for p in range(prefixes)]
    for p in range(prefixes):
        assert all(ours.batch_set_v1(keys[p], src(p)))
        assert file.batch_set(keys[p], [pool.get_data_page(int(i), flat=True) for i in src(p)[::PAGE]])
    times: dict[str, list[float]] = {"tiered-cache (v1)": [], "SGLang file backend": [], "memcpy in the pool": []}
    for p in range(prefixes):  # every prefix once: a reader that never read it
        start = time.perf_counter()  # as SGLang's prefetch: how many are there, then read them
        assert ours.batch_exists(keys[p]) == pages and all(ours.batch_get_v1(keys[p], dst(p)))
        times["tiered-cache (v1)"].append(time.perf_counter() - start)
        start = time.perf_counter()
        assert file.batch_exists(keys[p]) == pages
        flat = file.batch_get(keys[p], [pool.get_dummy_flat_data_page() for _ in range(pages)])
        for i, page in zip(dst(p)[::PAGE].tolist(), flat, strict=True):
            pool.set_from_flat_data_page(i, page)
        times["SGLang file backend"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for i, j in zip(src(p)[::PAGE].tolist(), dst(p)[::PAGE].tolist(), strict=True):
            pool.get_data_page(j, flat=False).copy_(pool.get_data_page(i, flat=False))
        times["memcpy in the pool"].append(time.perf_counter() - start)
        bits = pool.kv_buffer.view(torch.int16)  # random bits hold NaNs: compare bits, not values
        if not torch.equal(bits[:, :, dst(p)], bits[:, :, src(p)]):
            raise AssertionError(f"prefix {p} read back wrong")
    nbytes = pages * 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2
    ours.close()
    return {"prefix_bytes": nbytes, "pages": pages, "prefixes": prefixes,
            "median_s": {way: statistics.median(t) for way, t in times.items()}}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2])))
