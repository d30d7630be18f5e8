"""The `KVSpec` of a vLLM engine's KV, from plain values of its config (vLLM-free).

The model id must say which weights computed a block: blocks of a base model and of its fine-tune
must never mix (DESIGN.md §10). In order: an explicit `model_id` (extra config); for a local
checkpoint folder, a hash of its safetensors headers plus a sample of every file's bytes (reads a
few MiB, from any path the same checkpoint gets the same id); else the Hub id with a revision.
With none of these it raises and says how to pass one: never a guess.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tiered_cache.model.spec import DType, KVSpec, Layout

_SAMPLES = 16  # per file: evenly spaced windows of the weights
_WINDOW = 64 * 1024


def checkpoint_identity(folder: str | Path) -> str:
    """SHA-256 (hex, 32 chars) over each `*.safetensors` file's name, size, header and a sample
    of its bytes. Raises FileNotFoundError when the folder has no safetensors files."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files to identify the weights by")
    digest = hashlib.sha256(b"tiered-cache checkpoint identity v1")
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}|{size}|".encode())
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(header_len, size)))
            for i in range(_SAMPLES):
                f.seek(max(0, (size - _WINDOW) * i // max(1, _SAMPLES - 1)))
                digest.update(f.read(_WINDOW))
    return digest.hexdigest()[:32]


def model_id_for(model: str, revision: str | None, explicit: str | None = None) -> str:
    if explicit:
        return explicit
    if Path(model).is_dir():  # the folder's name is left out: one checkpoint, any path, one id
        return f"{_model_type(Path(model))}@weights:{checkpoint_identity(model)}"
    if revision:
        return f"{model}@{revision}"
    raise ValueError(f"cannot tell which weights {model!r} are: load it from a local folder, pass a revision "
                     "(vllm serve --revision COMMIT), or set model_id in kv_connector_extra_config")


def vllm_spec(model_id: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str,
              block_size: int) -> KVSpec:
    """One vLLM block = one page, HND layout (what vLLM's CPU cache holds per K and per V)."""
    return KVSpec(model_id=model_id, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  dtype=DType.parse(dtype), page_size=block_size, layout=Layout.HND)


def _model_type(folder: Path) -> str:
    import json

    try:
        return str(json.loads((folder / "config.json").read_text()).get("model_type") or "model")
    except (OSError, ValueError):
        return "model"
