import subprocess
import sys
import zipfile

import pytest
from conftest import REPO

BLOCK_HEAVY = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in {'torch', 'ray', 'cupy', 'transformers', 'grpc', 'redis'}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
"""


def test_core_imports_without_torch_ray_cupy_or_transformers():
    code = BLOCK_HEAVY + (
        "import tiered_cache, tiered_cache.index.radix, tiered_cache.index.keys, tiered_cache.model.sizing, workers\n"
        "import tiered_cache.cli.main as m\n"
        "assert m.main(['size', '--model', 'smollm2-135m', '--json']) == 0\n"
        "from tiered_cache import RadixTree, PageKeyer, KVSpec, preset_spec\n"
        "t = RadixTree(); k = PageKeyer(preset_spec('llama-2-7b'))\n"
        "t.insert(k.keys(list(range(64))), range(4)); assert t.match_prefix(k.keys(list(range(64)))).num_pages == 4\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert '"bytes_per_token": 23040' in result.stdout


def test_kernel_sources_are_found_in_a_checkout():
    from tiered_cache.device.kernel_source import kernel_dir, kernel_source

    assert (kernel_dir() / "README.md").is_file()
    with pytest.raises(FileNotFoundError, match="no kernel 'nope'"):
        kernel_source("nope")


@pytest.mark.slow
def test_wheel_ships_packages_and_kernel_sources(tmp_path):
    pytest.importorskip("setuptools")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "-q", "-w", str(tmp_path), str(REPO)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    wheel = next(tmp_path.glob("tiered_cache-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "tiered_cache/_kernels/README.md" in names
    assert "tiered_cache/index/radix.py" in names and "workers/__init__.py" in names
    assert "tiered_cache/data/document.txt" in names
    # Every Python package folder of the checkout is in the wheel (the package list is explicit).
    for init in (REPO / "tiered_cache").rglob("__init__.py"):
        assert init.relative_to(REPO).as_posix() in names
    assert not any(n.startswith("tests/") for n in names)
