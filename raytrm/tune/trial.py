"""One tuning trial: the plain Trainer in the one training loop, run for a warm-up and a measured window (or to a
horizon), then a small evaluation.

A trial measures one thing: sustained samples/s after warm-up, the peak memory of its steps (PeakMemory: the
kernel's high-water mark on Linux), the hottest thermal state seen ("unknown" without a sensor), the throughput
decay from the start to the end of the window, and the validation quality at the end of its budget
(raytrm.tune.window). With a memory budget the memory governor probes a quarter and a half of the micro-batch
first; a predicted peak over the budget stops the trial as over budget, with the prediction, rather than letting
the kernel kill it (raytrm.train.run.memory_budget). A trial whose health checks find it not learning (its loss at the
labels' entropy with chance accuracy, or non-finite: raytrm.train.run.health) stops with status "not_learning", an
infeasible point rather than a low quality. A trial that fails reports what it measured and status "failed": it
never vanishes.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrm import config as cfg

logger = logging.getLogger(__name__)

MiB = 2**20
PROGRESS_S = 5.0  # seconds between a trial's progress reports in its measured window


def resolve_for_node(experiment: dict[str, Any], limits: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fill what the node decides: threads and loader workers from its tier, and limits the tier table leaves open.

    The profile then records concrete values, so `raytrm train --profile` runs what the trial measured.
    """
    from raytrm.hardware.probe import detect
    from raytrm.hardware.tiers import match_tier
    from raytrm.train.run.experiment import tier_settings

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


