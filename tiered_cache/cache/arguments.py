"""Checks of the arguments the cache's public calls share."""

from __future__ import annotations

from typing import Any

import numpy as np


def as_count(name: str, value: Any, least: int = 0) -> int:
    """`value` as an int of at least `least`, or ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        kind = "a positive" if least > 0 else "a non-negative"
        raise ValueError(f"{name} must be {kind} integer, got {value!r}")
    return int(value)


def as_namespace(value: Any) -> str:
    """`value` as a namespace, or TypeError naming its type."""
    if not isinstance(value, str):
        raise TypeError(f"namespace must be a str, got {type(value).__name__}")
    return value
