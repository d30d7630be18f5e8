"""Who a loaded model is, from its weights: the root of its page keys when no `model_id` is given.

Two models of equal geometry but different weights (a base and its fine-tune) must never share
a page (DESIGN.md §10), and one checkpoint loaded twice, from any folder, must share all of them.
So the identity hashes what the model computes with, never where it was loaded from.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch

__all__ = ["SAMPLE_ELEMENTS", "derived_model_id", "weights_identity"]

SAMPLE_ELEMENTS = 4096  # per tensor; smaller tensors are hashed whole
_RUN = 16  # sampled elements lie in runs this long: one cache line of fp32, so sampling stays cheap
_VERSION = b"tiered-cache weights identity v1"
# Config fields that change K and V without changing any weight.
_KV_CONFIG_FIELDS = ("model_type", "hidden_act", "rms_norm_eps", "layer_norm_eps", "rope_theta",
                     "rope_scaling", "rope_parameters", "partial_rotary_factor", "max_position_embeddings",
                     "sliding_window")
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_identity(model: Any) -> str:
    """SHA-256 (hex) over a torch model's state dict and the config fields that shape its KV.

    Per tensor, in sorted name order: name, dtype, shape, and the bytes of a fixed sample: the
    whole tensor up to `SAMPLE_ELEMENTS` elements; else `SAMPLE_ELEMENTS` elements in evenly
    spaced runs, the last run, and the first element of every row (so one retrained embedding
    row is seen). Reads no path, file or Hub id, and gives the same digest on any device and in
    any process. A dense change (any fine-tune, a merged LoRA, another weight dtype) changes it;
    a change confined to unsampled elements of one large tensor does not: that is the price of
    reading a fixed sample per tensor rather than every byte of the model. Pass an explicit
    `model_id` where that matters. Raises ValueError if a tensor has no data (meta device).
    """
    digest = hashlib.sha256(_VERSION)
    config = getattr(model, "config", None)
    fields = {k: getattr(config, k) for k in _KV_CONFIG_FIELDS if getattr(config, k, None) is not None}
    digest.update(json.dumps(fields, sort_keys=True, default=str).encode())
    state = model.state_dict()
    for name in sorted(state):
        tensor = state[name].detach()
        if tensor.is_meta:
            raise ValueError(f"cannot hash the weights of {name!r}: it is on the meta device "
                             "(not loaded); pass model_id=... instead")
        header = f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode()
        digest.update(len(header).to_bytes(4, "little") + header)
        digest.update(_sample_bytes(tensor))
    return digest.hexdigest()


def derived_model_id(model: Any) -> str:
    """A readable model id from the weights: `"<model_type>@weights:<32 hex of weights_identity>"`.

    The Hub id and revision are left out on purpose: the same weights from the Hub or from a
    local copy then share pages, and a local path never splits them.
    """
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None) or type(model).__name__
    return f"{kind}@weights:{weights_identity(model)[:32]}"


def _sample_bytes(tensor: torch.Tensor) -> bytes:
    # An integer view of the same width keeps the bytes exact and lets numpy hold bf16 or fp8.
    width = tensor.element_size()
    ints = tensor.view(_INT_OF_SIZE[width]) if width in _INT_OF_SIZE else tensor.contiguous().view(torch.uint8)
    on_cpu = ints.device.type == "cpu"
    data = ints.numpy() if on_cpu else ints  # numpy: far less overhead per slice than torch
    flat = data.reshape(-1)
    if len(flat) <= SAMPLE_ELEMENTS:
        parts = [flat]
    else:
        runs = SAMPLE_ELEMENTS // _RUN
        step = len(flat) // runs
        parts = [flat[:step * runs].reshape(runs, step)[:, :_RUN].reshape(-1), flat[-_RUN:]]
        if data.ndim >= 2:
            parts.append(data.reshape(data.shape[0], -1)[:, 0])
    if on_cpu:
        return b"".join(np.ascontiguousarray(part).tobytes() for part in parts)
    return torch.cat(parts).cpu().numpy().tobytes()
