"""The package's layers: every import, those inside functions too, runs down the order docs/architecture.md states,
no modules import each other in a circle, and nothing in the package imports the checkout's benchmarks or tests."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "raytrm"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: The layer line of docs/architecture.md: `cli > report > ... > constants, errors`.
ORDER_LINE = re.compile(r"^\s*(cli\s*>.*)$", re.MULTILINE)


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _module_of(name: str) -> str | None:
    """The package module that an imported dotted name lives in (a name imported from a module is in it)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module, line) for each import of a raytrm module anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            # `from pkg import sub` imports the submodule; `from mod import name` imports mod.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            target = _module_of(name) if name.startswith("raytrm") else None
            # A module's own package (and its parents) is imported before the module itself runs: not an arrow.
            if target is not None and target != module and not module.startswith(target + "."):
                yield target, node.lineno


EDGES = {module: sorted(set(_imports(module, path))) for module, path in MODULES.items()}


def _layer_of(module: str) -> str:
    """The layer a module belongs to: its top-level package or module under raytrm (the root package is `raytrm`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "raytrm"


def _order() -> dict[str, int]:
    """Each layer's height, from docs/architecture.md's order line (cli the highest)."""
    match = ORDER_LINE.search(ARCHITECTURE.read_text())
    assert match, f"{ARCHITECTURE}: no layer order line (`cli > ... > errors`)"
    floors = [floor.split(",") for floor in match.group(1).split(">")]
    return {name.strip(): len(floors) - height for height, floor in enumerate(floors) for name in floor}


def test_every_layer_is_named_in_the_order() -> None:
    order = _order()
    unnamed = sorted({_layer_of(m) for m in MODULES} - set(order) - {"raytrm"})
    assert not unnamed, f"packages or modules missing from {ARCHITECTURE.name}'s layer order: {unnamed}"


def test_imports_run_down_the_layers() -> None:
    order = _order()
    upward = [
        f"{module}:{line} imports {target} ({_layer_of(module)} -> {_layer_of(target)})"
        for module, targets in EDGES.items()
        for target, line in targets
        if _layer_of(module) in order
        and _layer_of(target) in order
        and order[_layer_of(target)] >= order[_layer_of(module)]
        and _layer_of(target) != _layer_of(module)
    ]
    assert not upward, "imports that run up or across the layers:\n" + "\n".join(upward)


def _absolute_imports(path: Path) -> Iterator[tuple[str, int]]:
    """(imported module, line) of each absolute import in the file, those inside functions too."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            yield name, node.lineno


def test_nothing_below_distributed_imports_ray() -> None:
    order = _order()
    below = {layer for layer, height in order.items() if height < order["distributed"]}
    found = [
        f"{module}:{line}"
        for module, path in MODULES.items()
        if _layer_of(module) in below
        for name, line in _absolute_imports(path)
        if name.split(".")[0] == "ray"
    ]
    assert not found, "modules below distributed/ that import Ray:\n" + "\n".join(found)


def test_the_package_never_imports_the_benchmarks_or_the_tests() -> None:
    """They stay in the checkout: a wheel has neither, so an import of them would fail only once installed."""
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in MODULES.values()
        for name, line in _absolute_imports(path)
        if name.split(".")[0] in ("benchmarks", "tests")
    ]
    assert not found, "the package imports what the wheel does not ship:\n" + "\n".join(found)


def test_no_import_circle() -> None:
    graph = {module: {target for target, _ in targets} for module, targets in EDGES.items()}
    circles = _strongly_connected(graph)
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(
        " -> ".join(sorted(circle)) for circle in circles
    )


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
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
                    circles.append(component)
    return circles


@pytest.mark.parametrize(
    ("graph", "circles"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
    ],
)
def test_circles_are_found(graph: dict[str, set[str]], circles: list[list[str]]) -> None:
    assert sorted(sorted(c) for c in _strongly_connected(graph)) == circles
