"""Honest summaries: the warm-up apart from the steady rate, why the run stopped (Ctrl-C and SIGTERM end it with a
checkpoint and a summary), and the learning rate the size rule gives when flags move the embedded default."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from raytrm.cli import format_summary
from raytrm.families import family
from raytrm.train.loop import Hook
from raytrm.train.run.experiment import resolve_experiment
from raytrm.train.run.recording import StepTimes
from raytrm.train.run.size_rule import size_rule
from raytrm.train.run.training import run_training


class _Loop:
    """What StepTimes reads of a loop."""

    def __init__(self) -> None:
        self.step_end, self.probing, self.t = 0.0, False, 100.0

    def clock(self) -> float:
        return self.t


class _Step:
    def __init__(self, seconds: float) -> None:
        self.result = type("R", (), {"seconds": seconds, "samples": 64})()


def _times(steps: list[tuple[float, bool]]) -> StepTimes:
    times, loop = StepTimes(started=98.5), _Loop()
    times.start(loop)
    for seconds, probing in steps:
        loop.step_end += seconds
        loop.probing = probing
        times.end_step(loop, _Step(seconds))
    return times


def test_the_warmup_is_the_probe_and_the_slow_first_steps():
    # two probing steps, then a compiled step still slow, then steady steps of 0.1 s
    times = _times([(30.0, True), (0.05, True), (5.0, False), *[(0.1, False)] * 10])
    summary = times.summary()
    assert summary["setup_seconds"] == 1.5 and summary["warmup_steps"] == 3 and summary["steady_steps"] == 10
    assert summary["warmup_seconds"] == pytest.approx(35.05)
    assert summary["steady_samples_per_sec"] == pytest.approx(640.0)


def test_without_a_probe_the_first_step_is_warmup_and_a_run_of_one_step_has_no_steady_rate():
    assert _times([(2.0, False), (1.0, False), (1.1, False)]).summary()["warmup_steps"] == 1
    one = _times([(2.0, False)]).summary()
    assert (one["warmup_steps"], one["steady_steps"], one["steady_samples_per_sec"]) == (1, 0, None)


def test_the_summary_separates_the_warmup_and_says_why_the_run_stopped(tiny, tmp_path):
    summary = run_training(tiny(training={"steps": 4}), tmp_path)
    assert summary["stop_reason"] == "steps reached (4)"
    assert summary["warmup_steps"] + summary["steady_steps"] == 4 and summary["steady_samples_per_sec"] > 0
    text = format_summary(summary, tmp_path)
    first, rates = text.splitlines()[:2]
    assert first.startswith("trained 4 steps in ") and first.endswith(", stopped: steps reached (4)")
    assert rates.startswith("warm-up ") and f"then {summary['steady_samples_per_sec']:.1f} samples/s over" in rates


class _Signal(Hook):
    """Sends this process a signal after a step."""

    def __init__(self, sig: int, at: int) -> None:
        self.sig, self.at = sig, at

    def end_step(self, loop, step):
        if loop.trainer.step == self.at:
            os.kill(os.getpid(), self.sig)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_ends_the_run_with_a_checkpoint_and_a_summary(tiny, tmp_path, monkeypatch, sig):
    import raytrm.train.run.training as run

    real_loop = run.Loop
    monkeypatch.setattr(run, "Loop", lambda trainer, hooks, **kw: real_loop(trainer, [*hooks, _Signal(sig, 2)], **kw))
    previous = signal.getsignal(sig)
    summary = run_training(tiny(training={"steps": 50}), tmp_path)
    assert summary["stop_reason"] == f"interrupted ({signal.Signals(sig).name})" and summary["steps"] == 2
    assert summary["checkpoint"].endswith("step-00000002.ckpt") and (tmp_path / "summary.json").is_file()
    assert signal.getsignal(sig) is previous  # the handler is the caller's again


def test_the_size_rule_sets_lr_when_flags_move_the_default(caplog):
    anchor = family("trm").anchor
    with caplog.at_level(logging.INFO, logger="raytrm.train.run.experiment"):
        wide, _ = resolve_experiment(
            config_file=None,
            profile_file=None,
            out=None,
            resume=False,
            overrides={"model": {"hidden_size": 512, "variant": "attention"}},
        )
    lr, warmup, _ = size_rule(wide.model)
    assert wide.training.lr == lr < anchor.lr and wide.training.warmup_steps == warmup
    assert any("size rule" in r.getMessage() and "model.hidden_size" in r.getMessage() for r in caplog.records)
    default, _ = resolve_experiment(config_file=None, profile_file=None, out=None, resume=False, overrides={})
    assert default.training.lr == anchor.lr  # no flags: the default as it is
    given, _ = resolve_experiment(
        config_file=None,
        profile_file=None,
        out=None,
        resume=False,
        overrides={"model": {"hidden_size": 512}, "training": {"lr": 2e-3}},
    )
    assert given.training.lr == 2e-3  # --lr always wins


def test_a_config_file_keeps_its_lr(tiny, tmp_path):
    from raytrm import config as cfg

    path = cfg.write_yaml(tiny(), tmp_path / "tiny.yaml")
    experiment, _ = resolve_experiment(
        config_file=str(path), profile_file=None, out=None, resume=False, overrides={"model": {"hidden_size": 64}}
    )
    assert experiment.training.lr == 3e-3
