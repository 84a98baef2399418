"""`python -m benchmarks trm`: training throughput of TRM against this machine's measured matrix-multiply ceiling.

Each `raytrm` row is the real Trainer's `train_step` (data, forward of every recursion round, backward of the last,
loss, optimizers, EMA) at one variant and width. Its model FLOPs are counted by torch's FLOP counter on one step, and
the matmul ceiling is measured in the same run, between the timed steps, so the fraction compares like with like on a
noisy machine.

With a reference checkout, a `reference` row follows each raytrm row: the reference's own model and training step at the
same variant, width, batch, threads, device and dtype (see `benchmarks.reference`). The two steps are timed in
alternation, so a change in the machine's load reaches both rows alike, and `ratio` is raytrm's samples/s over the
reference's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import breakdown as bd
from benchmarks.reference import ReferenceTrainer, load_reference_classes
from benchmarks.timing import compiled_as_run, measure_side_by_side, onednn_columns
from raytrm import config as cfg
from raytrm.data.build import build_dataset
from raytrm.train.trainer import Trainer

logger = logging.getLogger(__name__)

#: The reference's Sudoku configuration (hidden is varied by the benchmark).
REFERENCE_SUDOKU = {"L_layers": 2, "H_cycles": 3, "L_cycles": 6, "num_heads": 8, "expansion": 4.0}


@dataclass
class TrmRow:
    variant: str
    hidden: int
    batch: int
    device: str
    dtype: str
    step_seconds: float
    samples_per_sec: float
    gflop_per_step: float
    gflops: float
    matmul_gflops: float
    fraction_of_matmul: float
    #: On a CPU whose linear layers run on oneDNN: oneDNN's 2048^3 rate, and the model's fraction of it.
    onednn_gflops: float | None = None
    fraction_of_onednn: float | None = None
    #: "raytrm", or "reference" for the reference's own training step.
    impl: str = "raytrm"
    #: On a raytrm row measured beside the reference: raytrm samples/s / reference samples/s.
    ratio: float | None = None
    #: How the step ran: "off" (eager), or raytrm's training.compile / "torch.compile" for the reference.
    compiled: str = "off"


def reference_experiment(
    variant: str,
    hidden: int,
    batch: int,
    threads: int | None,
    device: str,
    data_dir: Path,
    dtype: str,
    compile_mode: str = "off",
) -> cfg.ExperimentConfig:
    """The reference's Sudoku configuration at a width and batch, on a Sudoku dataset in data_dir."""
    model = {
        **REFERENCE_SUDOKU,
        "variant": variant,
        "hidden_size": hidden,
        "pos_encodings": "rope" if variant == "attention" else "none",
    }
    training = {
        "global_batch_size": batch,
        "threads": threads,
        "device": device,
        "dtype": dtype,
        "ema": True,
        "compile": compile_mode,
    }
    return cfg.from_dict(cfg.ExperimentConfig, {"model": model, "data": {"path": str(data_dir)}, "training": training})


