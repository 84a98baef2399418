"""The hostile user's cases against run directories, resume and checkpoints, kept as fixed examples (fast, not slow).

A run directory is a user's work: training into one needs --resume or --overwrite (which moves it aside), no command
writes over a checkpoint or a run's own files, and resume takes a --config or --profile only where it describes the
stored run. A checkpoint that does not fit (another experiment, tensors of other shapes, an impossible step) is one
line naming what differs and the fix, never a traceback, and a distributed run says so before any worker starts.
"""

from __future__ import annotations

import json
import shutil

import pytest
from mutations import TINY, check_cli_refusal, run_cli

from raytrm import config as cfg
from raytrm.train import checkpoint as ckpt


def snapshot(path) -> dict:
    """Every file under path with its bytes: what "nothing lost, nothing touched" compares."""
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def run(tmp_path, seed_run):
    """A copy of the seed run (a tiny TRM, one step, checkpoints/step-00000001.ckpt) to attack."""
    copy = tmp_path / "run"
    shutil.copytree(seed_run[0], copy)
    return copy


@pytest.fixture
def other_yaml(tmp_path, run):
    """A config of another model (twice as wide) on the same data."""
    experiment = cfg.load(cfg.ExperimentConfig, run / "config.yaml")
    experiment.model.hidden_size *= 2
    return cfg.write_yaml(experiment, tmp_path / "other.yaml")


def profile_of(run, path, **model) -> str:
    """A profile whose experiment is the run's, its model changed by `model`."""
    experiment = cfg.load(cfg.ExperimentConfig, run / "config.yaml")
    for name, value in model.items():
        setattr(experiment.model, name, value)
    profile = cfg.Profile(tier="t", model=experiment.model, data=experiment.data, training=experiment.training)
    profile.limits = cfg.Limits(memory_budget_mb=experiment.training.memory_budget_mb or 2000)
    return str(cfg.write_yaml(profile, path))


def newest(run):
    return ckpt.list_checkpoints(run / "checkpoints")[-1]


def edit_checkpoint(run, edit) -> None:
    """Rewrite the run's newest checkpoint with `edit(state)` applied, its checksum valid."""
    path = newest(run)
    state = ckpt.load_checkpoint(path)
    header = state.pop("_header")
    edit(state)
    ckpt.save_checkpoint(state, path.parent, header["step"])


# -- 1. training into a run without --resume ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "how",
    [["--config", "{other}"], [], ["--profile", "{profile}"], ["--config", "{other}", "--workers", "2"]],
    ids=["config", "embedded-default", "profile", "workers"],
)
def test_training_into_a_run_without_resume_is_refused_and_touches_nothing(tmp_path, run, other_yaml, how, monkeypatch):
    import raytrm.distributed.cluster as cluster

    monkeypatch.setattr(cluster, "connect", lambda *a, **k: pytest.fail("Ray was started"))
    profile = profile_of(run, tmp_path / "p.yaml", hidden_size=32)
    args = [a.format(other=other_yaml, profile=profile) for a in how]
    before = snapshot(run)
    code, _, err = run_cli(["train", *args, "--steps", "1", "--out", str(run), "--quiet"])
    assert check_cli_refusal(code, err) == (
        f"raytrm: error: --out {run}: already holds a run (config.yaml, metrics.jsonl, summary.json, 1 checkpoint in "
        f"checkpoints/); continue it with --resume, start anew with --overwrite (the run is moved aside to "
        f"run.replaced-<time>, not deleted), or choose another --out"
    )
    assert snapshot(run) == before


