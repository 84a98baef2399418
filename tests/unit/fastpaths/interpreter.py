"""What the fast-path tests share: markers for what a test needs, Triton's CPU interpreter in a subprocess, and a
backend's record replaced in the registry (a stand-in's conditions or a counting run)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from raytrm.fastpaths import registry
from raytrm.fastpaths import triton as triton_paths

ROOT = Path(__file__).resolve().parents[3]
needs_triton = pytest.mark.skipif(not triton_paths.HAVE_TRITON, reason="needs Triton (the test extra installs it)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _triton_version() -> tuple[int, int]:
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2])


interpretable = pytest.mark.skipif(
    not triton_paths.HAVE_TRITON or _triton_version() < (3, 9), reason="needs Triton 3.9 or later to interpret kernels"
)


def run_interpreted(script: str) -> str:
    """Run script in a subprocess under Triton's CPU interpreter (read when a kernel is defined); it prints OK. Its
    output is returned."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("OK"), done.stdout[-3000:]
    return done.stdout


def replace_backend(op: str, name: str, monkeypatch: pytest.MonkeyPatch | None = None, **fields: Any) -> None:
    """Replace fields (why_not, run) of operation op's backend `name` in the registry; through monkeypatch where
    given (undone after the test), else for the rest of the process (a subprocess's script)."""
    backends = tuple(b._replace(**fields) if b.name == name else b for b in registry.backends(op))
    assert any(b.name == name for b in backends), f"{op} has no backend {name}"
    if monkeypatch is None:
        registry._backends[op] = backends
    else:
        monkeypatch.setitem(registry._backends, op, backends)


def count_runs(op: str, name: str, monkeypatch: pytest.MonkeyPatch | None = None) -> list[int]:
    """A list that gains an entry each time operation op's backend `name` runs."""
    calls: list[int] = []
    run: Callable[..., Any] = next(b.run for b in registry.backends(op) if b.name == name)
    replace_backend(op, name, monkeypatch, run=lambda *args, **kwargs: calls.append(1) or run(*args, **kwargs))
    return calls
