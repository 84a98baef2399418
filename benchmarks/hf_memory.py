"""`python -m benchmarks memory --model hf`: the memory governor's micro-batch on a Hugging Face classifier, against
its budget.

For each max length, all-MiniLM-L6-v2 (benchmarks.hf.find_model) trains on the docstring records
(benchmarks.hf_corpus) as `raytrm train --model hf --model-path M --data records.csv --seq-len L --global-batch B
--steps N --memory-budget-mb X --threads T --device cpu` resolves it (this machine's tier filling what those flags
leave unset), under the loop and the governor that command runs: a classifier's micro-batch counts padded tokens
(its records x its longest record, raytrm.train.micro_batches), and the governor probes small cuts at their widest
(records padded to L), fits peak = fixed + per-token x the tokens a step had in flight, approaches the largest cut
whose prediction stays under (1 - margin) of the budget, and shrinks a cut whose step peaks above the high-water
mark. The run goes on
until `steady` steps in a row ran at one cut on their own records with no adaptation (or `max_steps`); the row is
those steady steps. Then `widest_steps` more steps run at that cut with every record padded to max length (as the
governor's probe runs them), measured outside the governor: the costliest records the cut may meet, which is what
the governor sizes the cut for. Records of varied length run shorter than that, so their steps peak lower.

The peak is the governor's own measure (raytrm.train.memory.peak.PeakMemory, around each step): on Linux the
kernel's high-water mark of the process's whole resident memory during the step (VmHWM, reset to the resident size
when the step starts), not its growth over a baseline; the budget is compared with that absolute figure. A row's peak
is the highest of its steady steps, and likewise of its widest steps (summary.json's peak_step_mb is the highest over
a whole run, the probe's steps included). The goal: that peak under the budget and at least GOAL_FLOOR of it.

The budget is given (--budget-mb, one for every length or one per length). It must force a cut: the row gives the
fit's prediction for the whole global batch beside it (a full batch at max length is not measured: it may not fit
the machine). Each length runs in a fresh process, as a `raytrm train` would: the heap an earlier run leaves behind
would raise the next one's resident peaks.
"""

from __future__ import annotations

import logging
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.train.loop import Hook, Loop, Step
from raytrm.train.memory.peak import PeakMemory
from raytrm.train.trainer import Trainer

logger = logging.getLogger(__name__)

MiB = 2**20
#: The least share of the budget the steady steps' peak should use.
GOAL_FLOOR = 0.85


@dataclass
class StepPeak:
    """One step as the governor saw it: its cut (padded tokens), whether it ran at its widest, its peak, its
    adaptations, and the records of each of its micro-batches."""

    step: int
    micro_batch: int
    widest: bool
    peak_bytes: int
    events: list[str] = field(default_factory=list)
    records: list[int] = field(default_factory=list)


@dataclass
class GovernorRow:
    max_length: int
    global_batch: int
    threads: int
    budget_mb: float
    #: The cut the steady steps ran, in padded tokens (records x a micro-batch's longest), and the governor's own.
    micro_batch: int
    governor_micro_batch: int
    #: The records a micro-batch of that cut holds at max length, and the most one of the steady steps' held.
    records_widest: int
    records_most: int
    steady_steps: int
    #: The steady steps' peaks, on their own records: the highest (the row's peak), the median and the lowest.
    peak_mb: float
    median_peak_mb: float
    min_peak_mb: float
    fraction: float  # peak / budget
    goal: bool  # peak < budget and peak >= GOAL_FLOOR x budget
    #: The highest peak of `widest_steps` more steps at that cut with every record at max length (widest_peaks).
    widest_peak_mb: float
    widest_fraction: float
    widest_goal: bool
    widest_steps: int
    #: The fit's peak at the settled micro-batch and at the whole global batch (every record at max length).
    predicted_mb: float | None
    full_batch_predicted_mb: float | None
    fit: dict | None
    steps: int  # steps run in all
    settled_at: int  # the first steady step
    seconds: float
    #: Every step: (step, micro-batch, widest, peak MiB, adaptations), and the governor's events.
    trace: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    #: Cores other processes kept busy while the row ran (Linux; None elsewhere).
    others_cores: float | None = None
    #: Steps before which the heap was given back (a step had peaked above the margin's line).
    heap_releases: int = 0


def steady_tail(steps: list[StepPeak]) -> list[StepPeak]:
    """The latest steps that ran at one cut on their own records, none of them adapting the cut.

    A step that carried an event changed the cut after it (or was a probe), so the tail starts after the last one.
    """
    tail: list[StepPeak] = []
    for s in reversed(steps):
        if s.widest or s.events or (tail and s.micro_batch != tail[-1].micro_batch):
            break
        tail.append(s)
    return tail[::-1]


