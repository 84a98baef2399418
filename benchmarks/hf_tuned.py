"""`python -m benchmarks hf-tuned`: time to quality. The transformers `Trainer` at its default settings trains a
Hugging Face classifier; its final validation macro-F1 is the target; raytrm then trains the same model on the same
records with a tuned profile until it reaches that target (or a time limit), and the ratio of the two times is the
figure: the tuned profile should need at most half the Trainer's time.

The records, the model and the max length are the profile's (`raytrm tune` wrote them into it); docs/performance.md's
profile comes from benchmarks/hf_tuned.yaml, a space tuned for the macro-F1 after half the Trainer's time. The split is
raytrm's own: the profile's data section opened by raytrm.data.hf_records (a stratified, seeded share held out, or
data.validation_path), so both sides train on the same training records, with the same tokens (raytrm's tokenizer
call at model.seq_len, read from its cache), and are scored on the same validation records by the same function
(raytrm.families.task.classification_scores, on the held-out batches of raytrm.families.task.eval_batches).

The Trainer's side is `Trainer(model, TrainingArguments(output_dir, ...), train_dataset, data_collator=
DataCollatorWithPadding(tokenizer))`, `train()`, at the defaults of TrainingArguments (lr 5e-5, batch 8 per
device, 3 epochs, linear decay without warm-up, AdamW, weight decay 0, clipping at 1, seed 42, its own random
order) but for what running it here needs: the CPU, no evaluation strategy, saving, reporting or progress bar. The
model is loaded after `set_seed(42)`, as the transformers examples do, with a new head for the labels. Its macro-F1
is taken at each epoch's end by a callback, off its clock: its time is train()'s wall time less those evaluations.

raytrm's side is the experiment `raytrm train --profile P` resolves, trained by the Trainer under the loop's hooks
that bear on its steps in `raytrm train` (the memory governor's cuts and probe, the thermal guard, the health
checks), without the metrics file and checkpoints, which a run writes beside its steps. Every `eval_every` steps
the held-out records are scored by raytrm's own evaluation (raytrm.train.run.evaluations.evaluate_quality) inside
the loop's `off_clock`, so its clock (what `--time-budget` counts) leaves evaluations out; the run stops at the first
evaluation at or above the target, or at the time limit. Its time to the target is that evaluation's time on the
clock: an upper bound, by at most one interval of evaluations.

Both sides run in this process, one after the other, at the same intra- and inter-op threads (the profile's, unless
--threads); setup (loading the model, tokenizing, building the trainer) is reported apart, off both clocks.
`others` is the cores other processes kept busy during each side's training.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.hf import busy_seconds, others_cores
from benchmarks.hf_trainer import TokenizedList
from benchmarks.transformer import caches_in
from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.train.loop import Hook, Loop, Step, Stop

logger = logging.getLogger(__name__)

#: The score both sides are judged by: raytrm's name for the held-out macro-F1 of a classifier.
QUALITY = "eval_macro_f1"
#: TrainingArguments' defaults, stated for the table (the arguments themselves are left at them).
TRAINER_DEFAULTS = "defaults: lr 5e-05 linear, no warm-up, batch 8, 3 epochs, AdamW, wd 0"


@dataclass
class Side:
    """One side's training: its settings in words, its curve (each point: step, samples, seconds on its clock,
    macro_f1, accuracy) and its totals."""

    name: str
    settings: str
    setup_seconds: float
    train_seconds: float  # on its clock: evaluations left out
    eval_seconds: float
    steps: int
    samples: int
    macro_f1: float  # at its last point
    curve: list[dict[str, float]] = field(default_factory=list)
    stop: str = ""
    others_cores: float | None = None


@dataclass
class TunedResult:
    profile: str
    records: str
    model: str
    seq_len: int
    labels: int
    train_records: int
    validation_records: int
    threads: int
    interop_threads: int
    target: float  # the Trainer's final macro-F1
    limit_seconds: float  # raytrm's time limit
    trainer: Side
    raytrm: Side
    #: raytrm's clock at its first evaluation at or above the target; None where it did not reach it in the limit.
    seconds_to_target: float | None
    #: The samples raytrm had trained on then: against the Trainer's, the part of the ratio the machine's load leaves
    #: alone (the rest is the two sides' samples/s).
    samples_to_target: int | None
    ratio: float | None  # seconds_to_target / the Trainer's train_seconds
    goal: float


def first_reaching(curve: Sequence[dict[str, float]], target: float) -> dict[str, float] | None:
    """The first point of a curve whose macro-F1 reaches the target (its seconds, samples, step); None if none does."""
    return next((p for p in curve if p["macro_f1"] >= target), None)


def score_model(model: torch.nn.Module, held_out: Any, batch_size: int) -> dict[str, float]:
    """A transformers classifier's accuracy and macro-F1 on raytrm's held-out records, as raytrm scores its own."""
    from raytrm.families.task import classification_scores, eval_batches

    was_training = model.training
    model.eval()
    preds, labels = [], []
    with torch.no_grad():
        for batch in eval_batches(held_out, batch_size, None, torch.device("cpu")):
            inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
            preds.append(model(**inputs).logits.argmax(-1))
            labels.append(batch["labels"])
    model.train(was_training)
    scores = classification_scores(torch.cat(preds).numpy(), torch.cat(labels).numpy(), held_out.metadata.num_classes)
    return {"macro_f1": scores["macro_f1"], "accuracy": scores["accuracy"]}


# -- the transformers Trainer at its defaults ----------------------------------------------------------------------


def run_trainer_defaults(model_dir: Path, train_data: Any, held_out: Any, eval_batch: int, out_dir: Path) -> Side:
    """The transformers Trainer at its default TrainingArguments on raytrm's training records, scored at each epoch's
    end (off its clock)."""
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        PrinterCallback,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    start = time.perf_counter()
    args = TrainingArguments(
        output_dir=str(out_dir),
        use_cpu=True,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    set_seed(args.seed)  # before the model: its new head's weights
    names = list(train_data.metadata.label_names)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir,
        num_labels=len(names),
        id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)},
        ignore_mismatched_sizes=True,
        dtype=torch.float32,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    curve: list[dict[str, float]] = []
    clock = {"start": 0.0, "off": 0.0}

    class _Score(TrainerCallback):
        def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seconds = time.perf_counter() - clock["start"] - clock["off"]
            begin = time.perf_counter()
            scores = score_model(model, held_out, eval_batch)
            clock["off"] += time.perf_counter() - begin
            samples = round(state.epoch * len(train_data))
            curve.append({"step": state.global_step, "samples": samples, "seconds": seconds, **scores})
            logger.info("Trainer epoch %g, %.1f s: macro-F1 %.4f", state.epoch, seconds, scores["macro_f1"])

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=TokenizedList(train_data),
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        callbacks=[_Score()],
    )
    trainer.remove_callback(PrinterCallback)  # its summary line at the end of train()
    setup = time.perf_counter() - start
    before = busy_seconds()
    clock["start"] = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - clock["start"]
    others = others_cores(before, busy_seconds())
    last = curve[-1]
    return Side(
        name="Trainer",
        settings=TRAINER_DEFAULTS,
        setup_seconds=setup,
        train_seconds=wall - clock["off"],
        eval_seconds=clock["off"],
        steps=trainer.state.global_step,
        samples=last["samples"],
        macro_f1=last["macro_f1"],
        curve=curve,
        stop=f"{args.num_train_epochs:g} epochs",
        others_cores=others,
    )


# -- raytrm with the profile ---------------------------------------------------------------------------------------


class TargetWatch(Hook):
    """Scores the held-out records every `every` steps off the loop's clock, and stops the run at the first score at
    or above the target (unless `to_limit`); the curve's points hold the clock at each."""

    def __init__(self, every: int, target: float, to_limit: bool = False) -> None:
        self.every, self.target, self.to_limit = every, target, to_limit
        self.curve: list[dict[str, float]] = []
        self.eval_seconds = 0.0

    def _take(self, loop: Loop) -> float:
        from raytrm.train.run.evaluations import evaluate_quality

        seconds = loop.now()
        begin = time.perf_counter()
        with loop.off_clock():
            scores = evaluate_quality(loop.trainer, None, QUALITY)["eval"]
        self.eval_seconds += time.perf_counter() - begin
        trainer = loop.trainer
        macro_f1 = float(scores[QUALITY])
        point = {"step": trainer.step, "samples": trainer.samples_seen, "seconds": seconds, "macro_f1": macro_f1}
        self.curve.append({**point, "accuracy": float(scores["eval_accuracy"])})
        logger.info("raytrm step %d, %.1f s: macro-F1 %.4f (target %.4f)", trainer.step, seconds, macro_f1, self.target)
        return macro_f1

    def end_step(self, loop: Loop, step: Step) -> Stop | None:
        if loop.trainer.step % self.every:
            return None
        if self._take(loop) >= self.target and not self.to_limit:
            return Stop("target reached")
        return None

    def finish(self, loop: Loop) -> None:
        if not self.curve or self.curve[-1]["step"] != loop.trainer.step:
            self._take(loop)  # the run's last step, where the limit fell between two evaluations