def test_overwrite_moves_the_old_run_aside_and_starts_anew(tmp_path, run, other_yaml, caplog):
    before = snapshot(run)
    args = ["train", "--config", str(other_yaml), "--steps", "1", "--out", str(run), "--overwrite", "--quiet"]
    code, _, err = run_cli(args)
    assert code == 0, err
    (aside,) = tmp_path.glob("run.replaced-*")
    assert snapshot(aside) == before  # the old run, whole
    assert f"moved aside to {aside}" in caplog.text
    used = cfg.load(cfg.ExperimentConfig, run / "config.yaml")
    assert used.model.hidden_size == 32 and [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == [
        "step-00000001.ckpt"
    ]


def test_resume_and_overwrite_together_are_refused(run):
    before = snapshot(run)
    code, _, err = run_cli(["train", "--out", str(run), "--resume", "--overwrite", "--steps", "2"])
    assert check_cli_refusal(code, err) == (
        f"raytrm: error: --resume continues the run in {run} and --overwrite moves it aside to start anew: give one "
        "of them"
    )
    assert snapshot(run) == before


# -- 2. writing commands never replace a run's files ---------------------------------------------------------------


@pytest.mark.parametrize("target", ["checkpoints/step-00000001.ckpt", "config.yaml", "summary.json", ""])
def test_export_checkpoint_never_writes_over_the_run(run, target):
    before = snapshot(run)
    out = run / target if target else run
    code, _, err = run_cli(["export-checkpoint", str(run), "--out", str(out)])
    line = check_cli_refusal(code, err)
    assert line.startswith(f"raytrm: error: --out {out}: ")
    assert snapshot(run) == before


def test_import_checkpoint_never_writes_into_a_run(tmp_path, run, seed_run):
    before = snapshot(run)
    code, _, err = run_cli(["import-checkpoint", str(seed_run[1]), "--out", str(run)])
    assert check_cli_refusal(code, err).startswith(f"raytrm: error: --out {run}: already holds a run (")
    assert snapshot(run) == before


# -- 3. --resume takes a --config or --profile only where it describes the run ------------------------------------


@pytest.mark.parametrize("kind", ["config", "profile"])
def test_resume_with_another_experiments_file_is_refused(tmp_path, run, other_yaml, kind):
    given = str(other_yaml) if kind == "config" else profile_of(run, tmp_path / "p.yaml", hidden_size=32)
    before = snapshot(run)
    code, _, err = run_cli(["train", "--out", str(run), "--resume", f"--{kind}", given, "--steps", "2", "--quiet"])
    assert check_cli_refusal(code, err) == (
        f"raytrm: error: --resume continues {run / 'config.yaml'} as it was; only --steps and --time-budget may "
        f"change, but model.hidden_size is 16 there, 32 asked: drop --{kind} {given} (the run keeps its own config), "
        "or start a new run with another --out"
    )
    assert snapshot(run) == before


@pytest.mark.parametrize("kind", ["config", "profile"])
def test_resume_with_the_runs_own_file_goes_on(tmp_path, run, kind):
    given = str(run / "config.yaml") if kind == "config" else profile_of(run, tmp_path / "p.yaml")
    if kind == "config":
        given = str(shutil.copy(given, tmp_path / "same.yaml"))
    code, _, err = run_cli(["train", "--out", str(run), "--resume", f"--{kind}", given, "--steps", "2", "--quiet"])
    assert code == 0, err
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["resumed_from_step"]) == (2, 1)


# -- 4. a checkpoint of another experiment --------------------------------------------------------------------------


def test_an_edited_config_names_each_field_and_keeps_the_checkpoint(run):
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("hidden_size: 16", "hidden_size: 32"))
    before = snapshot(run)
    code, _, err = run_cli(["train", "--out", str(run), "--resume", "--steps", "2", "--quiet"])
    config = run / "config.yaml"
    assert check_cli_refusal(code, err) == (
        f"raytrm: error: {newest(run)}: written for another experiment than {config}: model.hidden_size is 16 in the "
        f"checkpoint, 32 in {config}; the checkpoint is fine: set that field in {config} back to the checkpoint's "
        "value to resume it, or start a new run with another --out"
    )
    assert "delete" not in err and snapshot(run) == before


def test_a_checkpoint_of_another_model_size_names_the_fields(tmp_path, run, seed_dataset):
    bigger = tmp_path / "bigger"
    args = ["train", "--data", str(seed_dataset), "--steps", "1", "--out", str(bigger), *TINY, "--hidden-size", "24"]
    code, _, err = run_cli(args)
    assert code == 0, err
    shutil.copy(newest(bigger), newest(run))
    code, _, err = run_cli(["train", "--out", str(run), "--resume", "--steps", "2", "--quiet"])
    line = check_cli_refusal(code, err)
    assert f"model.hidden_size is 24 in the checkpoint, 16 in {run / 'config.yaml'}" in line
    assert "the checkpoint is fine" in line and "AttributeError" not in line and "delete" not in line


# -- 5. tensors of the wrong shape behind a valid checksum -----------------------------------------------------------


def _narrow_carry(state):
    state["carry"]["z_H"] = state["carry"]["z_H"][..., :8].clone()


