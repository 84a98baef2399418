"""The `raytrm` command: help, version, probe, and user errors as one line with exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from raytrm import __version__
from raytrm.cli import main
from raytrm.constants import spaces_dir


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"raytrm {__version__}"


def test_probe_json_is_a_stable_document(capsys):
    assert main(["probe", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["raytrm_probe"] == 1
    assert doc["machine"]["device"] == "cpu"
    assert doc["machine"]["performance_cores"] >= 1
    assert doc["tier"]["name"]


def test_probe_table_names_the_tier_and_why(capsys):
    assert main(["probe"]) == 0
    out = capsys.readouterr().out
    assert "Tier" in out and "why" in out and "Memory" in out


def test_validate_shows_the_resolved_config(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  global_batch_size: 64\n  grad_accum_steps: 2\n")
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "valid training config" in out and "global_batch_size: 64" in out


def test_validate_reads_a_search_space(capsys):
    assert main(["validate", str(spaces_dir() / "quick.yaml")]) == 0
    out = capsys.readouterr().out
    assert "valid search space, 2 parameters" in out and "horizon:\n  minutes: 1.0" in out


def test_validate_takes_a_shipped_space_or_table_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "quick"]) == 0
    assert capsys.readouterr().out.startswith(f"# {spaces_dir() / 'quick.yaml'}: valid search space, 2 parameters")
    assert main(["validate", "tiers"]) == 0
    assert capsys.readouterr().out.startswith(f"{spaces_dir() / 'tiers.yaml'}: valid tier table")
    (tmp_path / "quick").write_text("training:\n  steps: 3\n")  # a file of that name here is the one meant
    assert main(["validate", "quick"]) == 0
    assert capsys.readouterr().out.startswith("# quick: valid training config")


@pytest.mark.parametrize(
    "text, piece",
    [
        ("model:\n  hidden_size: [\n", "malformed YAML at line 3"),
        ("model:\n  hiden_size: 128\n", "model.hiden_size: unknown field; did you mean 'hidden_size'?"),
        ("model:\n  hidden_size: big\n", "model.hidden_size: got 'big', expected an integer"),
        ("training:\n  grad_accum_steps: 0\n", "training.grad_accum_steps: got 0, expected a value >= 1"),
        (
            "raytrm_profile: 1\nlimits:\n  thermal_cap: toasty\n",
            "limits.thermal_cap: got 'toasty', expected one of",
        ),
        ("raytrm_tiers: 1\ntiers:\n  - {name: a, memory_budget_mb: 0}\n", "tiers[0].memory_budget_mb: got 0"),
        ("raytrm_space: 1\nparams: {}\nhorizon: {minutes: 1, samples: 9}\n", "params: got {}, expected at least one"),
    ],
)
def test_bad_files_exit_2_with_one_line(tmp_path, capsys, text, piece):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"raytrm: error: {path}")
    assert piece in lines[0]


def test_missing_file_exits_2(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "none.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_installed_command_lists_its_commands():
    exe = _raytrm()
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("probe", "validate"):
        assert command in out
    bad = subprocess.run([exe, "probe", "--tiers", "/nonexistent/tiers.yaml"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert bad.stderr.strip() == "raytrm: error: /nonexistent/tiers.yaml: no such file; check the path"


def _raytrm() -> str:
    exe = shutil.which("raytrm") or shutil.which("raytrm", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert exe, "the raytrm console script is not installed"
    return exe


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "{tmp}/none"], "{tmp}/none: no such directory, so it is not a puzzle dataset; fix: build one"),
        (
            ["--data", "{tmp}"],
            "{tmp}: no train/dataset.json, so it is not a puzzle dataset; fix: build one into a new directory and"
            " pass that, e.g. `raytrm data sudoku --out {tmp}/sudoku`",
        ),
        (["--model", "transformer", "--data", "{tmp}/none.txt"], "{tmp}/none.txt: no such file or directory; fix:"),
    ],
)
def test_train_on_missing_data_is_one_line_before_anything_else(tmp_path, args, message):
    """Nothing about the machine (its tier, threads, device) is logged before a bad data path's error."""
    args = [a.format(tmp=tmp_path) for a in args]
    run = subprocess.run(
        [_raytrm(), "train", "--steps", "1", "--out", str(tmp_path / "run"), *args], capture_output=True, text=True
    )
    assert run.returncode == 2
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"raytrm: error: {message.format(tmp=tmp_path)}")
    assert not (tmp_path / "run").exists()