def profile_experiment(profile: Path, threads: int | None) -> cfg.ExperimentConfig:
    """The experiment `raytrm train --profile P [--threads N]` runs (a profile's own steps or time budget are set
    aside: the benchmark's limit ends the run)."""
    from raytrm.train.run.experiment import resolve_experiment

    overrides: dict[str, dict[str, Any]] = {"training": {"time_budget_s": None}}
    if threads:
        overrides["training"]["threads"] = threads
    experiment, _ = resolve_experiment(
        config_file=None, profile_file=str(profile), out=None, resume=False, overrides=overrides
    )
    if experiment.model.name != "hf" or experiment.model.task != "classify":
        raise UserError(
            f"{profile}: model {experiment.model.name} ({experiment.model.task}); the hf-tuned bench compares "
            "classifiers; fix: give a profile of an hf classifier (raytrm tune --model-path DIR --data RECORDS)"
        )
    return experiment


def run_raytrm_profile(
    experiment: cfg.ExperimentConfig,
    target: float,
    limit_s: float,
    every: int,
    to_limit: bool = False,
    records: tuple[Any, Any] | None = None,
) -> Side:
    """raytrm's Trainer at the profile, under `raytrm train`'s step hooks, scored every `every` steps until the
    target or the limit; `records`, where given, the (training, held-out) records its data must equal."""
    from raytrm.hardware.thermal import ThermalReader
    from raytrm.train.run.health import Health
    from raytrm.train.run.memory_budget import MemoryBudget
    from raytrm.train.run.stop_rules import TimeBudget
    from raytrm.train.run.thermal_guard import ThermalGuard, ThermalHook
    from raytrm.train.trainer import Trainer

    start = time.perf_counter()
    train = experiment.training
    trainer = Trainer(experiment)
    try:
        if records is not None and not all(map(same_records, (trainer.train_data, trainer.test_data), records)):
            raise RuntimeError("raytrm's Trainer opened other records than the Trainer's side trained on")
        guard = (
            ThermalGuard(cap=train.thermal_cap, action=train.thermal_action, threads=trainer.threads["threads"])
            if train.thermal_cap
            else None
        )
        watch = TargetWatch(every, target, to_limit)
        hooks: list[Hook | None] = [
            TimeBudget(limit_s),
            MemoryBudget.adapting(trainer),
            ThermalHook(ThermalReader(), guard),
            Health(trainer) if train.health_checks else None,
            watch,
        ]
        loop = Loop(trainer, [h for h in hooks if h is not None])
        setup = time.perf_counter() - start
        before = busy_seconds()
        stop = loop.run()
        seconds = loop.now()
        others = others_cores(before, busy_seconds())
    finally:
        trainer.close()
    micro = f" (micro {trainer.micro_batch})" if trainer.micro_batch != trainer.global_batch else ""
    settings = (
        f"profile: lr {train.lr:.3g} {train.schedule}, warm-up {train.warmup_steps}, batch "
        f"{train.global_batch_size}{micro}, {train.optimizer}, wd {train.weight_decay:g}"
    )
    return Side(
        name="raytrm",
        settings=settings,
        setup_seconds=setup,
        train_seconds=seconds,
        eval_seconds=watch.eval_seconds,
        steps=trainer.step,
        samples=trainer.samples_seen,
        macro_f1=watch.curve[-1]["macro_f1"],
        curve=watch.curve,
        stop=stop or "",
        others_cores=others,
    )


