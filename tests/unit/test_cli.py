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


@pytest.mark.slow
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
@pytest.mark.slow
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


def _files(path) -> dict:
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_every_writing_command_leaves_a_run_as_it_was(tiny, tmp_path, capsys):
    """train, export-checkpoint and import-checkpoint each refuse an --out that would replace a run's work."""
    from raytrm.config import write_yaml

    config = write_yaml(tiny(), tmp_path / "tiny.yaml")
    run = tmp_path / "run"
    assert main(["train", "--config", str(config), "--steps", "2", "--out", str(run), "--quiet"]) == 0
    ref = tmp_path / "ref.pt"
    assert main(["export-checkpoint", str(run), "--out", str(ref)]) == 0
    capsys.readouterr()
    before = _files(run)
    newest = run / "checkpoints" / "step-00000002.ckpt"
    for argv, piece in [
        (["train", "--config", str(config), "--steps", "1", "--out", str(run)], "already holds a run"),
        (["export-checkpoint", str(run), "--out", str(newest)], "in the checkpoint directory of the run"),
        (["export-checkpoint", str(run), "--out", str(run / "metrics.jsonl")], "own metrics.jsonl"),
        (["import-checkpoint", str(ref), "--out", str(run), "--config", str(config)], "already holds a run"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("raytrm: error: --out ") and piece in err[0], err
    assert _files(run) == before


def test_train_overwrite_keeps_the_old_run_beside_the_new(tiny, tmp_path):
    from raytrm.config import write_yaml

    config = write_yaml(tiny(), tmp_path / "tiny.yaml")
    run = tmp_path / "run"
    assert main(["train", "--config", str(config), "--steps", "2", "--out", str(run), "--quiet"]) == 0
    before = _files(run)
    assert main(["train", "--config", str(config), "--steps", "1", "--out", str(run), "--quiet", "--overwrite"]) == 0
    (aside,) = tmp_path.glob("run.replaced-*")
    assert _files(aside) == before
    assert json.loads((run / "summary.json").read_text())["steps"] == 1


def test_resume_with_the_starting_config_takes_only_its_length(tiny, tmp_path, capsys):
    """A --config given with --resume must describe the run; its steps (resume may change them) then apply."""
    from raytrm import config as cfg

    run = tmp_path / "run"
    first = cfg.write_yaml(tiny(training={"steps": 2}), tmp_path / "first.yaml")
    assert main(["train", "--config", str(first), "--out", str(run), "--quiet"]) == 0
    longer = cfg.write_yaml(tiny(training={"steps": 3}), tmp_path / "longer.yaml")
    assert main(["train", "--config", str(longer), "--out", str(run), "--resume", "--quiet"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    capsys.readouterr()
    seeded = cfg.write_yaml(tiny(training={"steps": 4, "seed": 9}), tmp_path / "seeded.yaml")
    assert main(["train", "--config", str(seeded), "--out", str(run), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"raytrm: error: --resume continues {run / 'config.yaml'} as it was; only --steps and --time-budget may "
        f"change, but training.seed is 3 there, 9 asked: drop --config {seeded} (the run keeps its own config), or "
        "start a new run with another --out"
    )
    flagged = ["train", "--config", str(longer), "--hidden-size", "64", "--out", str(run), "--resume", "--quiet"]
    assert main(flagged) == 2
    err = capsys.readouterr().err
    assert f"model.hidden_size is 32 there, 64 asked: drop --config {longer} and those flags (the run keeps" in err


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["train", "--steps", "abc"], "--steps: 'abc' is not an integer; give an integer (optimizer steps to run)"),
        (["train", "--lr", "x"], "--lr: 'x' is not a number; give a number (peak learning rate)"),
        (["train", "--elastic", "--steps", "2"], "--elastic needs several workers: give --workers N or --address"),
        (["tune", "--trials", "1.5"], "--trials: '1.5' is not an integer; give an integer (trials per tier)"),
        (["data", "sudoku", "--out", "d", "--count", "many"], "--count: 'many' is not an integer; give an integer"),
        (
            ["train", "--stepz", "3"],
            "raytrm train: unknown option --stepz; did you mean --steps? (see `raytrm train --help`)",
        ),
        (["report", "r", "--outt", "x"], "raytrm report: unknown option --outt; did you mean --out?"),
        (
            ["validate", "a.yaml", "b.yaml"],
            "raytrm validate: unexpected argument 'b.yaml' (see `raytrm validate --help`)",
        ),
        (["validate"], "raytrm validate: missing file (see `raytrm validate --help`)"),
        (["train", "--steps"], "raytrm train: --steps: expected a value after it (see `raytrm train --help`)"),
        (["tran"], "raytrm: COMMAND: 'tran' is not a raytrm command; did you mean train? (see `raytrm --help`)"),
        ([], "raytrm: missing COMMAND (see `raytrm --help`)"),
        (
            ["cluster", "jion"],
            "raytrm cluster: ACTION: 'jion' is not one of head, join, paths, status, stop; did you mean join?",
        ),
        (["cluster", "join", "h", "--object-store-mb", "lots"], "--object-store-mb: 'lots' is not an integer"),
        (["data", "sodoku", "--out", "d"], "raytrm data: kind: 'sodoku' is not one of sudoku, maze; did you mean"),
        (["--bogus", "probe"], "raytrm: unknown option --bogus (see `raytrm --help`)"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(capsys, argv, line):
    """Every subcommand's parser answers a bad argument with raytrm's one line, never argparse's usage block."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"raytrm: error: {line}"), captured.err
    assert "usage:" not in captured.err and captured.out == ""


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["cluster", "join", "--help"]])
def test_help_still_prints_and_exits_0(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: raytrm {' '.join(argv[:-1])}".rstrip())


def test_the_installed_command_answers_a_bad_number_in_one_line():
    bad = subprocess.run([_raytrm(), "train", "--steps", "abc"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == "raytrm: error: --steps: 'abc' is not an integer; give an integer (optimizer steps to run)\n"


def test_report_export_and_data_never_write_into_a_run(tiny, tmp_path, capsys):
    """The other writing commands take the same guard: a run's checkpoints, its own files and its directory are
    refused in one line, and the run is left as it was."""
    from raytrm.config import write_yaml

    config = write_yaml(tiny(), tmp_path / "tiny.yaml")
    run = tmp_path / "run"
    assert main(["train", "--config", str(config), "--steps", "2", "--out", str(run), "--quiet"]) == 0
    capsys.readouterr()
    before = _files(run)
    for argv, piece in [
        (["report", str(run), "--out", str(run / "checkpoints")], "own checkpoints"),
        (["data", "sudoku", "--out", str(run), "--count", "4"], "a run directory is there"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("raytrm: error: --out ") and piece in err[0], err
    from raytrm.errors import UserError
    from raytrm.tune.profiles import _check_out  # export's guard of its --out, before any tuning run is read

    with pytest.raises(UserError, match=r"own config\.yaml"):
        _check_out(run / "config.yaml")
    assert _files(run) == before


@pytest.mark.slow
def test_a_quiet_run_alone_prints_its_summary_and_nothing_else(tiny, tmp_path):
    """--quiet on one machine: no progress line and no INFO lines on the terminal, the summary on stdout."""
    from raytrm.config import write_yaml

    config = write_yaml(tiny(), tmp_path / "tiny.yaml")
    argv = [_raytrm(), "train", "--config", str(config), "--steps", "2", "--out", str(tmp_path / "run"), "--quiet"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith("trained 2 steps") and len(done.stdout.strip().splitlines()) == 4