def _measure_pair(
    experiment: cfg.ExperimentConfig,
    data_dir: Path,
    reference: Path | None,
    repeats: int,
    breakdowns: list[bd.Breakdown] | None = None,
) -> list[TrmRow]:
    """raytrm's row at one config, and the reference's beside it when a checkout is given; with `breakdowns`, one
    profiled step of each row is appended there (benchmarks.breakdown)."""
    trainer = Trainer(experiment)
    steps: list[tuple[str, Callable[[], object]]] = [("raytrm", trainer.train_step)]
    ref = None
    batch, model = experiment.training.global_batch_size, experiment.model
    try:
        if breakdowns is not None:
            bd.cpu_only(trainer.device)
        if reference is not None:
            # Compiled exactly where raytrm's compile plan compiles (not on a CPU without a C++ compiler, say).
            ref = ReferenceTrainer(
                reference, experiment, data_dir, trainer.device, trainer.dtype, compile_model=bool(trainer.compiled)
            )
            steps.append(("reference", ref.train_step))
        rates = measure_side_by_side([step for _, step in steps], trainer.device, trainer.dtype, repeats, batch)
        if breakdowns is not None:
            profiled = []
            for (impl, step), r in zip(steps, rates, strict=True):
                ceilings = {"matmul_gflops": r["matmul_gflops"], "onednn_gflops": r["onednn_gflops"]}
                row = bd.Breakdown(model.variant, model.hidden_size, impl, r["step_seconds"], **ceilings)
                profiled.append(bd.profile_step(step, row))
            if len(profiled) == 2:
                profiled[0].bound = bd.bound(*profiled)
            breakdowns.extend(profiled)
    finally:
        trainer.close()
        if ref is not None:
            ref.close()
    compiled = {
        "raytrm": compiled_as_run(trainer, experiment.training.compile),
        "reference": "torch.compile" if trainer.compiled else "off",
    }
    rows = [
        TrmRow(
            variant=model.variant,
            hidden=model.hidden_size,
            batch=batch,
            device=trainer.device.type,
            dtype=str(trainer.dtype).removeprefix("torch."),
            impl=impl,
            compiled=compiled[impl],
            **r,
        )
        for (impl, _), r in zip(steps, rates, strict=True)
    ]
    for row in rows:
        logger.info("%s", row)
    return rows


def bench_trm(
    variants: list[str],
    hiddens: list[int],
    batch: int,
    threads: int | None,
    device: str,
    work_dir: Path,
    repeats: int = 5,
    dtype: str = "auto",
    reference: Path | None = None,
    compile_mode: str = "off",
    breakdowns: list[bd.Breakdown] | None = None,
) -> list[TrmRow]:
    """Median step time and FLOP rate of each (variant, hidden), with the matmul ceiling measured alongside.

    reference: a checkout of the TRM reference; each raytrm row then gets the reference's row at the same config.
    breakdowns: where to append one profiled step of each row (CPU only; benchmarks.breakdown).
    """
    if reference is not None:
        load_reference_classes(reference)  # a wrong directory fails now, before any model is timed
    data_dir = work_dir / "sudoku"
    if not (data_dir / "test" / "dataset.json").exists():
        build_dataset("sudoku", data_dir, count=max(64, 4 * batch), test_count=8, givens=36, overwrite=True)
    rows = []
    for variant in variants:
        for hidden in hiddens:
            experiment = reference_experiment(variant, hidden, batch, threads, device, data_dir, dtype, compile_mode)
            rows.extend(_measure_pair(experiment, data_dir, reference, repeats, breakdowns))
    return rows


def format_rows(rows: list[TrmRow]) -> str:
    head = (
        f"{'variant':<10} {'impl':<9} {'hidden':>6} {'batch':>5} {'device':>6} {'dtype':>8} {'step s':>8} "
        f"{'samples/s':>10} {'GFLOP/step':>10} {'GFLOP/s':>8} {'matmul':>8} {'fraction':>8} {'oneDNN':>8} "
        f"{'fraction':>8} {'ratio':>6} compiled"
    )
    lines = [head]
    for r in rows:
        ratio = f"{r.ratio:>6.2f}" if r.ratio is not None else f"{'':>6}"
        lines.append(
            f"{r.variant:<10} {r.impl:<9} {r.hidden:>6} {r.batch:>5} {r.device:>6} {r.dtype:>8} {r.step_seconds:>8.3f} "
            f"{r.samples_per_sec:>10.2f} {r.gflop_per_step:>10.1f} {r.gflops:>8.1f} {r.matmul_gflops:>8.1f} "
            f"{r.fraction_of_matmul:>8.2f} {onednn_columns(r)} {ratio} {r.compiled}"
        )
    return "\n".join(lines)


def as_json(rows: list[TrmRow]) -> list[dict]:
    return [asdict(r) for r in rows]
