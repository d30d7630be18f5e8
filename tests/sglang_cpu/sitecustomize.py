"""Test-only patches that let SGLang's HiCache run on a CPU-only machine (every SGLang process of the
engine tests has this folder on PYTHONPATH, so each applies them as it imports SGLang):

- host pools are never pinned: pinning needs `cudaHostRegister`, which a CPU torch does not have;
- the `direct` io backend's KV copy between the device pool and the host pool (`transfer_kv_direct`,
  from `sgl-kernel`'s CUDA build) as plain torch.

tiered-cache's backend uses none of this: it reads and writes the host pool SGLang hands it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch


def transfer_kv_direct(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """Token rows `src_indices` of each source layer buffer into rows `dst_indices` of its pair."""
    src, dst = src_indices.long().cpu(), dst_indices.long().cpu()
    for source, target in zip(src_layers, dst_layers, strict=True):
        target[dst] = source[src].to(target.dtype)


def _unpinned_host_pools(module: Any) -> None:
    original = module.HostKVCache.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        original(self, *args, **kwargs)

    module.HostKVCache.__init__ = init


def _direct_copy(module: Any) -> None:
    module.transfer_kv_direct = transfer_kv_direct


_PATCHES: dict[str, Callable[[Any], None]] = {
    "sglang.srt.mem_cache.pool_host.base": _unpinned_host_pools,
    "sglang.srt.mem_cache.pool_host.mha": _direct_copy,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load, patch = spec.loader.exec_module, _PATCHES[name]

        def exec_module(module: Any) -> None:
            load(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
