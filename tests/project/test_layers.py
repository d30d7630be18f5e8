"""Imports between folders point down, never up, and form no circle (DESIGN.md §2).

Every module of `tiered_cache/` and `workers/` (imported as `tiered_cache.workers`) is parsed
(nothing is imported or run); every import counts, those inside functions too, except those under
`if TYPE_CHECKING:`. A module's
folder is its first part below `tiered_cache` (`tiered_cache.tiers.remote` -> tiers); `workers/`
is one folder; each top-level module (`config.py`, `errors.py`, `retention.py`) is a unit of its
own, in the layer its imports put it.
`tiered_cache/__init__.py` is the package facade and exempt: a name imported from it counts as
an import of the module it comes from.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO

# Bottom -> top. A folder may import folders of its own layer and of the layers before it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "retention", "model", "v1", "data"),  # data: package data (model shapes), no code
    ("index",),
    ("wire",),
    ("shm",),
    ("device",),
    ("client",),
    ("tiers",),
    ("metrics", "events"),  # events: KV events in vLLM's format, for the server and the cache to publish
    ("server",),
    ("config",),  # config.py: the cache's settings (it reads index, model, wire, tiers/base, events/endpoints)
    ("cache",),
    ("integrations",),
    ("workers",),
    ("report",),  # plain-text rendering bench/, demo/ and cli/ share
    ("bench",),
    ("demo",),
    ("cli",),
)

ROOT = REPO
PACKAGES = {"tiered_cache": "tiered_cache", "workers": "tiered_cache.workers"}  # folder -> import name
FACADE = "tiered_cache"


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES (generated stubs included)."""
    out = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = (name, *path.relative_to(ROOT / folder).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = module_files()


def folder_of(module: str) -> str:
    """The folder (layer unit) of a dotted module name of ours."""
    parts = module.split(".")
    if parts[0] != "tiered_cache":
        return parts[0]
    if len(parts) == 1:
        return FACADE
    if parts[1] == "workers":  # the top-level folder workers/, mapped under the package
        return "workers"
    if (ROOT / "tiered_cache" / parts[1]).is_dir():
        return parts[1]
    return parts[1]  # a top-level module: its own unit


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST):
    """Every node below `node`, except the bodies of `if TYPE_CHECKING:` (their `else` counts)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _walk(other)
            continue
        yield child
        yield from _walk(child)


def _facade_names() -> dict[str, str]:
    """Names `tiered_cache/__init__.py` re-exports -> the module each comes from (its lazy ones too)."""
    tree = ast.parse((ROOT / "tiered_cache" / "__init__.py").read_text())
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update({alias.asname or alias.name: node.module for alias in node.names})
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            names.update(ast.literal_eval(node.value))
    return names


FACADE_NAMES = _facade_names()


def _ours(name: str) -> str | None:
    """The longest prefix of `name` that is a module of ours, or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MODULES:
            return ".".join(parts[:end])
    return None


def imports_of(module: str, path: Path) -> set[str]:
    """The modules of ours that `module` imports (resolved to modules, not names)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(filter(None, (_ours(alias.name) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                target = _ours(f"{source}.{alias.name}") if f"{source}.{alias.name}" in MODULES else None
                if target is None and source == FACADE:
                    target = _ours(FACADE_NAMES.get(alias.name, FACADE))
                out.add(target or _ours(source) or "")
    out.discard("")
    out.discard(module)
    return out


def import_graph() -> dict[str, set[str]]:
    return {module: imports_of(module, path) for module, path in MODULES.items()}


def rank_of() -> dict[str, int]:
    ranks = {}
    for rank, layer in enumerate(LAYERS):
        for folder in layer:
            assert folder not in ranks, f"{folder} is named twice in LAYERS"
            ranks[folder] = rank
    return ranks


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """One line per import of a module from a higher layer, sorted."""
    ranks = rank_of()
    lines = []
    for module, targets in graph.items():
        low = folder_of(module)
        if low == FACADE:
            continue
        for target in sorted(targets):
            high = folder_of(target)
            if high == FACADE:
                continue
            if low in ranks and high in ranks and ranks[low] < ranks[high]:  # (a folder in no layer: its own test)
                lines.append(f"{module} imports {target}: {low} is below {high}")
    return sorted(lines)


def folder_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Circles of folders that import each other: each a sorted
    list of the folders of one strongly connected component."""
    return circles(graph, folder_of)


def circles(graph: dict[str, set[str]], unit: Callable[[str], str]) -> list[list[str]]:
    """Circles of units (`unit` of a module: its folder, or the module itself) that import each
    other: each a sorted list of the units of one strongly connected component."""
    edges: dict[str, set[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = unit(module), unit(target)
            if a != b and FACADE not in (a, b):
                edges.setdefault(a, set()).add(b)
    # Tarjan's strongly connected components, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_every_folder_has_a_layer() -> None:
    ranks = rank_of()
    folders = {folder_of(module) for module in MODULES} - {FACADE}
    missing = sorted(folders - set(ranks))
    assert not missing, f"folders in no layer of LAYERS (add them where they belong): {missing}"


def test_imports_point_down(graph: dict[str, set[str]]) -> None:
    arrows = upward_arrows(graph)
    assert not arrows, f"{len(arrows)} import(s) point up:\n" + "\n".join(arrows)


def test_no_circle_between_folders(graph: dict[str, set[str]]) -> None:
    circles = folder_circles(graph)
    assert not circles, "folders import each other: " + "; ".join(" <-> ".join(c) for c in circles)


def test_no_circle_between_modules(graph: dict[str, set[str]]) -> None:
    """Inside a folder too: modules that import each other (a package's `__init__` re-exporting
    its modules aside) are one module split in two."""
    inits = {m for m, path in MODULES.items() if path.name == "__init__.py"}
    found = circles({m: t - inits for m, t in graph.items() if m not in inits}, lambda m: m)
    assert not found, "modules import each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_checks_catch_an_upward_import_and_a_circle() -> None:
    """The checks themselves: a made-up upward import is reported, and so is a circle."""
    fake = {"tiered_cache.model.spec": {"tiered_cache.tiers.base"},
            "tiered_cache.tiers.base": {"tiered_cache.model.spec"}}
    assert upward_arrows(fake) == ["tiered_cache.model.spec imports tiered_cache.tiers.base: model is below tiers"]
    assert folder_circles(fake) == [["model", "tiers"]]
    assert circles(fake, lambda m: m) == [["tiered_cache.model.spec", "tiered_cache.tiers.base"]]
    assert folder_of("tiered_cache.config") == "config"
    assert upward_arrows({"tiered_cache.config": {"tiered_cache.cache.reuse"}}) == [
        "tiered_cache.config imports tiered_cache.cache.reuse: config is below cache"]
    assert folder_of("tiered_cache.errors") == "errors"
    assert folder_of("tiered_cache.workers.cluster") == "workers"