# -- the benchmark -------------------------------------------------------------------------------------------------


def bench_hf_tuned(
    profile: Path,
    work: Path,
    threads: int | None = None,
    eval_every: int = 5,
    limit: float = 1.0,
    to_limit: bool = False,
    goal: float = 0.5,
) -> TunedResult:
    """The Trainer at its defaults, then raytrm at the profile up to `limit` times the Trainer's time."""
    from raytrm.data.hf_records import open_records
    from raytrm.families.hf_model import load_tokenizer, locate
    from raytrm.train.torch_threads import apply_threads

    if not profile.is_file():
        raise UserError(f"{profile}: no such profile; fix: give --profile the YAML that `raytrm tune` wrote")
    if eval_every < 1 or limit <= 0:
        raise UserError(f"--eval-every {eval_every}, --limit {limit:g}: expected at least 1 step and a positive limit")
    experiment = profile_experiment(profile, threads)
    train = experiment.training
    # Both sides at the same threads, set once before any parallel work (torch fixes the inter-op pool then).
    applied = apply_threads(train.threads, train.interop_threads)
    model_dir = locate(str(experiment.model.path))
    with caches_in(work / "cache"):
        train_data, held_out = open_records(experiment.data, experiment.model, load_tokenizer(model_dir))
        logger.info("the transformers Trainer at its defaults, on %d records", len(train_data))
        theirs = run_trainer_defaults(model_dir, train_data, held_out, train.global_batch_size, work / "hf-trainer")
        target = theirs.macro_f1
        limit_s = limit * theirs.train_seconds
        logger.info("raytrm at %s: to macro-F1 %.4f, or %.0f s", profile, target, limit_s)
        ours = run_raytrm_profile(experiment, target, limit_s, eval_every, to_limit, (train_data, held_out))
    reached = first_reaching(ours.curve, target)
    seconds = reached["seconds"] if reached is not None else None
    return TunedResult(
        profile=str(profile),
        records=str(experiment.data.path),
        model=str(model_dir),
        seq_len=experiment.model.seq_len,
        labels=train_data.metadata.num_classes,
        train_records=len(train_data),
        validation_records=len(held_out),
        threads=applied["threads"],
        interop_threads=applied["interop_threads"],
        target=target,
        limit_seconds=limit_s,
        trainer=theirs,
        raytrm=ours,
        seconds_to_target=seconds,
        samples_to_target=int(reached["samples"]) if reached is not None else None,
        ratio=seconds / theirs.train_seconds if seconds is not None else None,
        goal=goal,
    )


