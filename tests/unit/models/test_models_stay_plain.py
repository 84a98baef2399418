"""raytrm/models is plain PyTorch that a newcomer reads in a sitting: it reaches the device fast paths only through the
registry (the package raytrm.fastpaths, by operation name), imports no backend, and stays under 1,600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import raytrm.models

MODELS = Path(raytrm.models.__file__).parent


def _imported(path: Path) -> set[str]:
    """Every module name an import in the file names (those inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_models_reach_fast_paths_only_through_the_registry():
    for path in MODELS.glob("*.py"):
        imported = _imported(path)
        backends = {name for name in imported if name.startswith("raytrm.fastpaths.")}
        assert not backends, f"{path.name} imports {sorted(backends)}: call the operation by name instead"
        assert not imported & {"triton", "ctypes"}, path.name


def test_models_stay_under_1600_lines():
    lines = sum(len(path.read_text().splitlines()) for path in MODELS.glob("*.py"))
    assert lines <= 1600, f"raytrm/models is {lines} lines"