def _narrow_weight(state):
    state["model"]["lm_head.weight"] = state["model"]["lm_head.weight"][:, :8].clone()


def _foreign_round(state):
    params = list(state["ema"]["shadow"].values())
    state["sync"] = {"mode": "local", "rounds": {"globals": [p[..., :1] for p in params], "workers": []}}


SHAPES = {
    "carry": (_narrow_carry, "carry.z_H holds a tensor of shape (4, 97, 8), this config builds a tensor of shape "),
    "weights": (_narrow_weight, "model.lm_head.weight holds a tensor of shape (11, 8), this config builds a tensor "),
    "round": (_foreign_round, "sync.rounds.globals[0] holds a tensor of shape "),
}


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_tensors_of_the_wrong_shape_are_one_line_naming_the_key(run, case):
    edit, piece = SHAPES[case]
    edit_checkpoint(run, edit)
    before = snapshot(run)
    code, _, err = run_cli(["train", "--out", str(run), "--resume", "--steps", "2", "--quiet"])
    line = check_cli_refusal(code, err)
    assert line.startswith(f"raytrm: error: {newest(run)}: {piece}"), line
    assert line.endswith(
        f"move it out of {run / 'checkpoints'} to resume from the checkpoint before it, or start a new"
        " run with another --out"
    )
    code, _, err = run_cli(["export-checkpoint", str(run), "--out", str(run.parent / "ref.pt")])
    assert check_cli_refusal(code, err).startswith(f"raytrm: error: {newest(run)}: {piece}")
    assert snapshot(run) == before


def test_a_distributed_resume_is_refused_before_ray_or_any_worker_starts(run, monkeypatch):
    import raytrm.distributed.cluster as cluster

    monkeypatch.setattr(cluster, "connect", lambda *a, **k: pytest.fail("Ray was started"))
    edit_checkpoint(run, _narrow_carry)
    for where in (["--workers", "2"], ["--address", "127.0.0.1:1"]):
        code, _, err = run_cli(["train", "--out", str(run), "--resume", *where, "--steps", "2", "--quiet"])
        assert check_cli_refusal(code, err).startswith(f"raytrm: error: {newest(run)}: {SHAPES['carry'][1]}")
    assert not (run / "ray").exists()


# -- 6. impossible steps ---------------------------------------------------------------------------------------------


def _header(run, **fields) -> None:
    path = newest(run)
    head, _, payload = path.read_bytes().partition(b"\n")
    path.write_bytes(json.dumps({**json.loads(head), **fields}).encode() + b"\n" + payload)


STEPS = {
    "header and payload": (lambda run: _header(run, step=5), "its header says step 5, its contents step 1"),
    "negative": (lambda run: edit_checkpoint(run, lambda s: s.update(step=-1)), "its header says step 1, its"),
    "negative header": (lambda run: _header(run, step=-1), "its header claims step -1, expected a step count >= 0"),
    "samples": (
        lambda run: edit_checkpoint(run, lambda s: s.update(samples_seen=3)),
        "it claims 3 samples seen at step 1, expected 4 (step x the global batch 4)",
    ),
    "name": (
        lambda run: newest(run).rename(newest(run).with_name("step-00000004.ckpt")),
        "its name says step 4, its header step 1; rename it step-00000001.ckpt if that is its step",
    ),
}


@pytest.mark.parametrize("case", sorted(STEPS))
def test_a_checkpoint_claiming_an_impossible_step_is_one_line(run, case):
    edit, piece = STEPS[case]
    edit(run)
    code, _, err = run_cli(["train", "--out", str(run), "--resume", "--steps", "6", "--quiet"])
    line = check_cli_refusal(code, err)
    assert line.startswith(f"raytrm: error: {run / 'checkpoints'}: no checkpoint verifies (1 tried; newest: ")
    assert f"{newest(run)}: {piece}" in line, line
    assert not (run / "checkpoints" / "step-00000006.ckpt").exists()


# -- 7. --out naming a file ------------------------------------------------------------------------------------------


def test_out_naming_a_file_is_one_line_and_the_file_is_kept(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    code, _, err = run_cli(["train", "--steps", "1", "--out", str(path), "--quiet"])
    assert check_cli_refusal(code, err) == (
        f"raytrm: error: --out {path}: a file is there, expected a run directory; give --out a new directory (or a "
        "run's directory with --resume)"
    )
    assert path.read_text() == "mine"
