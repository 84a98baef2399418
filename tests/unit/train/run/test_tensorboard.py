"""TensorBoard event files of a training run hold the scalars of metrics.jsonl; without tensorboard nothing changes."""

from __future__ import annotations

import logging
import time

import pytest

from raytrm.train.run import tensorboard
from raytrm.train.run.metrics import MetricsLog, read_metrics
from raytrm.train.run.training import run_training


def event_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / tensorboard.TENSORBOARD_DIR))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_run_writes_the_scalars_of_metrics_jsonl(tiny, tmp_path):
    pytest.importorskip("tensorboard", reason="the optional tensorboard extra is not installed")
    run = tmp_path / "run"
    run_training(tiny(training={"steps": 3, "eval_interval": 3, "memory_budget_mb": 8192}), run)
    lines = [r for r in read_metrics(run / "metrics.jsonl") if "event" not in r]
    scalars = event_scalars(run)
    for key, name in (
        ("loss", "train/loss"),
        ("samples_per_sec", "throughput/samples_per_sec"),
        ("rss_mb", "memory/rss_mb"),
        ("eval_cell_acc", "eval/cell_acc"),
    ):
        expected = [(r["step"], r[key]) for r in lines if r.get(key) is not None]
        assert [step for step, _ in scalars[name]] == [step for step, _ in expected], name
        assert [v for _, v in scalars[name]] == pytest.approx([v for _, v in expected], rel=1e-6), name


def test_worker_rows_and_thermal_state_become_scalars():
    record = {
        "step": 4,
        "loss": 1.5,
        "accuracy": None,
        "thermal_state": "serious",
        "workers": [{"rank": 1, "share": 12, "compute_s": 0.7, "sync_s": 0.3, "share_cap": None}],
    }
    assert tensorboard.scalars(record) == {
        "train/loss": 1.5,
        "system/thermal_state": 2.0,
        "worker1/share": 12.0,
        "worker1/compute_s": 0.7,
        "worker1/sync_s": 0.3,
        "worker1/sync_share": pytest.approx(0.3),
    }


def test_a_classifiers_confusion_and_labels_are_no_scalars():
    record = {"step": 8, "eval_accuracy": 0.75, "eval_confusion": [[3, 1], [1, 3]], "eval_labels": ["neg", "pos"]}
    assert tensorboard.scalars(record) == {"eval/accuracy": 0.75}


def test_a_resume_replaces_the_steps_past_it(tmp_path):
    pytest.importorskip("tensorboard", reason="the optional tensorboard extra is not installed")
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(1, 6):
        log.write({"step": step, "loss": float(step)})
    log.close()
    # TensorBoard reads event files in name order: time in seconds, host, pid, then a per-process counter, so two
    # files of one process in one second sort by that counter (10 before 9). A resumed run is a new process; here
    # the next second stands for it.
    time.sleep(1.05)
    # Killed after step 5, resumed from the checkpoint of step 3: steps 4 and 5 are trained again.
    log = MetricsLog(tmp_path / "metrics.jsonl", resume_step=3)
    for step in (4, 5):
        log.write({"step": step, "loss": 10.0 * step})
    log.close()
    expected = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert expected == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    assert event_scalars(tmp_path)["train/loss"] == expected


def test_without_tensorboard_nothing_is_written_or_said(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tensorboard, "available", lambda: False)
    with caplog.at_level(logging.DEBUG):
        log = MetricsLog(tmp_path / "metrics.jsonl")
        log.write({"step": 1, "loss": 1.0})
        log.close()
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
