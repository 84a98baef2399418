"""One trial in this process (no Ray): what it measures, its intermediate evaluations, and both model families."""

from __future__ import annotations

import pytest

from raytrm import config as cfg
from raytrm.train.trainer import Trainer
from raytrm.tune import objectives
from raytrm.tune.space import build_experiment, load_space
from raytrm.tune.trial import measure


class StepClock:
    """A clock that moves only with training steps (step_s each): evaluations take no time on it, and a loaded
    machine cannot change how many steps fall in a window."""

    def __init__(self, monkeypatch, step_s: float = 0.1) -> None:
        self.t = 0.0
        train_step = Trainer.train_step

        def timed(trainer, *args, **kwargs):
            out = train_step(trainer, *args, **kwargs)
            self.t += step_s
            return out

        monkeypatch.setattr(Trainer, "train_step", timed)

    def __call__(self) -> float:
        return self.t


def _run(
    experiment: dict, evaluations: int, horizon: dict | None = None, clock: StepClock | None = None
) -> tuple[dict, list[dict]]:
    partials: list[dict] = []
    result = measure(
        experiment,
        warmup_s=0.2,
        measure_s=1.2,
        memory_budget_mb=None,
        thermal_cap=None,
        max_throughput_decay=1.0,
        eval_puzzles=16,
        evaluations=evaluations,
        horizon=horizon,
        report=partials.append,
        **({"clock": clock} if clock else {}),
    )
    return result, partials


@pytest.mark.slow
def test_a_trm_trial_reports_its_evaluations_before_the_end_and_measures_the_window(monkeypatch):
    space = load_space("quick")
    experiment = cfg.to_dict(build_experiment(space.base, {"model.H_cycles": 1, "model.L_cycles": 1}))
    experiment["training"]["threads"] = 1
    result, partials = _run(experiment, evaluations=3, clock=StepClock(monkeypatch, 0.1))
    assert result["status"] == "ok" and result["final"] is True and result["evaluation"] == 3
    assert [p["evaluation"] for p in partials] == [1, 2] and all(p["final"] is False for p in partials)
    assert all(0 <= p["quality"] <= 1 and p["samples_per_sec"] > 0 for p in partials)
    # 2 steps of warm-up, then a 1.2 s window of 12 steps of 0.1 s, the evaluations at 0.4 and 0.8 s of it.
    assert result["steps"] == 14 and result["measure_seconds"] == pytest.approx(1.2)
    assert result["samples_per_sec"] == pytest.approx(12 * 32 / 1.2)
    assert "tokens_per_sec" not in result


@pytest.mark.slow
def test_a_language_model_trial_measures_tokens_per_second_and_throughput_counts_them(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(3000)))
    experiment = {
        "model": {"name": "transformer", "hidden_size": 32, "num_heads": 2, "layers": 1, "seq_len": 32},
        "data": {"name": "text", "path": str(corpus)},
        "training": {"global_batch_size": 8, "threads": 1, "lr": 1e-3, "warmup_steps": 2},
    }
    result, _ = _run(experiment, evaluations=1)
    assert result["status"] == "ok", result.get("error")
    assert result["tokens_per_sec"] == result["samples_per_sec"] * 32 > 0
    assert objectives.objective_values(result, "throughput") == [result["tokens_per_sec"]]


@pytest.mark.slow
def test_with_a_horizon_the_trial_trains_to_it_and_is_evaluated_at_its_rungs():
    space = load_space("quick")
    experiment = cfg.to_dict(build_experiment(space.base, {"model.H_cycles": 1, "model.L_cycles": 1}))
    experiment["training"].update(threads=1, global_batch_size=32, micro_batch_size=32)
    result, partials = _run(experiment, evaluations=3, horizon={"samples": 576})
    assert result["status"] == "ok", result.get("error")
    # Evaluated at a ninth and a third of the horizon (numbered in ninths, as a successive-halving pruner counts),
    # then at the horizon: 576 samples are 18 steps of 32.
    assert [(p["evaluation"], p["horizon_share"]) for p in partials] == [(1, 1 / 9), (3, 1 / 3)]
    assert result["evaluation"] == 9 and result["final"] is True
    curve = result["curve"]
    assert [p["samples"] for p in curve] == [64, 192, 576] and result["horizon_samples"] == 576
    assert [p["quality"] for p in partials] == [p["quality"] for p in curve[:2]]
    assert result["quality"] == curve[-1]["quality"] and all(p["stderr"] > 0 for p in curve)
    assert result["steps"] == 18 and result["samples_per_sec"] > 0


@pytest.mark.slow
def test_a_horizon_in_minutes_is_training_time_without_the_evaluations(monkeypatch):
    space = load_space("quick")
    experiment = cfg.to_dict(build_experiment(space.base, {"model.H_cycles": 1, "model.L_cycles": 1}))
    experiment["training"].update(threads=1, global_batch_size=32, micro_batch_size=32)
    result, partials = _run(experiment, evaluations=2, horizon={"minutes": 0.03}, clock=StepClock(monkeypatch))
    assert result["status"] == "ok", result.get("error")
    # 1.8 s of training are 18 steps of 0.1 s, evaluated at a third (step 6) and at the end.
    assert [p["evaluation"] for p in partials] == [1] and result["evaluation"] == 3
    assert [p["samples"] for p in result["curve"]] == [6 * 32, 18 * 32] and result["steps"] == 18
    # The window runs from the end of the 0.2 s warm-up to the horizon.
    assert result["measure_seconds"] == pytest.approx(1.6)


# A finalizer raises what Ray's SIGTERM handler raises when the signal lands while it runs, or another error.
UNRAISABLE = """
import sys, weakref
from raytrm.tune.trial import ExitRequests
sys.unraisablehook = ExitRequests(sys.unraisablehook)
class Thing: pass
def finalizer(_):
    raise {error}
thing = Thing()
ref = weakref.ref(thing, finalizer)
del thing
print("went on", flush=True)
"""


def test_an_exit_raised_in_a_finalizer_exits_quietly_and_other_errors_still_print():
    import subprocess
    import sys

    def run(error: str) -> subprocess.CompletedProcess:
        code = UNRAISABLE.format(error=error)
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)

    stopped = run("SystemExit(3)")
    assert (stopped.returncode, stopped.stdout, stopped.stderr) == (3, "", "")
    other = run("ValueError('kept')")
    assert other.returncode == 0 and other.stdout == "went on\n"
    assert "Exception ignored" in other.stderr and "ValueError: kept" in other.stderr
