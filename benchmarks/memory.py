"""`python -m benchmarks memory`: how well the memory model predicts, and what watching memory and heat costs.

For each width the governor's probe is replayed on real training steps (micro-batches 4, 8, 16), the line is fitted
as in training, and larger micro-batches are then measured and compared with the prediction. The monitoring cost is
the time of what the loop adds per step (peak measurement, memory and thermal readings), timed directly over many
calls and divided by the median step time: timing whole steps with and without it would drown a sub-1% cost in
this machine's noise.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.timing import median_seconds
from raytrm import config as cfg
from raytrm.data.build import build_dataset
from raytrm.hardware.pressure import MemoryReader
from raytrm.hardware.thermal import ThermalReader
from raytrm.train.memory.fit import fit
from raytrm.train.memory.peak import PeakMemory, trim_heap
from raytrm.train.trainer import Trainer

PROBES = (4, 8, 16)
MiB = 2**20


@dataclass
class MemoryRow:
    hidden: int
    micro_batch: int
    predicted_mb: float
    measured_mb: float
    error: float  # (predicted - measured) / measured


@dataclass
class OverheadRow:
    hidden: int
    step_seconds: float
    monitor_seconds: float
    overhead: float  # monitor / step


def _trainer(hidden: int, global_batch: int, data_dir: Path, threads: int | None) -> Trainer:
    model = {"variant": "mlp_t", "hidden_size": hidden, "L_layers": 2, "H_cycles": 3, "L_cycles": 6}
    training = {"global_batch_size": global_batch, "threads": threads}
    return Trainer(
        cfg.from_dict(cfg.ExperimentConfig, {"model": model, "data": {"path": str(data_dir)}, "training": training})
    )


def _peak(trainer: Trainer, micro: int) -> int:
    trainer.set_micro_batch(micro)
    if trainer.micro_batch != micro:
        raise ValueError(f"micro-batch {micro} does not divide the global batch {trainer.global_batch}")
    with PeakMemory(trainer.device.type) as peak:
        trainer.train_step()
    return peak.bytes


def bench_memory(
    hiddens: list[int], checks: list[int], threads: int | None, work_dir: Path
) -> tuple[list[MemoryRow], list[OverheadRow]]:
    """Prediction error at each checked micro-batch, and the monitoring overhead, for each width."""
    global_batch = max(*checks, *PROBES)  # every probe and check must divide it, so each step is cut evenly
    data_dir = work_dir / "sudoku"
    if not (data_dir / "test" / "dataset.json").exists():
        build_dataset("sudoku", data_dir, count=4 * global_batch, test_count=8, givens=36, overwrite=True)
    rows, overhead = [], []
    for hidden in hiddens:
        trim_heap()  # the previous width's freed heap would otherwise raise this one's measured peaks
        trainer = _trainer(hidden, global_batch, data_dir, threads)
        points = [(b, _peak(trainer, b)) for b in PROBES]
        line = fit(points[1:])  # the first probe is the warm-up step, as in training
        for micro in sorted(checks):  # increasing, so a freed-but-kept heap never inflates a smaller step
            measured = _peak(trainer, micro)
            predicted = line.predict(micro)
            rows.append(MemoryRow(hidden, micro, predicted / MiB, measured / MiB, (predicted - measured) / measured))
        trainer.set_micro_batch(global_batch)
        step = median_seconds(trainer.train_step, trainer.device, warmup=0, repeats=3)
        overhead.append(OverheadRow(hidden, step, _monitor_seconds(trainer), _monitor_seconds(trainer) / step))
        trainer.close()
        del trainer
    return rows, overhead


def _monitor_seconds(trainer: Trainer, calls: int = 200) -> float:
    """Median seconds of what the loop adds to one step: a peak region and one memory and one thermal reading."""
    memory, thermal = MemoryReader(device=trainer.device), ThermalReader()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        with PeakMemory(trainer.device.type):
            pass
        memory.read()
        thermal.read()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def format_rows(rows: list[MemoryRow], overhead: list[OverheadRow]) -> str:
    lines = [f"{'hidden':>6} {'micro':>5} {'predicted MiB':>13} {'measured MiB':>12} {'error':>7}"]
    lines += [
        f"{r.hidden:>6} {r.micro_batch:>5} {r.predicted_mb:>13.0f} {r.measured_mb:>12.0f} {r.error:>+7.1%}"
        for r in rows
    ]
    lines.append("")
    lines.append(f"{'hidden':>6} {'step s':>8} {'monitor ms':>10} {'overhead':>8}")
    lines += [
        f"{o.hidden:>6} {o.step_seconds:>8.3f} {1000 * o.monitor_seconds:>10.3f} {o.overhead:>8.3%}" for o in overhead
    ]
    return "\n".join(lines)


def as_json(rows: list[MemoryRow], overhead: list[OverheadRow]) -> dict:
    return {"prediction": [asdict(r) for r in rows], "monitoring": [asdict(o) for o in overhead]}
