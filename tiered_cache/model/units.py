"""Byte sizes: parsing `4GiB`-style strings and printing exact bytes with binary units."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    # Bare single letters follow memory conventions (`--gpu-memory 80G` means GiB).
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float) -> int:
    """Bytes from an int or a string such as `4096`, `64KiB`, `1.5 GiB`, `80G` or `2GB` (decimal).

    Raises ValueError naming the bad text and the accepted units.
    """
    if isinstance(value, bool):
        raise ValueError(f"size must be a number of bytes or a string like '4GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != value:
            raise ValueError(f"size must be a non-negative number, got {value}")
        return int(value)
    match = _SIZE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read size {value!r}: expected a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB; KB, MB, GB, TB are decimal; K, M, G, T mean KiB..TiB)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_binary(num_bytes: int | float) -> str:
    """`327680` -> `320 KiB`, `10737418240` -> `10 GiB`, `1536` -> `1.5 KiB` (two decimals at most)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            text = f"{value:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_bytes(num_bytes: int) -> str:
    """Exact bytes and the binary figure: `327,680 B (320 KiB)`."""
    if abs(num_bytes) < 1024:
        return f"{num_bytes:,} B"
    return f"{num_bytes:,} B ({format_binary(num_bytes)})"
