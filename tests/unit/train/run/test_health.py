"""Training health: each detector fires on a scripted history and stays quiet on healthy ones (scripted and
recorded from real runs); the warning line, the metrics event and the report's diagnosis carry the same fix; a
trial that is not learning is recorded as such; the early stop; the gradient norm and update ratio a step reports."""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path

import pytest
import torch

from raytrm import config as cfg
from raytrm.constants import CACHE_DIR_ENV
from raytrm.report import diagnose, load_run
from raytrm.train.run import health
from raytrm.train.run.health import Context, Finding, HealthMonitor
from raytrm.train.run.metrics import read_metrics
from raytrm.train.run.training import METRICS_FILE, run_training
from raytrm.train.trainer import StepResult, Trainer
from raytrm.tune import objectives
from raytrm.tune.trial import measure

LN9 = math.log(9)
HISTORIES = Path(__file__).resolve().parents[3] / "fixtures" / "health"


def _context(**changes) -> Context:
    values = dict(entropy=LN9, chance=1 / 9, classes=9, lr=3e-3, warmup_steps=20, suggested_lr=3.75e-4)
    return Context(**{**values, **changes})


def _run(monitor: HealthMonitor, history) -> list[Finding]:
    """Feed (loss, accuracy, grad_norm) per step, from step 1; every finding."""
    found = []
    for step, (loss, accuracy, grad) in enumerate(history, start=1):
        found += monitor.observe(step, loss, accuracy, grad)
    return found


def _healthy(steps: int = 400, seed: int = 0) -> list[tuple[float, float, float]]:
    """A loss falling from ln 9 towards 0.3, noisy, with accuracy rising and a steady gradient norm."""
    rng = random.Random(seed)
    out = []
    for s in range(steps):
        loss = 0.3 + (LN9 - 0.3) * math.exp(-s / 60)
        out.append((loss * (1 + rng.gauss(0, 0.03)), 1 - loss / LN9 * 8 / 9, 0.5 * (1 + rng.gauss(0, 0.2))))
    return out


def test_a_healthy_history_raises_nothing():
    assert _run(HealthMonitor(_context()), _healthy()) == []


@pytest.mark.parametrize("name", sorted(p.stem for p in HISTORIES.glob("*.json")))
def test_histories_of_real_runs_that_learned_raise_nothing(name):
    """Per-step histories recorded from real runs of the embedded defaults (docs/performance.md says how)."""
    record = json.loads((HISTORIES / f"{name}.json").read_text())
    context = _context(**record["context"])
    assert _run(HealthMonitor(context), record["steps"]) == []


def test_not_learning_fires_after_the_warmup_and_names_the_values_of_the_run():
    rng = random.Random(1)
    history = [(LN9 + rng.gauss(0, 0.005), 1 / 9 + rng.gauss(0, 0.005), 0.1) for _ in range(100)]
    found = _run(HealthMonitor(_context()), history)
    assert [f.kind for f in found] == ["not-learning"]
    (f,) = found
    assert f.step == 20 + 40  # 40 steps in a row after the 20 of the warm-up
    assert "loss has sat at ln(9)=2.197 for 40 steps" in f.reason and "predicts uniformly" in f.reason
    assert f.fix == (
        "lower training.lr (now 0.003; the size rule gives 0.00038 for this model) or raise training.warmup_steps "
        "(now 20)"
    )


def test_a_run_that_leaves_the_entropy_in_time_is_not_called_not_learning():
    history = [(LN9 + 0.001 * (s % 3), 1 / 9, 0.1) for s in range(55)] + _healthy(200)[40:]
    assert _run(HealthMonitor(_context()), history) == []


def test_non_finite_fires_once():
    history = _healthy(50) + [(math.nan, None, math.inf)] * 10
    found = _run(HealthMonitor(_context(dtype="bfloat16")), history)
    assert [(f.kind, f.step) for f in found] == [("non-finite", 51)]
    assert "loss is nan at step 51 (gradient norm inf)" in found[0].reason
    assert "train in float32 (training.dtype, now bfloat16)" in found[0].fix