def measure(
    experiment: dict[str, Any],
    *,
    warmup_s: float,
    measure_s: float,
    memory_budget_mb: float | None,
    thermal_cap: str | None,
    max_throughput_decay: float,
    quality_metric: str = "",
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
    from raytrm.tune.window import HeatCap, MeasuredWindow

    limits = {"memory_budget_mb": memory_budget_mb, "thermal_cap": thermal_cap}
    window = MeasuredWindow(warmup_s, measure_s, horizon, decay_window)
    trial = Measurement(
        limits,
        window,
        HeatCap(thermal_reader or ThermalReader(), thermal_cap, window),
        quality_metric=quality_metric,
        eval_puzzles=eval_puzzles,
        rungs=_rungs(evaluations, horizon, pruned=report is not None),
        horizon=horizon,
        report=report,
        progress=progress,
    )
    trial.result["max_throughput_decay"] = max_throughput_decay
    return trial.run(experiment, evaluate_quality, clock)


def _rungs(evaluations: int, horizon: dict[str, float] | None, pruned: bool) -> list[tuple[float, int]]:
    """(share of the run, evaluation number) of each evaluation, the last at the run's end; those before the end are
    for a pruner, or points of the curve to a horizon."""
    from raytrm.tune.curves import horizon_rungs

    rungs = horizon_rungs(evaluations) if horizon else [((k + 1) / evaluations, k + 1) for k in range(evaluations)]
    return rungs if pruned or horizon else rungs[-1:]


class Measurement:
    """One trial's run and what it measured (see `measure`): the result it fills as the run goes, the hooks that
    measure, and the evaluations, each a point of the learning curve."""

    def __init__(
        self,
        limits: dict[str, Any],
        window: Any,
        heat: Any,
        *,
        quality_metric: str,
        eval_puzzles: int | None,
        rungs: list[tuple[float, int]],
        horizon: dict[str, float] | None,
        report: Callable[[dict[str, Any]], None] | None,
        progress: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.window, self.heat, self.rungs, self.horizon = window, heat, rungs, horizon
        self.quality_metric, self.eval_puzzles = quality_metric, eval_puzzles
        self.report, self.progress = report, progress
        self.result: dict[str, Any] = {
            "status": "ok",
            "samples_per_sec": 0.0,
            "peak_memory_mb": 0.0,
            "predicted_memory_mb": None,
            "thermal_max": "unknown",
            "throughput_decay": 0.0,
            "quality": 0.0,
            "steps": 0,
            **limits,
            "started_at": time.time(),
        }
        self.curve: list[dict[str, Any]] = []
        self.final: dict[str, Any] = {}  # the scores at the run's end
        self.trainer: Any = None
        self.memory: Any = None
        self.health: Any = None
        self.loop: Any = None

    def prediction(self) -> dict[str, Any]:
        """The memory governor's predicted peak for the asked micro-batch, once its probe is fitted."""
        predicted = self.memory.predicted if self.memory is not None else None
        return {"predicted_memory_mb": predicted / MiB} if predicted is not None else {}

    def so_far(self, loop: Any, whole: bool = True) -> dict[str, Any]:
        """The result as measured up to now."""
        return {**self.result, **self.prediction(), **self.window.figures(loop.trainer, loop.peak_bytes, whole=whole)}

    def take(self, loop: Any, k: int, scores: dict[str, Any]) -> None:
        """The k-th evaluation: a point of the curve; the last is the final score, the others go to the pruner."""
        point = {"samples": loop.trainer.samples_seen, "seconds": loop.now(), "quality": scores["quality"]}
        self.curve.append({**point, "stderr": scores["quality_stderr"]})
        scores = {**scores, "curve": list(self.curve)} if self.horizon else scores
        if k == len(self.rungs) - 1:
            self.final.update(scores)
        elif self.report is not None:
            share = {"horizon_share": self.rungs[k][0]} if self.horizon else {}
            self.report({**self.so_far(loop), **scores, "evaluation": self.rungs[k][1], "final": False, **share})

    def send_progress(self, loop: Any) -> None:
        if self.progress is not None:
            self.progress({**self.so_far(loop, whole=False), "final": False})

    def hooks(self, config: cfg.ExperimentConfig, evaluate_quality: bool) -> list[Any]:
        """The trial's hooks: the memory budget it must hold, its window, the heat, health, the evaluations."""
        from raytrm.train.run.evaluations import Evaluations
        from raytrm.train.run.evaluations import evaluate_quality as evaluate
        from raytrm.train.run.health import TRIAL_HALTS, Health
        from raytrm.train.run.memory_budget import MemoryBudget
        from raytrm.tune.window import ProgressReports

        trainer, budget = self.trainer, self.result["memory_budget_mb"]
        self.memory = MemoryBudget.holding(trainer, budget) if budget else None
        self.health = Health(trainer, halt_on=TRIAL_HALTS) if config.training.health_checks else None
        shares = [share for share, _ in self.rungs]

        def scores(loop: Any) -> dict[str, Any]:
            return evaluate(trainer, self.eval_puzzles, self.quality_metric)

        hooks = [
            self.memory,
            self.window,
            self.heat,
            self.health,
            Evaluations(shares, self.window.position, scores, self.take, final=evaluate_quality),
        ]
        if self.progress is not None:
            hooks.append(ProgressReports(self.window, PROGRESS_S, self.send_progress))
        return [h for h in hooks if h is not None]

    def run(self, experiment: dict[str, Any], evaluate_quality: bool, clock: Callable[[], float]) -> dict[str, Any]:
        """Train and measure; never raises: a failed trial reports what it measured, with the reason."""
        from raytrm.train.loop import Loop
        from raytrm.train.trainer import Trainer

        result = self.result
        try:
            config = cfg.from_dict(cfg.ExperimentConfig, experiment, "<trial>")
            self.trainer = Trainer(config)
            self.loop = Loop(self.trainer, self.hooks(config, evaluate_quality), clock=clock)
            self.loop.run()
            self._settle(evaluate_quality)
        except Exception as exc:  # the study goes on
            logger.warning("trial failed: %s: %s", type(exc).__name__, exc)
            if self.trainer is not None:  # what it measured before it failed is its measurement
                result.update(self.prediction())
                result.update(self.window.figures(self.trainer, self.loop.peak_bytes if self.loop else 0))
            result.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            if self.trainer is not None:
                self.trainer.close()
        if self.health is not None and self.health.findings:
            result["health"] = [finding.event() for finding in self.health.findings]
        result["thermal_max"] = self.heat.hottest or "unknown"
        result["ended_at"] = time.time()
        return result

    def _settle(self, evaluate_quality: bool) -> None:
        """The run's figures and status once it ended: over budget, too hot, not learning, or ok with its scores."""
        from raytrm.train.run.health import TRIAL_HALTS

        result, memory, trainer = self.result, self.memory, self.trainer
        result.update(self.prediction())
        if memory is not None and memory.over_budget == "predicted":  # its peak stands for the step not run
            result.update(status="over_budget", peak_memory_mb=result["predicted_memory_mb"], steps=trainer.step)
            return
        result.update(self.window.figures(trainer, self.loop.peak_bytes))
        if memory is not None and memory.over_budget:
            result["status"] = "over_budget"
        elif self.heat.too_hot:
            result["status"] = "too_hot"  # stopped: the constraint is violated and the machine should cool
        elif self.health is not None and self.health.found(*TRIAL_HALTS):
            result["status"] = "not_learning"  # stopped: no quality to report, a boundary for the sampler
        if result["status"] == "ok" and evaluate_quality:
            result.update(self.final)
            if self.horizon:
                result["horizon_samples"] = trainer.samples_seen
        result.update(evaluation=self.rungs[-1][1], final=True)


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


class ExitRequests:
    """A trial process's sys.unraisablehook: Tune stops a finished trial's process with SIGTERM, whose handler (Ray's)
    raises SystemExit wherever the main thread is; raised inside a finalizer, that exit is printed as "Exception
    ignored in ..." with a traceback, into the job's output, and lost. Here it is carried out; anything else goes
    to the hook before."""

    def __init__(self, before: Callable[[Any], None]) -> None:
        self.before = before

    def __call__(self, unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, SystemExit):
            code = unraisable.exc_value.code
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)
        self.before(unraisable)


def tune_trainable(config: dict[str, Any], setup: dict[str, Any]) -> None:
    """The Ray Tune function trainable: one trial, one report, and a copy of the result in the run directory."""
    from ray import tune

    if not isinstance(sys.unraisablehook, ExitRequests):
        sys.unraisablehook = ExitRequests(sys.unraisablehook)

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
