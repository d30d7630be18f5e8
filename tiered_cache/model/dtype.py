"""`DType`: the element type of stored KV, with the names configs and fingerprints use."""

from __future__ import annotations

import enum
from typing import Any


class DType(enum.Enum):
    """Element type of stored KV. The value is the canonical name used in configs and fingerprints."""

    FP16 = "float16"
    BF16 = "bfloat16"
    FP32 = "float32"
    FP8_E4M3 = "float8_e4m3fn"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def torch(self) -> Any:
        """The matching `torch.dtype` (imports torch on first use)."""
        import torch

        return getattr(torch, self.value)

    @classmethod
    def parse(cls, name: Any) -> DType:
        """Accept a DType, a torch.dtype, or a name such as 'fp16', 'float16', 'bf16', 'torch.bfloat16'."""
        if isinstance(name, DType):
            return name
        text = str(name).lower().removeprefix("torch.")
        found = _ALIASES.get(text)
        if found is None:
            known = ", ".join(sorted(_ALIASES))
            raise ValueError(f"unknown KV dtype {name!r}; expected one of: {known}")
        return found


_ITEMSIZE = {DType.FP16: 2, DType.BF16: 2, DType.FP32: 4, DType.FP8_E4M3: 1}
_ALIASES = {
    "float16": DType.FP16, "fp16": DType.FP16, "half": DType.FP16,
    "bfloat16": DType.BF16, "bf16": DType.BF16,
    "float32": DType.FP32, "fp32": DType.FP32, "float": DType.FP32,
    "float8_e4m3fn": DType.FP8_E4M3, "fp8": DType.FP8_E4M3, "fp8_e4m3": DType.FP8_E4M3,
}
