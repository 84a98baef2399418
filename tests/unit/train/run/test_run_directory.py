"""A run directory is a user's work: where a new run may start, moving a run aside, and the guard of every output."""

from __future__ import annotations

import logging

import pytest
import torch

from raytrm.errors import UserError
from raytrm.train import checkpoint as ckpt
from raytrm.train.run.directory import check_new_run_dir, claim_run_dir, guard_output, move_aside, run_contents


def make_run(path, checkpoints=(1, 2)):
    """A run directory as `raytrm train` leaves it (the files' contents do not matter here)."""
    path.mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        (path / name).write_text(f"{name}\n")
    for step in checkpoints:
        ckpt.save_checkpoint({"step": step, "w": torch.zeros(2)}, path / "checkpoints", step)
    return path


def snapshot(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_run_is_any_of_its_files(tmp_path):
    assert run_contents(tmp_path / "none") == []
    assert run_contents(tmp_path) == []
    (tmp_path / "metrics.jsonl").write_text("")
    assert run_contents(tmp_path) == ["metrics.jsonl"]
    only_checkpoints = tmp_path / "c"
    ckpt.save_checkpoint({"step": 3}, only_checkpoints / "checkpoints", 3)
    assert run_contents(only_checkpoints) == ["1 checkpoint in checkpoints/"]


def test_a_new_run_starts_where_nothing_is_or_in_an_empty_directory(tmp_path):
    check_new_run_dir(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".DS_Store").write_bytes(b"")  # what Finder leaves in any folder it opened
    check_new_run_dir(tmp_path / "empty")
    ray_only = tmp_path / "ray-only"  # a distributed run stopped before it wrote anything of its own
    (ray_only / "ray").mkdir(parents=True)
    check_new_run_dir(ray_only)
    assert claim_run_dir(tmp_path / "empty", overwrite=True) is None  # nothing to move
    assert (tmp_path / "empty" / ".DS_Store").exists()


def test_a_run_needs_resume_or_overwrite(tmp_path):
    run = make_run(tmp_path / "run")
    before = snapshot(run)
    with pytest.raises(UserError) as refused:
        check_new_run_dir(run)
    assert str(refused.value) == (
        f"--out {run}: already holds a run (config.yaml, metrics.jsonl, summary.json, 2 checkpoints in "
        "checkpoints/); continue it with --resume, start anew with --overwrite (the run is moved aside to "
        "run.replaced-<time>, not deleted), or choose another --out"
    )
    with pytest.raises(UserError, match=r"already holds a run .*; choose another --out, a new or empty directory$"):
        check_new_run_dir(run, resumable=False)  # import-checkpoint: it cannot resume
    assert claim_run_dir(run, resume=True) is None
    assert snapshot(run) == before


def test_overwrite_moves_the_run_aside_whole(tmp_path, caplog):
    run = make_run(tmp_path / "run")
    (run / "report").mkdir()
    (run / "report" / "diagnosis.txt").write_text("kept")
    before = snapshot(run)
    with caplog.at_level(logging.WARNING, logger="raytrm.train.run.directory"):
        moved = claim_run_dir(run, overwrite=True)
    assert moved.parent == tmp_path and moved.name.startswith("run.replaced-")
    assert not run.exists() and snapshot(moved) == before
    assert f"the run in {run} was moved aside to {moved} (kept, not deleted)" in caplog.text
    again = make_run(run)
    second = move_aside(again)  # within the same second: a free name all the same
    assert second != moved and second.exists() and moved.exists()


def test_files_that_are_not_a_run_are_never_moved(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"holds files that are not a raytrm run \(notes.txt\); give --out a new or"):
        claim_run_dir(mine, overwrite=True)
    mixed = make_run(tmp_path / "mixed")
    (mixed / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"holds a run \(.*\) and other files \(notes.txt\); --overwrite moves aside"):
        claim_run_dir(mixed, overwrite=True)
    assert (mine / "notes.txt").exists() and (mixed / "notes.txt").exists() and (mixed / "config.yaml").exists()


def test_a_file_is_no_run_directory(tmp_path):
    path = tmp_path / "f"
    path.write_text("data")
    with pytest.raises(UserError) as refused:
        claim_run_dir(path, overwrite=True)
    assert str(refused.value) == (
        f"--out {path}: a file is there, expected a run directory; give --out a new directory (or a run's "
        "directory with --resume)"
    )
    assert path.read_text() == "data"


def test_a_new_run_never_starts_inside_a_runs_checkpoints(tmp_path):
    run = make_run(tmp_path / "run")
    with pytest.raises(UserError, match=r"in the checkpoint directory of the run .*run, which resume reads; give"):
        check_new_run_dir(run / "checkpoints" / "sub")


@pytest.mark.parametrize(
    "where, piece",
    [
        ("checkpoints/step-00000002.ckpt", "in the checkpoint directory of the run"),
        ("checkpoints/new.pt", "in the checkpoint directory of the run"),
        ("config.yaml", "own config.yaml"),
        ("metrics.jsonl", "own metrics.jsonl"),
        ("summary.json", "own summary.json"),
        ("", "a run directory is there"),
    ],
)
def test_no_output_replaces_a_runs_files(tmp_path, where, piece):
    run = make_run(tmp_path / "run")
    before = snapshot(run)
    with pytest.raises(UserError) as refused:
        guard_output(run / where if where else run, directory=not where)
    assert piece in str(refused.value) and str(refused.value).startswith(f"--out {run / where if where else run}:")
    assert snapshot(run) == before


def test_an_output_may_go_beside_a_runs_files_but_never_onto_a_checkpoint(tmp_path):
    run = make_run(tmp_path / "run")
    assert guard_output(run / "reference.pt") == run / "reference.pt"
    assert guard_output(run / "report", directory=True) == run / "report"  # `raytrm report`'s default
    loose = ckpt.save_checkpoint({"step": 5}, tmp_path / "loose", 5)  # a checkpoint outside any run
    with pytest.raises(UserError, match=r"a raytrm checkpoint is there, and writing would replace it"):
        guard_output(loose, "--json")
    with pytest.raises(UserError, match=r"a directory is there, expected a file"):
        guard_output(tmp_path)
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    with pytest.raises(UserError, match=r"a file is there, expected a directory"):
        guard_output(plain, directory=True)


def test_the_directory_a_command_runs_in_is_never_moved(tmp_path, monkeypatch):
    run = make_run(tmp_path / "run")
    monkeypatch.chdir(run)
    with pytest.raises(UserError, match=r"--overwrite \.: the current directory is in that run; run the command"):
        claim_run_dir(".", overwrite=True)
    assert run.is_dir() and (run / "config.yaml").exists()
