"""The wheel a user installs: built from the sources, installed with its dependencies into a fresh virtual environment
outside the checkout, it carries its tier table and search spaces, and `raytrm probe`, `raytrm validate quick` and a
two-step `raytrm train` work from a directory that is not the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a wheel build and a fresh environment: a few minutes

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # first and alone, as the README installs it: the CPU build, not the CUDA one
TINY_TRAIN = [
    *("--steps", "2", "--hidden-size", "32", "--L-layers", "1", "--H-cycles", "1", "--L-cycles", "1"),
    *("--global-batch", "8", "--train-puzzles", "32", "--threads", "1", "--quiet"),
]


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A fresh virtual environment with torch and the wheel (and the dependencies it declares); its bin directory and
    the environment to run it in."""
    work = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["RAYTRM_CACHE_DIR"] = str(work / "cache")
    # Built from a copy: setuptools builds in the source tree, and a build/ left there by an older build would put
    # modules since removed into the wheel.
    source = work / "source"
    shutil.copytree(ROOT / "raytrm", source / "raytrm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-w", str(work / "dist"), "-q"], work, env)
    (wheel,) = (work / "dist").glob("raytrm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {
        f"raytrm/tune_spaces/{n}.yaml"
        for n in ("tiers", "quick", "sudoku", "maze", "transformer", "hf-classify", "hf-lm")
    } <= set(names)
    assert not [n for n in names if n.split("/")[0] in ("benchmarks", "tests", "tune_spaces")], names
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], work, env)
    # Not byte-compiled: the commands below import a fraction of what torch and Ray install.
    _run([str(venv / "bin" / "pip"), "install", "-q", "--no-compile", TORCH], work, env)
    _run([str(venv / "bin" / "pip"), "install", "-q", "--no-compile", str(wheel)], work, env)
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    return venv / "bin", env | {"HOME": str(work / "home"), "PWD": str(elsewhere)}


def test_the_installed_raytrm_is_the_wheel_not_the_checkout(installed):
    bin_dir, env = installed
    cwd = Path(env["PWD"])
    found = _run([str(bin_dir / "python"), "-c", "import raytrm; print(raytrm.__file__)"], cwd, env).stdout.strip()
    assert Path(found).is_relative_to(bin_dir.parent) and not Path(found).is_relative_to(ROOT), found


def test_probe_and_validate_find_the_shipped_tiers_and_spaces(installed):
    bin_dir, env = installed
    cwd = Path(env["PWD"])
    probe = json.loads(_run([str(bin_dir / "raytrm"), "probe", "--json"], cwd, env).stdout)
    assert probe["raytrm_probe"] == 1 and probe["tier"]["name"]
    out = _run([str(bin_dir / "raytrm"), "validate", "quick"], cwd, env).stdout
    shipped = bin_dir.parent / "lib"
    assert out.startswith("# ") and "/site-packages/raytrm/tune_spaces/quick.yaml: valid search space" in out
    assert Path(out[2:].split(":")[0]).is_relative_to(shipped), out.splitlines()[0]
    tiers = _run([str(bin_dir / "raytrm"), "validate", "tiers"], cwd, env).stdout
    assert "/site-packages/raytrm/tune_spaces/tiers.yaml: valid tier table" in tiers


def test_a_two_step_training_run_from_another_directory(installed):
    bin_dir, env = installed
    cwd = Path(env["PWD"])
    done = _run([str(bin_dir / "raytrm"), "train", *TINY_TRAIN, "--out", "run"], cwd, env)
    assert done.stdout.startswith("trained 2 steps")
    run = cwd / "run"
    assert {p.name for p in run.iterdir()} >= {"config.yaml", "metrics.jsonl", "summary.json", "checkpoints"}
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert (run / "checkpoints" / "step-00000002.ckpt").is_file()
