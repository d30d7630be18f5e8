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
        "import tiered_cache, tiered_cache.index.radix, tiered_cache.index.keys, tiered_cache.model.sizing\n"
        "import tiered_cache.workers, tiered_cache.workers.config, tiered_cache.workers.routing\n"
        "import tiered_cache.workers.routing.event_policy, tiered_cache.workers.routing.event_index\n"
        "import tiered_cache.workers.routing.ttft_estimate, tiered_cache.workers.routing.prefix_tree\n"
        "import tiered_cache.workers.routing.token_chain, tiered_cache.workers.serve_llm.settings\n"
        "import tiered_cache.cli.main as m\n"
        "assert m.main(['size', '--model', 'smollm2-135m', '--json']) == 0\n"
        "from tiered_cache import RadixTree, PageKeyer, KVSpec, preset_spec\n"
        "t = RadixTree(); k = PageKeyer(preset_spec('llama-2-7b'))\n"
        "t.insert(k.keys(list(range(64))), range(4)); assert t.match_prefix(k.keys(list(range(64)))).num_pages == 4\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert '"bytes_per_token": 23040' in result.stdout


def test_store_server_never_imports_torch(tmp_path):
    """The store server imports, stores on RAM and disk and serves over gRPC with torch blocked."""
    code = BLOCK_HEAVY.replace("'grpc', 'redis'", "'numba'") + f"""
import numpy as np
import tiered_cache.cli.main, tiered_cache.cli.serve_cmd
from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.client.store_client import StoreClient
from tiered_cache.server.config import ServerConfig
from tiered_cache.server.store_server import StoreServer, build_store
from tiered_cache.server.store import BlobStore
from tiered_cache.wire.codec import encode_page
from tiered_cache.tiers.disk import DiskTier
from tiered_cache.tiers.ram import RamTier, entry_cost

spec = KVSpec('no-torch', 2, 2, 16, page_size=4)
keys = PageKeyer(spec).keys(list(range(6 * spec.page_size)))
pages = np.random.default_rng(0).integers(0, 256, size=(6, spec.bytes_per_page), dtype=np.uint8)
items = [(k, encode_page(p, spec, k)) for k, p in zip(keys, pages)]
size = entry_cost(items[0][1])
store = BlobStore(RamTier(2 * size), [DiskTier({str(tmp_path / 'a')!r}, 100 * size)])
assert store.put(items) == (6, 0)
assert store.locate(keys) == ['disk'] * 4 + ['ram'] * 2
assert store.flush() == 2 and store.locate(keys) == ['disk'] * 4 + ['ram'] * 2
assert store.get(keys) == [b for _, b in items] and [s.name for s in store.stats()] == ['ram', 'disk']
server = StoreServer(ServerConfig(port=0, disk_path={str(tmp_path / 'b')!r}))
with StoreClient(f'127.0.0.1:{{server.start()}}') as client:
    assert client.put(items).stored == 6 and client.lookup(keys).leading == 6
    assert [(g.key, g.blob) for g in client.get(keys)] == items
assert server.stop() == 6
assert isinstance(build_store(ServerConfig(disk_path=None)), BlobStore)
assert 'torch' not in sys.modules
print('ok')
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


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
    assert "tiered_cache/index/radix.py" in names and "tiered_cache/workers/__init__.py" in names
    assert "tiered_cache/data/document.txt" in names
    # Every Python package folder of the checkout is in the wheel (the package list is explicit).
    for init in (REPO / "tiered_cache").rglob("__init__.py"):
        assert init.relative_to(REPO).as_posix() in names
    # workers/ ships as tiered_cache.workers, every module of it; no top-level `workers` (a PyPI name).
    for module in (REPO / "workers").glob("*.py"):
        assert f"tiered_cache/workers/{module.name}" in names
    assert not any(n.startswith("workers/") for n in names)
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["tiered_cache"]
    assert not any(n.startswith("tests/") for n in names)


def test_no_top_level_workers_module_is_installed(tmp_path):
    """The Ray layer (the folder workers/) imports as `tiered_cache.workers`; the installed package
    claims no top-level `workers` (PyPI has a project of that name). Run outside the checkout, so
    the folder itself is not on sys.path."""
    code = ("import importlib.util, tiered_cache.workers.config\n"
            "spec = importlib.util.find_spec('workers')\n"
            "print(spec.origin if spec else None)\n"
            "print(tiered_cache.workers.config.__file__)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    found, config = result.stdout.split()
    assert found == "None" or not found.startswith(str(REPO)), f"a top-level `workers` from the checkout: {found}"
    assert config == str(REPO / "workers" / "config.py") or "site-packages" in config
    # From the checkout's root the folder is on sys.path: it refuses the name instead of loading twice.
    result = subprocess.run([sys.executable, "-c", "import workers"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 1 and "imported as tiered_cache.workers" in result.stderr, result.stderr
