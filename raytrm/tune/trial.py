"""One tuning trial: the plain Trainer, run for a warm-up and a measured window, then a small evaluation.

A trial measures one thing (DESIGN.md invariant 4): sustained samples/s after warm-up, the peak memory of its steps
(PeakMemory: the kernel's high-water mark on Linux), the hottest thermal state seen ("unknown" without a sensor),
the throughput decay from the start to the end of the window, and the validation quality at the end of its budget.
Before the full micro-batch runs, two probe steps at a quarter and a half of it fit the memory model; a predicted
peak over the budget stops the trial as over budget, with the prediction, rather than letting the kernel kill it.
A trial that fails reports what it measured and status "failed": it never vanishes.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrm import config as cfg
from raytrm.config import THERMAL_STATES

logger = logging.getLogger(__name__)

MiB = 2**20
PROBE_MIN_MICRO = 4  # below this the probe steps would cost more than they tell
PROGRESS_S = 5.0  # seconds between a trial's progress reports in its measured window


def resolve_for_node(experiment: dict[str, Any], limits: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fill what the node decides: threads and loader workers from its tier, and limits the tier table leaves open.

    The profile then records concrete values, so `raytrm train --profile` runs what the trial measured.
    """
    from raytrm.hardware.probe import detect
    from raytrm.hardware.tiers import match_tier
    from raytrm.train.defaults import tier_settings

    experiment, limits = copy.deepcopy(experiment), dict(limits)
    hw = detect()
    settings = tier_settings(match_tier(hw))
    training = experiment.setdefault("training", {})
    for key in ("threads", "interop_threads", "dataloader_workers"):
        if training.get(key) is None:
            training[key] = settings[key]
    for key in ("memory_budget_mb", "thermal_cap"):  # the trial's limits: the space's override, else the tier's
        limits[key] = limits.get(key) or settings[key]
    hardware = {
        "chip": hw.chip,
        "model": hw.model_name,
        "memory_gb": round(hw.memory_gb, 2),
        "device": hw.device,
        "performance_cores": hw.performance_cores,
        "efficiency_cores": hw.efficiency_cores,
    }
    return experiment, {**limits, "hardware": hardware}


def _hotter(a: str | None, b: str | None) -> str | None:
    known = [s for s in (a, b) if s in THERMAL_STATES]
    return max(known, key=THERMAL_STATES.index) if known else None