def test_an_absurd_loss_inside_the_warmup_fires_once_at_its_step():
    history = _healthy(100)
    history[1] = (367.0, 0.05, 40.0)  # step 2, inside the 20 steps of the warm-up
    found = _run(HealthMonitor(_context(outputs=11)), history)
    assert [(f.kind, f.step) for f in found] == [("absurd-loss", 2)]
    assert found[0].reason == (
        "loss is 367 at step 2, 153 times ln(11)=2.398, a uniform guess: an update blew the weights up inside the lr "
        "warm-up"
    )
    assert found[0].fix == (
        "lower training.lr (now 0.003; the size rule gives 0.00038 for this model), clip the gradient "
        "(training.grad_clip, now off; 1.0 is usual)"
    )
    (clipped,) = _run(HealthMonitor(_context(outputs=11, grad_clip=1.0)), history)
    assert clipped.fix == "lower training.lr (now 0.003; the size rule gives 0.00038 for this model)"


def test_an_absurd_loss_is_ten_times_a_uniform_guess_or_the_labels_entropy_where_the_outputs_are_unknown():
    quiet = _healthy(30)
    quiet[0] = (10 * math.log(11) - 0.01, 0.05, 1.0)
    assert _run(HealthMonitor(_context(outputs=11)), quiet) == []
    (found,) = _run(HealthMonitor(_context()), [(10 * LN9 + 0.01, 0.05, 1.0), *_healthy(30)])
    assert found.reason.startswith("loss is 22 at step 1, 10 times ln(9)=2.197, the labels' frequencies, before any ")
    assert found.fix.startswith("check the checkpoint it resumed from (--resume)")


def _measured(ratio: float, steps: int = 60, every: int = 10) -> list[tuple[float, float, float, float | None]]:
    """A healthy history whose every `every`-th step measured this update ratio."""
    return [(*row, ratio if s % every == 0 else None) for s, row in enumerate(_healthy(steps), start=1)]


def _run_measured(monitor: HealthMonitor, history, lrs=None) -> list[Finding]:
    found = []
    for step, (loss, accuracy, grad, ratio) in enumerate(history, start=1):
        lr = lrs(step) if lrs else None
        found += monitor.observe(step, loss, accuracy, grad, update_ratio=ratio, lr=lr)
    return found


def test_weights_that_do_not_move_are_frozen_after_three_measured_steps_with_the_fix():
    found = _run_measured(HealthMonitor(_context(lr=1e-12, suggested_lr=3e-3)), _measured(2e-11))
    assert [(f.kind, f.step) for f in found] == [("frozen", 30)]
    assert found[0].reason.startswith(
        "the updates moved the weights by at most 2e-11 of their norm a step over 3 measured steps (10 to 30) at lr "
        "1e-12 (gradient norm "
    )
    assert found[0].reason.endswith("under a float32 weight's rounding (6e-08): the loss cannot move")
    assert found[0].fix == "raise training.lr (--lr): 1e-12 is far below the size rule's 0.003 for this model"


def test_a_small_update_inside_the_warmup_or_at_the_end_of_a_schedule_is_not_frozen():
    # A 1000-step warm-up's first steps move the weights little; at the configured lr they would move enough.
    warmup = HealthMonitor(_context(warmup_steps=1000))
    assert _run_measured(warmup, _measured(1e-8), lrs=lambda step: 3e-3 * step / 1000) == []
    # A cosine schedule down to 0 ends on a step that updates nothing: its lr says why.
    assert _run_measured(HealthMonitor(_context()), _measured(0.0), lrs=lambda step: 0.0) == []
    # A measured step that moves breaks the row.
    history = _measured(1e-11)
    history[19] = (*history[19][:3], 1e-3)
    assert _run_measured(HealthMonitor(_context()), history[:40]) == []  # 10, then 30 and 40: two in a row


def test_a_loss_that_does_not_move_by_more_than_rounding_is_frozen():
    history = [(2.5 * (1 + 1e-7 * (s % 2)), 0.1, 0.4) for s in range(30)]
    found = _run(HealthMonitor(_context(warmup_steps=100, lr=3e-3, suggested_lr=3e-3)), history)
    assert [(f.kind, f.step) for f in found] == [("frozen", 20)]
    assert found[0].reason == (
        "loss has stayed at 2.5 (within 1e-07 of itself) for 20 steps up to step 20 (gradient norm 0.4): the weights "
        "are not moving"
    )
    assert found[0].fix == "raise training.lr (--lr, now 0.003; the size rule gives 0.003 for this model)"
    # A zero gradient is the cause where there is one; a loss at 0 is learned, not frozen.
    (zero,) = _run(HealthMonitor(_context()), [(2.5, 0.1, 0.0)] * 20)
    assert zero.fix == "the loss sends no gradient to the weights: check the data's labels and the model"
    assert _run(HealthMonitor(_context()), [(0.0, 1.0, 0.0)] * 40) == []


