"""Part of the torchvision stub (torchvision/__init__.py)."""

from typing import Any

from torchvision import InterpolationMode, unavailable  # noqa: F401


def __getattr__(name: str) -> Any:
    return unavailable(name)