def judge(peaks: list[int], budget_bytes: float, floor: float = GOAL_FLOOR) -> tuple[int, float, bool]:
    """The highest peak, its share of the budget, and whether it is under the budget and at least floor of it."""
    if not peaks:
        raise ValueError("no steady steps to judge")
    peak = max(peaks)
    fraction = peak / budget_bytes
    return peak, fraction, floor <= fraction < 1.0


def budgets_for(max_lengths: list[int], budget_mb: list[int]) -> list[int]:
    """One budget per max length: one given for all, or one given per length, in order."""
    if len(budget_mb) == 1:
        return budget_mb * len(max_lengths)
    if len(budget_mb) != len(max_lengths):
        raise UserError(
            f"--budget-mb gives {len(budget_mb)} budgets for {len(max_lengths)} max lengths; fix: give one budget, "
            "or one per --max-lengths value"
        )
    return list(budget_mb)


class _Watch(Hook):
    """Records each step's cut and peak; ends the run after `steady` steady steps, or at max_steps."""

    def __init__(self, steady: int, max_steps: int) -> None:
        self.steady, self.max_steps = steady, max_steps
        self.steps: list[StepPeak] = []

    def after_step(self, loop: Loop, step: Step) -> None:
        # Runs after the governor's hook, before the loop applies its cut: the trainer still holds this step's.
        trainer = loop.trainer
        events = [e["event"] for e in step.events]
        cut = (trainer.step, trainer.micro_batch, trainer.widest, step.peak_bytes, events, list(trainer.cuts))
        self.steps.append(StepPeak(*cut))

    def stop(self, loop: Loop) -> str | None:
        if len(steady_tail(self.steps)) >= self.steady:
            return "steady"
        return "max steps" if loop.trainer.step >= self.max_steps else None


def experiment_for(
    model_dir: Path, records: Path, max_length: int, global_batch: int, budget_mb: int, threads: int, steps: int
) -> cfg.ExperimentConfig:
    """The experiment `raytrm train --model hf --model-path DIR --data FILE --seq-len L --global-batch B --steps N
    --memory-budget-mb X --threads T --device cpu` resolves on this machine."""
    from raytrm.train.run.experiment import resolve_experiment

    overrides = {
        "model": {"name": "hf", "path": str(model_dir), "seq_len": max_length},
        "data": {"path": str(records)},
        "training": {
            "global_batch_size": global_batch,
            "steps": steps,
            "memory_budget_mb": budget_mb,
            "threads": threads,
            "device": "cpu",
        },
    }
    experiment, _ = resolve_experiment(config_file=None, profile_file=None, out=None, resume=False, overrides=overrides)
    return experiment