def format_result(r: TunedResult) -> str:
    head = (
        f"{'side':<8} {'settings':<62} {'steps':>5} {'samples':>7} {'train s':>7} {'eval s':>6} {'setup s':>7} "
        f"{'macro-F1':>8} {'others':>6}"
    )
    lines = [
        f"{r.records}: {r.train_records} training and {r.validation_records} validation records, {r.labels} labels, "
        f"max length {r.seq_len}; {r.threads} threads ({r.interop_threads} inter-op) each side",
        head,
    ]
    for s in (r.trainer, r.raytrm):
        others = f"{s.others_cores:.2f}" if s.others_cores is not None else ""
        lines.append(
            f"{s.name:<8} {s.settings:<62} {s.steps:>5} {s.samples:>7} {s.train_seconds:>7.1f} {s.eval_seconds:>6.1f} "
            f"{s.setup_seconds:>7.1f} {s.macro_f1:>8.4f} {others:>6}"
        )
    if r.seconds_to_target is None:
        verdict = f"raytrm did not reach it in {r.limit_seconds:.1f} s ({r.raytrm.stop})"
    else:
        met = "met" if r.ratio is not None and r.ratio <= r.goal else "missed"
        verdict = (
            f"raytrm {r.seconds_to_target:.1f} s = {r.ratio:.2f} x the Trainer's {r.trainer.train_seconds:.1f} s "
            f"(goal <= {r.goal:g}: {met}), at {r.samples_to_target} samples = "
            f"{r.samples_to_target / r.trainer.samples:.2f} x the Trainer's {r.trainer.samples}"
        )
    lines.append(f"time to the Trainer's final macro-F1 {r.target:.4f}: {verdict}")
    rates = [f"{s.name} {s.samples / max(s.train_seconds, 1e-9):.2f}" for s in (r.trainer, r.raytrm)]
    lines.append(f"samples/s on each clock (setup and evaluations left out, warm-up in): {', '.join(rates)}")
    for s in (r.trainer, r.raytrm):
        points = "  ".join(f"{p['step']:.0f}:{p['seconds']:.0f}s:{p['macro_f1']:.3f}" for p in s.curve)
        lines.append(f"{s.name} curve (step:seconds:macro-F1)  {points}")
    return "\n".join(lines)


def as_json(r: TunedResult) -> dict[str, Any]:
    return asdict(r)


def same_records(a: Any, b: Any) -> bool:
    """Whether two opens of records hold the same records with the same labels and tokens (LabelledRecords)."""
    return bool(
        np.array_equal(a.records, b.records)
        and np.array_equal(a.labels, b.labels)
        and np.array_equal(a.cache.tokens, b.cache.tokens)
        and np.array_equal(a.cache.offsets, b.cache.offsets)
    )
