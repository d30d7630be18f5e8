"""Test-only stub of torchvision: SGLang imports it while loading configs, and PyPI's torchvision is
a CUDA build that fails beside the CPU torch. Text models never call it: anything used raises."""

from __future__ import annotations

import enum
from typing import Any

__version__ = "0.0.0+stub"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BOX = "box"
    HAMMING = "hamming"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


class _Unavailable:
    """What a vision model would call: present for imports, an error when used."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchvision is a stub in the SGLang CPU tests (text models only)")


def unavailable(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable


def __getattr__(name: str) -> Any:
    return unavailable(name)
