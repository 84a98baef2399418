"""`raytrm bench trm`: training throughput of TRM against this machine's measured matrix-multiply ceiling.

Each row is the real Trainer's `train_step` (data, forward of every recursion round, backward of the last, loss,
optimizers, EMA) at one variant and width. Its model FLOPs are counted by torch's FLOP counter on one step, and the
matmul ceiling is measured in the same run, so the fraction compares like with like on a noisy machine.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from raytrm import config as cfg
from raytrm.bench.timing import count_flops, matmul_flops_per_sec, median_seconds
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


def _experiment(
    variant: str, hidden: int, batch: int, threads: int | None, device: str, data_dir: Path, dtype: str
) -> cfg.ExperimentConfig:
    model = {
        **REFERENCE_SUDOKU,
        "variant": variant,
        "hidden_size": hidden,
        "pos_encodings": "rope" if variant == "attention" else "none",
    }
    training = {"global_batch_size": batch, "threads": threads, "device": device, "dtype": dtype, "ema": True}
    return cfg.from_dict(cfg.ExperimentConfig, {"model": model, "data": {"path": str(data_dir)}, "training": training})


def bench_trm(
    variants: list[str],
    hiddens: list[int],
    batch: int,
    threads: int | None,
    device: str,
    work_dir: Path,
    repeats: int = 5,
    dtype: str = "auto",
) -> list[TrmRow]:
    """Median step time and FLOP rate of each (variant, hidden), with the matmul ceiling measured alongside."""
    data_dir = work_dir / "sudoku"
    if not (data_dir / "test" / "dataset.json").exists():
        build_dataset("sudoku", data_dir, count=max(64, 4 * batch), test_count=8, givens=36, overwrite=True)
    rows = []
    for variant in variants:
        for hidden in hiddens:
            trainer = Trainer(_experiment(variant, hidden, batch, threads, device, data_dir, dtype))
            ceiling_dtype = torch.float32 if trainer.dtype == torch.float32 else trainer.dtype
            trainer.train_step()  # first step: allocations, carry set-up
            flops = count_flops(trainer.train_step)
            seconds = median_seconds(trainer.train_step, trainer.device, warmup=1, repeats=repeats)
            # Measured right after the model, so both see the same machine state.
            ceiling = matmul_flops_per_sec(trainer.device, dtype=ceiling_dtype)
            rows.append(
                TrmRow(
                    variant=variant,
                    hidden=hidden,
                    batch=batch,
                    device=trainer.device.type,
                    dtype=str(trainer.dtype).removeprefix("torch."),
                    step_seconds=seconds,
                    samples_per_sec=batch / seconds,
                    gflop_per_step=flops / 1e9,
                    gflops=flops / seconds / 1e9,
                    matmul_gflops=ceiling / 1e9,
                    fraction_of_matmul=flops / seconds / ceiling,
                )
            )
            logger.info("%s", rows[-1])
            trainer.close()
    return rows


def format_rows(rows: list[TrmRow]) -> str:
    head = (
        f"{'variant':<10} {'hidden':>6} {'batch':>5} {'device':>6} {'dtype':>8} {'step s':>8} {'samples/s':>10} "
        f"{'GFLOP/step':>10} {'GFLOP/s':>8} {'matmul':>8} {'fraction':>8}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.variant:<10} {r.hidden:>6} {r.batch:>5} {r.device:>6} {r.dtype:>8} {r.step_seconds:>8.3f} "
            f"{r.samples_per_sec:>10.2f} {r.gflop_per_step:>10.1f} {r.gflops:>8.1f} {r.matmul_gflops:>8.1f} "
            f"{r.fraction_of_matmul:>8.2f}"
        )
    return "\n".join(lines)


def as_json(rows: list[TrmRow]) -> list[dict]:
    return [asdict(r) for r in rows]
