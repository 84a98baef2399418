"""The hf-tuned bench: raytrm's time to the target is read off its curve at the first score that reaches it, its
scores are taken off the loop's clock and stop the run there, and end to end on a tiny model both sides train on
raytrm's split of the same records."""

from __future__ import annotations

import contextlib
import json

import pytest

from benchmarks import hf_tuned
from benchmarks.cli import main
from raytrm import config as cfg
from raytrm.train.loop import Stop


def point(step, seconds, macro_f1):
    return {"step": step, "seconds": seconds, "macro_f1": macro_f1}


def test_the_time_to_target_is_the_first_point_that_reaches_it():
    curve = [point(5, 10.0, 0.30), point(10, 20.0, 0.71), point(15, 30.0, 0.69), point(20, 40.0, 0.75)]
    assert hf_tuned.first_reaching(curve, 0.71) is curve[1]  # reached exactly; a later dip below does not undo it
    assert hf_tuned.first_reaching(curve, 0.72) is curve[3]
    assert hf_tuned.first_reaching(curve, 0.76) is None
    assert hf_tuned.first_reaching([], 0.1) is None


class FakeTrainer:
    step = 0
    samples_seen = 0


class FakeLoop:
    """A loop's clock that evaluations advance by 100 s off it, and training by 10 s a step on it."""

    def __init__(self):
        self.trainer, self.t, self.off = FakeTrainer(), 0.0, 0.0

    def now(self):
        return self.t - self.off

    @contextlib.contextmanager
    def off_clock(self):
        begin = self.t
        yield
        self.off += self.t - begin

    def train_step(self):
        self.trainer.step += 1
        self.trainer.samples_seen += 32
        self.t += 10.0


def test_the_watch_scores_off_the_clock_and_stops_at_the_target(monkeypatch):
    loop = FakeLoop()
    scores = iter([0.2, 0.6, 0.8, 0.9])

    def evaluate(trainer, puzzles, metric):
        loop.t += 100.0
        f1 = next(scores)
        return {"quality": f1, "eval": {"eval_macro_f1": f1, "eval_accuracy": f1 + 0.05}}

    monkeypatch.setattr("raytrm.train.run.evaluations.evaluate_quality", evaluate)
    watch = hf_tuned.TargetWatch(every=2, target=0.7)
    decisions = []
    for _ in range(6):
        loop.train_step()
        decisions.append(watch.end_step(loop, None))
    assert decisions == [None, None, None, None, None, Stop("target reached")]
    assert [(p["step"], p["samples"], p["seconds"], p["macro_f1"]) for p in watch.curve] == [
        (2, 64, 20.0, 0.2),
        (4, 128, 40.0, 0.6),
        (6, 192, 60.0, 0.8),
    ]
    assert loop.now() == 60.0 and watch.curve[-1]["accuracy"] == pytest.approx(0.85)
    watch.finish(loop)  # the last step was scored already
    assert len(watch.curve) == 3


def test_a_run_ended_between_scores_is_scored_at_its_last_step(monkeypatch):
    loop = FakeLoop()
    monkeypatch.setattr(
        "raytrm.train.run.evaluations.evaluate_quality",
        lambda *a: {"quality": 0.5, "eval": {"eval_macro_f1": 0.5, "eval_accuracy": 0.5}},
    )
    watch = hf_tuned.TargetWatch(every=5, target=0.9)
    for _ in range(7):
        loop.train_step()
        watch.end_step(loop, None)
    watch.finish(loop)
    assert [(p["step"], p["seconds"]) for p in watch.curve] == [(5, 50.0), (7, 70.0)]


@pytest.fixture
def tiny_profile(tmp_path, monkeypatch):
    """A profile of a tiny BERT classifier on 40 records of two labels."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from tests.support.hf_models import classifier_dir, write_records

    model = classifier_dir(tmp_path / "model")
    records = write_records(tmp_path / "records.csv", count=40)
    profile = cfg.from_dict(
        cfg.Profile,
        {
            "tier": "tiny",
            "model": {"name": "hf", "task": "classify", "path": str(model), "seq_len": 32},
            "data": {"name": "records", "path": str(records), "text_fields": ["body"], "label_field": "label"},
            "training": {"global_batch_size": 8, "lr": 1e-3, "warmup_steps": 0, "threads": 2, "ema": False},
            "limits": {"memory_budget_mb": 4000},
        },
        "<test>",
    )
    path = tmp_path / "tiny.yaml"
    cfg.write_yaml(profile, path)
    return path


@pytest.mark.slow
def test_both_sides_train_on_raytrms_split_and_the_ratio_is_read_off_raytrms_curve(tiny_profile, tmp_path, capsys):
    out = tmp_path / "tuned.json"
    argv = ["hf-tuned", "--profile", str(tiny_profile), "--eval-every", "2", "--limit", "3"]
    assert main([*argv, "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    assert (r["train_records"], r["validation_records"], r["labels"], r["seq_len"], r["threads"]) == (36, 4, 2, 32, 2)
    theirs, ours = r["trainer"], r["raytrm"]
    # The Trainer's defaults: 3 epochs of 36 records at batch 8 (5 steps each), scored at each epoch's end.
    assert [(p["step"], p["samples"]) for p in theirs["curve"]] == [(5, 36), (10, 72), (15, 108)]
    assert theirs["steps"] == 15 and r["target"] == theirs["macro_f1"] == theirs["curve"][-1]["macro_f1"]
    seconds = [p["seconds"] for p in ours["curve"]]
    assert seconds == sorted(seconds) and seconds[-1] <= ours["train_seconds"]
    assert ours["steps"] == ours["curve"][-1]["step"] and ours["samples"] == 8 * ours["steps"]
    if ours["stop"] == "target reached":
        assert (
            ours["curve"][-1]["macro_f1"]
            >= r["target"]
            > max(p["macro_f1"] for p in ours["curve"][:-1] or [point(0, 0, -1)])
        )
        assert (r["seconds_to_target"], r["samples_to_target"]) == (seconds[-1], ours["samples"])
        assert r["ratio"] == pytest.approx(seconds[-1] / theirs["train_seconds"])
    else:
        assert ours["stop"] == "time budget" and r["seconds_to_target"] is r["samples_to_target"] is r["ratio"] is None
    assert "time to the Trainer's final macro-F1" in capsys.readouterr().out


def test_a_missing_profile_is_one_line(tmp_path, capsys):
    assert main(["hf-tuned", "--profile", str(tmp_path / "none.yaml")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"benchmarks: error: {tmp_path / 'none.yaml'}: no such profile; fix: give --profile the YAML that `raytrm "
        "tune` wrote"
    )
