"""Layer groups: a vLLM block stored as several pages, each holding a run of its layers.

So that a load can run layer by layer: the pages of the first layers of every block arrive
first, the forward pass computes those layers while the later ones are still on their way, and
`wait_for_layer_load` only waits for the group of the layer about to attend. One group (the
whole block) turns this off. vLLM-free.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

TARGET_PAGE_BYTES = 1 << 20  # ~1 MiB pages: what the store server and Redis move best (docs/PERFORMANCE.md)


def group_size(num_layers: int, bytes_per_layer: int, groups: int | str | None = None,
               kv_on_cpu: bool = False) -> int:
    """Layers per page. `groups` is the number of pages per block (it must divide the layers), or
    "auto"/None: the most layers whose page stays within ~1 MiB (at least one layer a page), or
    whole blocks when the KV lives in CPU memory (`kv_on_cpu`): there the forward runs on the same
    cores the loader would use to overlap it, and loading group by group is slower per request than
    whole blocks before the forward (docs/PERFORMANCE.md, "Under vLLM")."""
    if num_layers < 1:
        raise ValueError(f"a model needs at least one layer, got {num_layers}")
    divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
    if groups in (None, "auto"):
        if kv_on_cpu:
            return num_layers
        fitting = [d for d in divisors if d * bytes_per_layer <= TARGET_PAGE_BYTES]
        return max(fitting, default=1)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or num_layers % groups:
        choices = ", ".join(str(num_layers // d) for d in reversed(divisors))
        raise ValueError(f"layer_groups must be 'auto' or a number of groups that divides the model's "
                         f"{num_layers} layers ({choices}), got {groups!r}")
    return num_layers // groups


def group_keys(block_keys: Sequence[bytes], num_groups: int, group: int) -> list[bytes]:
    """The page keys of layer group `group` of each block. One group: the block keys themselves.
    Otherwise SHA-256 of the block key and the group's index (the block keys already depend on
    the page spec, so on the group size: other groupings never share a key)."""
    if not 0 <= group < num_groups:
        raise ValueError(f"layer group {group} out of range for {num_groups} groups")
    if num_groups == 1:
        return list(block_keys)
    tag = group.to_bytes(4, "little")
    return [hashlib.sha256(b"tiered-cache/layer-group\0" + key + tag).digest() for key in block_keys]