def test_a_loss_spike_and_a_gradient_spike():
    steady = [(1.0 + 0.01 * (s % 3), 0.5, 1.0) for s in range(60)]
    found = _run(HealthMonitor(_context()), [*steady, (3.0, 0.5, 1.0), *steady])
    assert [(f.kind, f.step) for f in found] == [("spike", 61)]
    assert "loss jumped to 3 at step 61, against a median of 1.01" in found[0].reason
    assert found[0].fix.startswith("clip the gradient (training.grad_clip, now off; 1.0 is usual)")
    found = _run(HealthMonitor(_context()), [*steady, (1.0, 0.5, 50.0)])
    assert [f.kind for f in found] == ["spike"] and "gradient norm 50, median 1" in found[0].reason


def test_a_rising_loss():
    falling = [(2.0 - s / 100, 0.5, 1.0) for s in range(100)]
    rising = [(1.0 + s / 50, 0.4, 1.0) for s in range(100)]
    found = _run(HealthMonitor(_context()), falling + rising)
    assert [f.kind for f in found] == ["rising"]
    assert "loss rose from" in found[0].reason and "training.schedule: cosine" in found[0].fix


def test_a_plateau_and_its_early_stop_text():
    history = _healthy(120) + [(0.62 + 0.001 * (s % 3), 0.8, 0.5) for s in range(300)]
    found = _run(HealthMonitor(_context(plateau_steps=200)), history)
    assert [f.kind for f in found] == ["plateau"]
    assert "less than 1% down: a plateau at lr 0.003" in found[0].reason
    assert found[0].fix.endswith("training.early_stop ends a run here")
    (stopped,) = _run(HealthMonitor(_context(plateau_steps=200, early_stop=True)), history)
    assert stopped.fix.endswith("the run stops here (training.early_stop)")


def test_the_labels_entropy_and_chance_of_sudoku(tiny):
    trainer = Trainer(tiny())
    entropy, chance, classes = health.label_baseline(trainer.train_data)
    trainer.close()
    assert classes == 9 and entropy == pytest.approx(LN9, rel=1e-2) and chance == pytest.approx(1 / 9, abs=0.01)


def _stuck_at_the_entropy(monkeypatch) -> None:
    """Steps that report a loss at ln 9 and chance accuracy, as a run with too high an lr does: each batch's loss a
    little apart (a loss the same to rounding at every step is frozen)."""

    def train_step(self, batch=None, on_out_of_memory=None):
        self.step += 1
        self.samples_seen += self.global_batch
        self.samples_seen_this_run += self.global_batch
        loss = LN9 + 0.001 * (self.step % 3)
        metrics = {"lm_loss": loss, "accuracy": 1 / 9}
        return StepResult(self.step, loss + 0.001, metrics, 0.01, self.global_batch, grad_norm=0.2)

    monkeypatch.setattr(Trainer, "train_step", train_step)


def test_the_warning_the_event_and_the_report_carry_the_same_fix(tiny, tmp_path, monkeypatch, caplog):
    _stuck_at_the_entropy(monkeypatch)
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="raytrm.train.run.health"):
        summary = run_training(tiny(training={"steps": 60, "log_interval": 10}), run)
    assert summary["stop_reason"] == "steps reached (60)"  # warned, not stopped: early_stop is off
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "raytrm.train.run.health"]
    events = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]
    (event,) = [e for e in events if e.get("event") == "health-not-learning"]
    assert event["step"] == 2 + 40 and warning == f"step 42: {event['reason']}; {event['fix']}"
    (finding,) = [f for f in diagnose(load_run(run)) if f.name == "not learning"]
    assert finding.fix == event["fix"] and event["reason"] in finding.measured
    # 32 wide, the size rule would give more than 0.003: the fix suggests a third instead
    assert event["fix"] == "lower training.lr (now 0.003; try 0.001) or raise training.warmup_steps (now 2)"


def test_early_stop_ends_a_run_that_is_not_learning_with_its_evaluation_and_checkpoint(tiny, tmp_path, monkeypatch):
    _stuck_at_the_entropy(monkeypatch)
    summary = run_training(tiny(training={"steps": 500, "early_stop": True}), tmp_path)
    assert summary["steps"] == 42 and summary["stop_reason"] == "early stop: not learning"
    assert "eval_cell_acc" in summary and summary["checkpoint"].endswith("step-00000042.ckpt")


