"""vLLM's KV event schema (vllm/distributed/kv_events.py, vLLM 0.32), as msgpack a subscriber
written for vLLM decodes unchanged with its own classes: a batch is an array `[ts, events,
data_parallel_rank]` (msgspec `array_like`, trailing defaults left out), each event a map tagged
`"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"` whose required fields are always
present and whose defaulted fields appear only when set. Block hashes are bytes or ints (vLLM's
`ExternalBlockHash`); `medium` says where the block lies: GPU, CPU or STORAGE (below host RAM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
BlockHash = bytes | int


def block_stored(block_hashes: Sequence[BlockHash], parent_block_hash: BlockHash | None,
                 token_ids: Sequence[int], block_size: int, medium: str | None, **extra: Any) -> dict[str, Any]:
    """Blocks now held in `medium`, each `block_size` tokens of `token_ids`, chained from the parent.
    `extra`: vLLM's optional fields (`group_idx`, `locality`, `ownership`, ...), set ones only."""
    event = {"type": "BlockStored", "block_hashes": list(block_hashes), "parent_block_hash": parent_block_hash,
             "token_ids": list(token_ids), "block_size": block_size, "lora_id": None, "medium": medium,
             "lora_name": None}
    event.update({k: v for k, v in extra.items() if v is not None})
    return event


def block_removed(block_hashes: Sequence[BlockHash], medium: str | None, **extra: Any) -> dict[str, Any]:
    """Blocks no longer held in `medium`."""
    event = {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": medium}
    event.update({k: v for k, v in extra.items() if v is not None})
    return event


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[dict[str, Any]], data_parallel_rank: int | None = None) -> bytes:
    """One batch as vLLM's `KVEventBatch` bytes."""
    import msgpack

    batch: list[Any] = [ts, list(events)]
    if data_parallel_rank is not None:
        batch.append(data_parallel_rank)
    return msgpack.packb(batch, use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """A batch back as (ts, events, data_parallel_rank): what our own subscribers read."""
    import msgpack

    fields = msgpack.unpackb(payload, raw=False)
    if not isinstance(fields, list) or len(fields) not in (2, 3) or not isinstance(fields[1], list):
        raise ValueError(f"not a KV event batch: a {type(fields).__name__}, not [ts, events, rank]")
    return float(fields[0]), fields[1], fields[2] if len(fields) == 3 else None