def measure(
    experiment: dict[str, Any],
    *,
    warmup_s: float,
    measure_s: float,
    memory_budget_mb: float | None,
    thermal_cap: str | None,
    max_throughput_decay: float,
    quality_metric: str = "eval_cell_acc",
    eval_puzzles: int | None = 64,
    decay_window: float = 0.25,
    evaluations: int = 1,
    horizon: dict[str, float] | None = None,
    evaluate_quality: bool = True,
    report: Callable[[dict[str, Any]], None] | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    thermal_reader: Any = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Train the experiment and return the trial's measurements (never raises).

    Without a horizon the trial trains for warm-up + measured window. With evaluations > 1 the window is evaluated
    at evenly spaced points before its end too, and each of those partial results goes to report (which a pruner may
    answer by stopping the trial). Evaluation time is taken off the clock, so every trial trains for the same
    wall-clock window whatever it evaluates. progress, if given, gets the window's measurements so far every
    PROGRESS_S (no evaluation), so a trial whose machine is lost mid-window is recorded with what it measured.

    With a horizon ({minutes: N} or {samples: N}: how long the user will train with the profile) the trial trains
    for the horizon itself, and its quality is the quality reached there: a 15-second trial favours the configs that
    learn fastest at first, which are not the ones that are best after the user's training (short-horizon bias).
    The evaluations sit at the rungs of raytrm.tune.curves.horizon_rungs (1/9, 1/3 and all of the horizon for
    three), each reported as evaluation 1, 3 and 9 (its share of the horizon in ninths), so a successive-halving
    pruner stops most trials at a ninth of the horizon and only the best reach its end. Every evaluation is a point
    of the trial's learning curve ("curve": samples seen, quality and its standard error). Throughput, memory and
    heat are measured over the whole run after the warm-up: a long window shows the heat a short one misses.

    evaluate_quality=False measures speed, memory and heat only (a speed trial: quality is left at 0).
    """
    from raytrm.hardware.thermal import ThermalReader
    from raytrm.train import memory as memory_model
    from raytrm.train.peak import PeakMemory
    from raytrm.train.trainer import Trainer
    from raytrm.tune.curves import horizon_rungs

    result: dict[str, Any] = {
        "status": "ok",
        "samples_per_sec": 0.0,
        "peak_memory_mb": 0.0,
        "predicted_memory_mb": None,
        "thermal_max": "unknown",
        "throughput_decay": 0.0,
        "quality": 0.0,
        "steps": 0,
        "memory_budget_mb": memory_budget_mb,
        "thermal_cap": thermal_cap,
        "max_throughput_decay": max_throughput_decay,
        "started_at": time.time(),
    }
    thermal = thermal_reader or ThermalReader()
    hottest: str | None = None
    trainer = None
    budget_bytes = memory_budget_mb * MiB if memory_budget_mb else math.inf
    off_clock = 0.0  # seconds spent evaluating, which the run's clock does not count
    # (share of the run, evaluation number) of each evaluation, the last at the run's end
    rungs = horizon_rungs(evaluations) if horizon else [((k + 1) / evaluations, k + 1) for k in range(evaluations)]
    curve: list[dict[str, Any]] = []

    def now() -> float:
        return clock() - off_clock

    start = now()
    peak = 0
    window: list[tuple[float, int]] = []  # (end time, samples) of each measured step
    warmup: list[tuple[float, int]] = []  # the same before the window (a horizon may end inside the warm-up)
    window_start: float | None = None

    def evaluate() -> dict[str, Any]:
        scores = _evaluate(trainer, config, micro, eval_puzzles, quality_metric)
        stderr = scores["eval"].get(f"{quality_metric}_se")
        point = {"samples": trainer.samples_seen, "seconds": now() - start, "quality": scores["quality"]}
        curve.append({**point, "stderr": stderr})
        return {**scores, "curve": list(curve)} if horizon else scores

    try:
        config = cfg.from_dict(cfg.ExperimentConfig, experiment, "<trial>")
        trainer = Trainer(config)
        micro = config.training.micro_batch
        start = now()  # the trainer is built: training starts

        def position(t: float) -> float:
            """How far through the run, 0 to 1."""
            if horizon and horizon.get("samples"):
                return trainer.samples_seen / horizon["samples"]
            if horizon:
                return (t - start) / (horizon["minutes"] * 60)
            return (t - window_start) / measure_s if window_start is not None else 0.0

        # Memory pre-check: fit the memory model on two small cuts of the same global batch (real training steps,
        # part of the warm-up), predict the asked micro-batch, and stop before a step the machine cannot hold.
        if memory_budget_mb and micro >= PROBE_MIN_MICRO:
            points = []
            for probe in (micro // 4, micro // 2):
                trainer.set_micro_batch(probe)
                with PeakMemory(trainer.device.type) as pm:
                    trainer.train_step()
                points.append((probe, pm.bytes))
                peak = max(peak, pm.bytes)
            predicted = memory_model.fit(points).predict(micro)
            result["predicted_memory_mb"] = predicted / MiB
            trainer.set_micro_batch(micro)
            if predicted > budget_bytes:
                result.update(status="over_budget", peak_memory_mb=predicted / MiB, steps=trainer.step)
                return result
        last_progress = 0.0
        evaluated = 0  # evaluations done before the run's end
        while True:
            t = now()
            if window_start is None and t - start >= warmup_s:
                window_start = last_progress = t
                hottest = _hotter(hottest, thermal.read().get("thermal_state"))
            if position(t) >= 1:
                break
            if (
                (report is not None or horizon)
                and evaluated + 1 < len(rungs)
                and position(t) >= rungs[evaluated][0]
                and (window_start is not None or horizon)
            ):
                paused = clock()
                partial = {**result, **_run_figures(window, window_start, warmup, start, peak, trainer, decay_window)}
                partial.update(evaluate())
                off_clock += clock() - paused
                if report is not None:
                    share = {"horizon_share": rungs[evaluated][0]} if horizon else {}
                    report({**partial, "evaluation": rungs[evaluated][1], "final": False, **share})
                evaluated += 1
            if progress is not None and window_start is not None and window and t - last_progress >= PROGRESS_S:
                last_progress = t
                progress(
                    {**result, **_window_figures(window, window_start, peak, trainer, decay_window), "final": False}
                )
            with PeakMemory(trainer.device.type) as pm:
                step = trainer.train_step()
            peak = max(peak, pm.bytes)
            (window if window_start is not None else warmup).append((now(), step.samples))
            if window_start is not None and len(window) % 10 == 0:
                hottest = _hotter(hottest, thermal.read().get("thermal_state"))
            if peak > budget_bytes:
                result["status"] = "over_budget"
                break
            if (
                hottest is not None
                and thermal_cap
                and THERMAL_STATES.index(hottest) > THERMAL_STATES.index(thermal_cap)
            ):
                result["status"] = "too_hot"  # stop: the constraint is violated and the machine should cool
                break
        hottest = _hotter(hottest, thermal.read().get("thermal_state"))
        result.update(_run_figures(window, window_start, warmup, start, peak, trainer, decay_window))
        if result["status"] == "ok" and evaluate_quality:
            result.update(evaluate())
            if horizon:
                result["horizon_samples"] = trainer.samples_seen
        result.update(evaluation=rungs[-1][1], final=True)
    except Exception as exc:  # a failed trial reports what it measured, with the reason, and the study goes on
        logger.warning("trial failed: %s: %s", type(exc).__name__, exc)
        if trainer is not None:  # what it measured before it failed is its measurement
            result.update(_run_figures(window, window_start, warmup, start, peak, trainer, decay_window))
        result.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        if trainer is not None:
            trainer.close()
    result["thermal_max"] = hottest or "unknown"
    result["ended_at"] = time.time()
    return result


def _run_figures(
    window: list[tuple[float, int]],
    window_start: float | None,
    warmup: list[tuple[float, int]],
    start: float,
    peak: int,
    trainer: Any,
    decay_window: float,
) -> dict[str, Any]:
    """The window's figures; a run that ended inside its warm-up is measured over all of it."""
    if window or not warmup:
        return _window_figures(window, window_start, peak, trainer, decay_window)
    return _window_figures(warmup, start, peak, trainer, decay_window)


def _window_figures(
    window: list[tuple[float, int]], window_start: float | None, peak: int, trainer: Any, decay_window: float
) -> dict[str, Any]:
    """samples/s, peak, decay and steps of the measured window so far."""
    end = window[-1][0] if window else window_start
    seconds = (end - window_start) if window_start is not None else 0.0
    samples_per_sec = sum(s for _, s in window) / max(seconds, 1e-9) if window else 0.0
    figures = {
        "samples_per_sec": samples_per_sec,
        "peak_memory_mb": peak / MiB,
        "throughput_decay": _decay(window, window_start, decay_window),
        "steps": trainer.step,
        "measure_seconds": seconds,
    }
    if trainer.tokens_per_sample:
        figures["tokens_per_sec"] = samples_per_sec * trainer.tokens_per_sample
    return figures


def _evaluate(
    trainer: Any, config: cfg.ExperimentConfig, micro: int, eval_puzzles: int | None, quality_metric: str
) -> dict[str, Any]:
    """Quality on a fixed number of held-out examples, whatever the micro-batch, so trials compare."""
    trainer.set_micro_batch(config.training.global_batch_size)
    batches = math.ceil(eval_puzzles / trainer.micro_batch) if eval_puzzles else None
    scores = trainer.evaluate(max_batches=batches)
    trainer.set_micro_batch(micro)
    return {"quality": float(scores.get(quality_metric, 0.0)), "eval": scores}


def _decay(window: list[tuple[float, int]], window_start: float | None, share: float) -> float:
    """Relative drop of samples/s from the first to the last `share` of the window (0 when too few steps)."""
    if window_start is None or len(window) < 4:
        return 0.0
    times = [window_start] + [t for t, _ in window]
    n = max(1, int(len(window) * share))
    first = sum(s for _, s in window[:n]) / max(times[n] - times[0], 1e-9)
    last = sum(s for _, s in window[-n:]) / max(times[-1] - times[-1 - n], 1e-9)
    return max(0.0, (first - last) / first) if first > 0 else 0.0


def run_trial(
    config: dict[str, Any],
    setup: dict[str, Any],
    report: Callable[[dict[str, Any]], None] | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """A trial from the searcher's config ({tier, trial_number, params}) and the study's fixed setup.

    report, if given, receives the partial result of each evaluation before the end, and progress the measurements
    so far every few seconds (see `measure`).
    """
    from raytrm.tune.space import build_experiment

    tier, params = config["tier"], config.get("params", {})
    # A learning trial of a staged search runs with its tier's fastest speed knobs (raytrm.tune.staged).
    speed = config.get("speed") or {}
    base = build_experiment(setup["base"], {**speed, **params}, "<trial>")  # validated before anything heavy starts
    experiment, limits = resolve_for_node(cfg.to_dict(base), setup["limits"].get(tier, {}))
    labels = {
        "tier": tier,
        "trial_number": config.get("trial_number"),
        "params": params,
        "stage": setup.get("stage"),
        "experiment": experiment,
        "hardware": limits["hardware"],
        **_node(),
    }
    measure_args = dict(setup["measure"])
    horizon = measure_args.get("horizon")
    if horizon and horizon.get("minutes") and config.get("stretch"):
        measure_args["horizon"] = {"minutes": horizon["minutes"] * config["stretch"]}
    result = measure(
        experiment,
        memory_budget_mb=limits["memory_budget_mb"],
        thermal_cap=limits["thermal_cap"],
        evaluations=setup["evaluations"],
        **measure_args,
        report=(lambda partial: report({**partial, **labels})) if report is not None else None,
        progress=(lambda partial: progress({**partial, **labels})) if progress is not None else None,
    )
    result.update(labels)
    return result


def _node() -> dict[str, str | None]:
    """The Ray node the trial runs on (its id, and the address that says which Mac), or Nones outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return {"node_id": ray.get_runtime_context().get_node_id(), "node_address": ray.util.get_node_ip_address()}
    except Exception:  # outside Ray (tests, the bench) there is no node
        pass
    return {"node_id": None, "node_address": None}


def tune_trainable(config: dict[str, Any], setup: dict[str, Any]) -> None:
    """The Ray Tune function trainable: one trial, one report, and a copy of the result in the run directory."""
    from ray import tune

    # Intermediate evaluations go out only where a pruner reads them; the Tune stopper may end the trial at one.
    # Progress always goes out: if this trial's machine leaves the cluster, its last report is what is recorded.
    pruned = setup.get("pruner", "none") != "none"
    result = run_trial(config, setup, report=tune.report if pruned else None, progress=tune.report)
    _save(result, setup.get("run_dir"))
    tune.report(result)


def result_name(stage: str | None, tier: str, number: int) -> str:
    """The file of a trial's result in the run directory: by tier, or by stage for a staged search's studies."""
    if stage == "learning":
        return f"learning-{number}.json"
    if stage == "speed":
        return f"{tier}-speed-{number}.json"
    return f"{tier}-{number}.json"


def _save(result: dict[str, Any], run_dir: str | None) -> None:
    """Keep the result beside the study, so a resume can record a trial whose driver died before it could."""
    if not run_dir or result.get("trial_number") is None:
        return
    path = Path(run_dir) / "trials" / result_name(result.get("stage"), result["tier"], result["trial_number"])
    try:
        cfg.write_text_atomic(json.dumps(result, default=str), path)
    except OSError as exc:  # another node's run directory may not be mounted here: the report still goes out
        logger.debug("could not keep the trial result in %s: %s", path, exc)