def test_a_trial_that_is_not_learning_is_recorded_as_such(tiny, monkeypatch):
    _stuck_at_the_entropy(monkeypatch)
    result = measure(
        cfg.to_dict(tiny()),
        warmup_s=0.0,
        measure_s=600.0,
        memory_budget_mb=None,
        thermal_cap=None,
        max_throughput_decay=1.0,
        eval_puzzles=16,
    )
    assert result["status"] == "not_learning" and result["steps"] == 42
    assert result["health"][0]["event"] == "health-not-learning"
    constraints = objectives.constraints(result)
    assert constraints["learning"] == 1.0 and not objectives.is_feasible(constraints)


def test_a_run_at_lr_1e_12_warns_that_its_weights_are_frozen_and_the_report_says_so(tiny, tmp_path, caplog):
    run = tmp_path / "run"
    config = tiny(training={"steps": 3, "lr": 1e-12})  # every step logged, so measured
    with caplog.at_level(logging.WARNING, logger="raytrm.train.run.health"):
        run_training(config, run)
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "raytrm.train.run.health"]
    assert warning.startswith("step 3: the updates moved the weights by at most ")
    assert "over 3 measured steps (1 to 3) at lr 1e-12" in warning
    assert warning.endswith("raise training.lr (--lr): 1e-12 is far below the size rule's 0.003 for this model")
    (finding,) = [f for f in diagnose(load_run(run)) if f.name == "weights frozen"]
    assert finding.fix.endswith("far below the size rule's 0.003 for this model") and "(step 3)" in finding.measured


def test_a_trial_whose_weights_are_frozen_stops_as_not_learning(tiny, monkeypatch):
    """A trial writes no metrics rows: the health check measures the update every UPDATE_EVERY steps itself."""
    monkeypatch.setattr(health, "UPDATE_EVERY", 1)
    result = measure(
        cfg.to_dict(tiny(training={"lr": 1e-12})),
        warmup_s=0.0,
        measure_s=600.0,
        memory_budget_mb=None,
        thermal_cap=None,
        max_throughput_decay=1.0,
        eval_puzzles=16,
    )
    assert result["status"] == "not_learning" and result["steps"] == 3
    assert [e["event"] for e in result["health"]] == ["health-frozen"]


@pytest.mark.slow
def test_the_embedded_default_at_lr_1e_12_is_frozen_by_step_30(tmp_path, monkeypatch, capsys):
    """`raytrm train --steps 30 --lr 1e-12`: the update measured on the logged steps 10, 20 and 30."""
    from raytrm.cli import main

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    run = tmp_path / "run"
    assert main(["train", "--steps", "30", "--lr", "1e-12", "--quiet", "--out", str(run)]) == 0
    events = [e for e in read_metrics(run / METRICS_FILE) if str(e.get("event", "")).startswith("health-")]
    assert [(e["event"], e["step"]) for e in events] == [("health-frozen", 30)]
    assert "over 3 measured steps (10 to 30) at lr 1e-12" in events[0]["reason"]
    assert events[0]["fix"] == "raise training.lr (--lr): 1e-12 is far below the size rule's 0.003 for this model"


def test_a_step_reports_the_gradient_norm_before_clipping_and_the_update_ratio(tiny):
    trainer = Trainer(tiny(training={"grad_clip": 1e-3}))
    trainer.forward_backward()
    params = [p for p in trainer.model.parameters() if p.grad is not None]
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    before = [p.detach().clone() for p in params]
    trainer.watch_update = True
    trainer.optimizer_step()
    assert float(trainer._grad_norm) == pytest.approx(float(expected), rel=1e-5) and float(expected) > 1e-3
    update = torch.linalg.vector_norm(
        torch.stack([(p.detach() - b).norm() for p, b in zip(params, before, strict=True)])
    )
    weights = torch.linalg.vector_norm(torch.stack([p.detach().norm() for p in params]))
    assert float(trainer._update_ratio) == pytest.approx(float(update / weights), rel=1e-4)
    trainer.watch_update = False
    result = trainer.train_step()
    trainer.close()
    assert result.grad_norm is not None and result.grad_norm > 0 and result.update_ratio is None


def test_a_finding_reads_back_from_its_event():
    finding = Finding("plateau", 7, "loss went flat", "decay the lr")
    assert Finding.from_event(finding.event()) == finding
    assert Finding.from_event({"step": 3, "event": "shrink"}) is None
