"""README's module table ("Architecture in one screen") and the tree agree: every Python module
of the package and of `workers/` is named by a row (its file, or its folder as a whole), and every
path a row names exists. A newcomer who reads the table finds every file."""

from __future__ import annotations

import re

from conftest import REPO

GENERATED = {"tiered_cache/v1/cache_pb2.py", "tiered_cache/v1/cache_pb2_grpc.py"}


def _table_rows() -> list[str]:
    text = (REPO / "README.md").read_text()
    start = text.index("| file | job |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1])  # the first column: the paths
    return rows


def _named_paths() -> set[str]:
    """Paths named in the first column. A bare name after a path (`pool.py`, `radix_node.py`)
    lives in the folder of the path before it; a path whose first folder is not at the top of
    the repository (`tiers/chain.py`) is under `tiered_cache/`."""
    named: set[str] = set()
    for cell in _table_rows():
        folder = ""
        for token in re.findall(r"`([^`]+)`", cell):
            if "/" in token and not (REPO / token.split("/")[0]).exists():
                token = f"tiered_cache/{token}"  # `tiers/chain.py` in a row means the package's
            if "/" in token:
                folder = token.rsplit("/", 1)[0] if not token.endswith("/") else token.rstrip("/")
                named.add(token.rstrip("/"))
            else:
                named.add(f"{folder}/{token}" if folder else token)
    return named


def _modules() -> list[str]:
    found = []
    for top in ("tiered_cache", "workers"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if "__pycache__" not in rel and rel not in GENERATED and path.name != "__init__.py":
                found.append(rel)
    return found


def test_every_module_is_named_in_the_readme_table():
    named = _named_paths()

    def covered(module: str) -> bool:
        parts = module.split("/")
        return any("/".join(parts[:i]) in named for i in range(1, len(parts) + 1))

    missing = [m for m in _modules() if not covered(m)]
    assert not missing, f"README's module table names no row for: {missing}"


def test_every_path_the_table_names_exists():
    absent = sorted(p for p in _named_paths() if not (REPO / p).exists())
    assert not absent, f"README's module table names paths that do not exist: {absent}"


def test_tests_are_laid_out_like_the_package():
    """A folder of tests per folder of the package (or `workers/`, or `deploy/`'s launch files),
    plus `project/` for the repo as a whole; no test file loose in tests/."""
    package = {p.name for p in (REPO / "tiered_cache").iterdir() if (p / "__init__.py").exists()}
    folders = package | {"workers", "deploy"}
    for path in sorted((REPO / "tests").iterdir()):
        if path.is_dir() and any(path.glob("test_*.py")):
            assert path.name in folders | {"project"}, f"tests/{path.name}/ matches no folder of the package"
    loose = sorted(p.name for p in (REPO / "tests").glob("test_*.py"))
    assert not loose, f"test files loose in tests/ (move them beside their package folder's tests): {loose}"
