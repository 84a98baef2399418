"""`python -m benchmarks`: run from the repository root, one subcommand per benchmark with only the flags it reads, and
its user errors as one line with exit code 2, as raytrm's own commands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]


def test_it_runs_as_a_module_from_the_repository_root():
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    names = {"trm", "transformer", "mix", "memory", "tune", "distributed", "rig", "hf", "hf-tuned"}
    assert all(f"    {name}" in done.stdout for name in names)
    assert set(COMMANDS) == names


def test_a_flag_of_another_benchmark_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["memory", "--batch", "3"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "python -m benchmarks: error: unrecognized arguments: --batch 3"


def test_a_user_error_is_one_line_with_exit_code_2(capsys):
    assert main(["tune"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "benchmarks: error: tune needs --table FILE: the grid's JSON (written with --measure, read otherwise)"
    ]