def measure_row(
    model_dir: Path,
    records: Path,
    max_length: int,
    global_batch: int,
    budget_mb: int,
    threads: int,
    steady: int,
    max_steps: int,
    widest_steps: int,
) -> GovernorRow:
    """Train under the governor until it has held one cut for `steady` steps; the row of those steps."""
    from benchmarks.hf import busy_seconds, others_cores
    from raytrm.train.run.memory_budget import MemoryBudget

    experiment = experiment_for(model_dir, records, max_length, global_batch, budget_mb, threads, max_steps)
    trainer = Trainer(experiment)
    try:
        memory = MemoryBudget.adapting(trainer)
        assert memory is not None  # the experiment sets a budget
        watch = _Watch(steady, max_steps)
        started, before = time.perf_counter(), busy_seconds()
        Loop(trainer, [memory, watch]).run()
        seconds, others = time.perf_counter() - started, others_cores(before, busy_seconds())
        widest = widest_peaks(trainer, widest_steps)
    finally:
        trainer.close()
    governor = memory.governor
    tail = steady_tail(watch.steps)
    if not tail:
        raise UserError(
            f"max length {max_length}: the governor still moved its cut at step {max_steps}; fix: raise --max-steps"
        )
    peaks = [s.peak_bytes for s in tail]
    peak, fraction, goal = judge(peaks, governor.budget_bytes)
    widest_peak, widest_fraction, widest_goal = judge(widest, governor.budget_bytes)
    micro = tail[0].micro_batch
    predicted, full = governor.predicted_peak(micro), governor.predicted_peak(global_batch * max_length)
    return GovernorRow(
        max_length=max_length,
        global_batch=global_batch,
        threads=threads,
        budget_mb=governor.budget_bytes / MiB,
        micro_batch=micro,
        governor_micro_batch=governor.micro_batch,
        records_widest=max(1, micro // max_length),
        records_most=max(max(s.records, default=0) for s in tail),
        steady_steps=len(tail),
        peak_mb=peak / MiB,
        median_peak_mb=statistics.median(peaks) / MiB,
        min_peak_mb=min(peaks) / MiB,
        fraction=fraction,
        goal=goal,
        widest_peak_mb=widest_peak / MiB,
        widest_fraction=widest_fraction,
        widest_goal=widest_goal,
        widest_steps=len(widest),
        predicted_mb=None if predicted is None else predicted / MiB,
        full_batch_predicted_mb=None if full is None else full / MiB,
        fit=governor.fit.to_dict() if governor.fit else None,
        steps=len(watch.steps),
        settled_at=tail[0].step,
        seconds=seconds,
        trace=[{**asdict(s), "peak_mb": s.peak_bytes / MiB} for s in watch.steps],
        events=list(governor.events),
        others_cores=others,
        heap_releases=memory.releases,
    )


def widest_peaks(trainer: Trainer, steps: int) -> list[int]:
    """The peaks of a few more steps at the trainer's cut with every record at max length: the costliest records
    the settled cut may meet, measured as the loop measures a step, outside the governor."""
    trainer.widest = True
    peaks = []
    for _ in range(steps):
        with PeakMemory(trainer.device.type) as peak:
            trainer.train_step()
        peaks.append(peak.bytes)
    return peaks


def _row_in_child(cache: Path, level: int, *args: object) -> GovernorRow:
    """measure_row in a fresh process (the spawned child's logging and token cache set first)."""
    from benchmarks.transformer import caches_in

    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    with caches_in(cache):
        return measure_row(*args)  # type: ignore[arg-type]


def bench_governor(
    max_lengths: list[int],
    global_batch: int,
    budget_mb: list[int],
    threads: int,
    steady: int,
    max_steps: int,
    widest_steps: int,
    work: Path,
    model: str | None = None,
    corpus: Path | None = None,
    per_label: int = 500,
) -> list[GovernorRow]:
    """A row per max length, each trained in a fresh process on the docstring records built (or reused) in corpus."""
    from benchmarks.hf import find_model
    from benchmarks.hf_corpus import build_corpus

    budgets = budgets_for(max_lengths, budget_mb)
    model_dir = find_model(model)
    records = build_corpus(corpus or work / "corpus", per_label=per_label)
    rows = []
    spawn = multiprocessing.get_context("spawn")
    for max_length, budget in zip(max_lengths, budgets, strict=True):
        logger.info("max length %d: budget %.0f MiB, global batch %d", max_length, budget, global_batch)
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as child:
            args = (model_dir, records, max_length, global_batch, budget, threads, steady, max_steps, widest_steps)
            level = logging.getLogger().getEffectiveLevel()
            row = child.submit(_row_in_child, work / "cache", level, *args).result()
        logger.info("%s", format_rows([row]))
        rows.append(row)
    return rows


def format_rows(rows: list[GovernorRow]) -> str:
    head = (
        f"{'max len':>7} {'batch':>5} {'budget MiB':>10} {'micro tokens':>12} {'records':>7} {'steady':>6} "
        f"{'peak MiB min/med/max':>20} {'peak/budget':>11} {'widest MiB':>10} {'widest/budget':>13} {'fit MiB':>7} "
        f"{'fit full':>8} "
        f"{'goal own/widest':>15} {'steps':>5} {'others':>6}"
    )
    lines = [head]
    for r in rows:
        peaks = f"{r.min_peak_mb:.0f}/{r.median_peak_mb:.0f}/{r.peak_mb:.0f}"
        fit = f"{r.predicted_mb:.0f}" if r.predicted_mb is not None else ""
        full = f"{r.full_batch_predicted_mb:.0f}" if r.full_batch_predicted_mb is not None else ""
        goals = "/".join("yes" if g else "no" for g in (r.goal, r.widest_goal))
        others = f"{r.others_cores:.2f}" if r.others_cores is not None else ""
        records = f"{r.records_widest}/{r.records_most}"
        lines.append(
            f"{r.max_length:>7} {r.global_batch:>5} {r.budget_mb:>10.0f} {r.micro_batch:>12} {records:>7} "
            f"{r.steady_steps:>6} {peaks:>20} {r.fraction:>11.3f} {r.widest_peak_mb:>10.0f} "
            f"{r.widest_fraction:>13.3f} {fit:>7} {full:>8} {goals:>15} {r.steps:>5} {others:>6}"
        )
    lines.append(
        "micro tokens: the settled cut, padded tokens a micro-batch may hold (its records x its longest); records: "
        "what a micro-batch of it holds at max length / the most a steady step's held; "
        "peak: a step's resident high-water mark (VmHWM, the whole process), the governor's measure; steady: steps "
        "at the settled cut on their own records; widest: more steps at that cut, every record at max length; goal: "
        f"peak < budget and >= {GOAL_FLOOR:g} of it; fit: the governor's line at the cut and at the global batch"
    )
    return "\n".join(lines)


def as_json(rows: list[GovernorRow]) -> list[dict]:
    return [asdict(r) for r in rows]
