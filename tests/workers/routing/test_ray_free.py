"""Routing is Ray-free, so a Ray Serve request router can use it as well as our router actor: every
module of `tiered_cache.workers.routing`, imported in a fresh process, leaves Ray unimported."""

import subprocess
import sys

from conftest import REPO

IMPORT_EVERY_ROUTING_MODULE = """
import importlib, pkgutil, sys
import tiered_cache.workers.routing as routing
names = [m.name for m in pkgutil.iter_modules(routing.__path__, routing.__name__ + '.')]
for name in names:
    importlib.import_module(name)
assert len(names) >= 6, names  # the package was walked, not found empty
assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.split('.')[0] == 'ray')
print(len(names))
"""


def test_every_routing_module_imports_without_ray():
    result = subprocess.run([sys.executable, "-c", IMPORT_EVERY_ROUTING_MODULE], capture_output=True, text=True,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 6
