"""Finding the CUDA sources of `kernels/`, in a source checkout or inside an installed wheel."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def kernel_dir() -> Path:
    """The folder holding the `.cu` files. Raises FileNotFoundError if the install lacks it."""
    try:
        packaged = Path(str(resources.files("tiered_cache._kernels")))
        if packaged.is_dir():
            return packaged
    except ModuleNotFoundError:
        pass
    checkout = Path(__file__).resolve().parents[2] / "kernels"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError("CUDA kernel sources not found: reinstall tiered-cache (kernels/ is package data)")


def kernel_source(name: str) -> str:
    """Text of `kernels/<name>.cu`."""
    path = kernel_dir() / f"{name}.cu"
    if not path.is_file():
        available = sorted(p.stem for p in kernel_dir().glob("*.cu"))
        raise FileNotFoundError(f"no kernel {name!r} in {kernel_dir()}; available: {available}")
    return path.read_text()
