"""The one compiled part: tiered_cache/wire/_checked_copy.c (x86-64; optional: without a C
compiler the package installs and falls back to numpy, tiered_cache/wire/checked_copy.py).
TIERED_CACHE_PURE=1 builds a pure-Python wheel (`make wheel`, which every `ray up` node installs)."""

import os
import platform

from setuptools import Extension, setup

native = []
if platform.machine().lower() in ("x86_64", "amd64") and os.environ.get("TIERED_CACHE_PURE") != "1":
    native.append(Extension("tiered_cache.wire._checked_copy", ["tiered_cache/wire/_checked_copy.c"],
                            extra_compile_args=["-O2"], optional=True))

setup(ext_modules=native)
