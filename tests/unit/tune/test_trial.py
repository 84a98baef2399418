"""One trial in this process (no Ray): what it measures, its intermediate evaluations, and both model families."""

from __future__ import annotations

from raytrm import config as cfg
from raytrm.tune import objectives
from raytrm.tune.space import build_experiment, load_space
from raytrm.tune.trial import measure


def _run(experiment: dict, evaluations: int) -> tuple[dict, list[dict]]:
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
        report=partials.append,
    )
    return result, partials


def test_a_trm_trial_reports_its_evaluations_before_the_end_and_measures_the_window():
    space = load_space("quick")
    experiment = cfg.to_dict(build_experiment(space.base, {"model.H_cycles": 1, "model.L_cycles": 1}))
    experiment["training"]["threads"] = 1
    result, partials = _run(experiment, evaluations=3)
    assert result["status"] == "ok" and result["final"] is True and result["evaluation"] == 3
    assert [p["evaluation"] for p in partials] == [1, 2] and all(p["final"] is False for p in partials)
    assert all(0 <= p["quality"] <= 1 and p["samples_per_sec"] > 0 for p in partials)
    # Evaluation time is off the clock: the window the throughput is measured over is the budget's.
    assert 1.2 <= result["measure_seconds"] < 1.2 + 1.0 and result["samples_per_sec"] > 0
    assert "tokens_per_sec" not in result


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
