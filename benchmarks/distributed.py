"""`python -m benchmarks distributed`: what data-parallel training across unequal workers costs and gains, side by side.

- pair: two workers of deliberately unequal speed (one made `slowdown` times slower by sleeping in proportion to its
  compute, as a slower Mac would be) train one model. Balanced shares against equal shares, both against the sum of
  the two workers' solo throughputs, measured in one run.
- ray: the per-step cost of Ray Train against the plain Trainer at one worker, alternated.
- sync: the gradient all-reduce of the reference TRM (5.0M parameters) measured here, and the time the same bytes
  take at 1 GbE, 10 GbE and a Thunderbolt bridge, computed from the bytes a ring all-reduce moves; with the
  samples per worker and step that keep sync under 10% of a step.
- overlap: two workers training the byte-level LM with the gradient all-reduce overlapped with the last backward,
  against summed after it, alternated: step time, the sync time left after the backward, and the fraction of the
  gradient bytes that started during it.
- scaling (`--device cuda --workers 1 2`): samples/s at the reference TRM config, compiled as training compiles
  it, in one process with no process group (the plain Trainer), then as 1, 2, ... workers (NCCL), each against it.
- modes: the quality each sync mode reaches at equal samples, two workers, over seeds (in benchmarks.modes).

The worker processes are plain torch.distributed processes (raytrm.distributed.launch) running the same Trainer,
sync object and balancer as Ray Train workers; the `ray` rows measure what Ray adds on top.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from raytrm import config as cfg
from raytrm.data.build import build_dataset
from raytrm.distributed.launch import spawn
from raytrm.families.trm import TRMTask
from raytrm.hardware import device as devices
from raytrm.sync.contract import LocalSync
from raytrm.sync.peers import Peers
from raytrm.sync.process_group import ProcessGroupSync
from raytrm.train.trainer import Trainer

logger = logging.getLogger(__name__)

#: Links between Macs, by their line rate in Gbit/s (a Thunderbolt bridge's IP throughput is below its line rate).
LINKS = {"1 GbE": 1.0, "10 GbE": 10.0, "Thunderbolt 4 bridge (line rate)": 40.0}


def slow_down(factor: float) -> None:
    """Make this process's TRM micro-steps `factor` times slower, by sleeping after each in proportion to it."""
    real = TRMTask.micro_step

    def micro_step(self: TRMTask, *args: Any) -> Any:
        start = time.perf_counter()
        out = real(self, *args)
        devices.synchronize(self.device)  # a micro-step returns before the device is done
        time.sleep((factor - 1) * (time.perf_counter() - start))
        return out

    TRMTask.micro_step = micro_step  # type: ignore[method-assign]


def timed_steps(
    rank: int,
    world_size: int,
    device: torch.device,
    config: cfg.ExperimentConfig,
    steps: int,
    warmup: int,
    balance: bool = False,
    slow: tuple[int, float] | None = None,
    overlap: bool = True,
) -> dict[str, Any] | None:
    """One worker: warm-up steps (the balancer settles there), then timed steps; rank 0 reports medians. A worker
    of a process group syncs through it (one alone too: the distributed path), a process without one is the plain
    Trainer."""
    if slow is not None and slow[0] == rank:
        slow_down(slow[1])
    grouped = torch.distributed.is_available() and torch.distributed.is_initialized()
    sync = ProcessGroupSync(device, overlap=overlap) if grouped else LocalSync()
    trainer = Trainer(config, sync=sync)
    peers = Peers(trainer, balance=balance)
    times, compute, syncs, overlapped = [], [], [], []
    for k in range(warmup + steps):
        start = time.perf_counter()
        result = trainer.train_step()
        peers.exchange(result)
        if k >= warmup:
            times.append(time.perf_counter() - start)
            compute.append(result.compute_seconds)
            syncs.append(result.sync_seconds)
            overlapped.append(trainer.last_overlap)
    trainer.close()
    if rank:
        return None
    step_s = statistics.median(times)
    return {
        "step_s": step_s,
        "samples_per_sec": trainer.global_batch / step_s,
        "compute_s": statistics.median(compute),
        "sync_s": statistics.median(syncs),
        "overlap": statistics.median(overlapped),
        "shares": list(trainer.shares),
        "rebalances": len(peers.balancer.events) if peers.balancer else 0,
    }


@dataclass
class Row:
    """One measured configuration."""

    bench: str
    name: str
    workers: int
    global_batch: int
    samples_per_sec: float
    step_s: float
    sync_s: float
    shares: list[int]
    #: The row's throughput against its bench's baseline (the sum of solo throughputs; the plain Trainer; one GPU).
    ratio: float | None = None
    note: str = ""


def _run(
    config: cfg.ExperimentConfig,
    workers: int,
    steps: int,
    warmup: int,
    balance: bool = False,
    slow: tuple[int, float] | None = None,
    overlap: bool = True,
) -> dict[str, Any]:
    device = devices.pick_device(config.training.device).type
    return spawn(timed_steps, workers, config, steps, warmup, balance, slow, overlap, device=device)[0]


def bench_pair(config: cfg.ExperimentConfig, slowdown: float, steps: int, repeats: int) -> list[Row]:
    """Solo fast, solo slow, equal and balanced pairs, alternated `repeats` times; medians."""
    runs: dict[str, list[dict[str, Any]]] = {"solo fast": [], "solo slow": [], "equal shares": [], "balanced": []}
    for _ in range(repeats):
        runs["solo fast"].append(_run(config, 1, steps, 2))
        runs["solo slow"].append(_run(config, 1, steps, 2, slow=(0, slowdown)))
        runs["equal shares"].append(_run(config, 2, steps, 2, slow=(1, slowdown)))
        runs["balanced"].append(_run(config, 2, steps, 8, balance=True, slow=(1, slowdown)))
    med = {name: _median_run(found) for name, found in runs.items()}
    solo_sum = med["solo fast"]["samples_per_sec"] + med["solo slow"]["samples_per_sec"]
    rows = []
    for name, run in med.items():
        pair = name in ("equal shares", "balanced")
        rows.append(
            Row(
                "pair",
                name,
                2 if pair else 1,
                config.training.global_batch_size,
                run["samples_per_sec"],
                run["step_s"],
                run["sync_s"],
                run["shares"],
                ratio=run["samples_per_sec"] / solo_sum if pair else None,
                note=f"worker 1 slowed {slowdown:g}x" if pair else ("slowed" if name == "solo slow" else ""),
            )
        )
    return rows


def _median_run(found: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median throughput (its shares and times belong together)."""
    return sorted(found, key=lambda r: r["samples_per_sec"])[len(found) // 2]


def bench_ray(config: cfg.ExperimentConfig, work_dir: Path, repeats: int) -> list[Row]:
    """samples/s of the plain Trainer's run and of one Ray Train worker's run of the same steps, alternated."""
    import ray

    from raytrm.distributed.cluster import connect
    from raytrm.distributed.ray_train import train_distributed, worker_config
    from raytrm.train.run.training import run_training

    # The plain run gets exactly what the one Ray worker will run with: this machine's tier fills the same fields.
    job = {"config": config, "machines": {}, "explicit": [], "workers_per_machine": 1}
    alone = worker_config(job, tier="")
    plain, on_ray = [], []
    owned = connect(None, dashboard=True)  # a local Ray as `raytrm train --workers` starts it
    try:
        for k in range(repeats):
            plain.append(run_training(alone, work_dir / f"plain-{k}")["samples_per_sec"])
            summary = train_distributed(config, work_dir / f"ray-{k}", workers=1, progress=False)
            on_ray.append(summary["samples_per_sec"])
    finally:
        if owned:
            ray.shutdown()
    batch = config.training.global_batch_size
    p, r = statistics.median(plain), statistics.median(on_ray)
    ratios = sorted(b / a for a, b in zip(plain, on_ray, strict=True))  # each Ray run against the plain run before it
    mid = statistics.median(ratios)
    note = f"training steps only; per-pair ratios {ratios[0]:.3f}-{ratios[-1]:.3f}, median {mid:.3f}"
    return [
        Row("ray", "plain Trainer", 1, batch, p, batch / p, 0.0, [batch]),
        Row("ray", "Ray Train worker", 1, batch, r, batch / r, 0.0, [batch], ratio=r / p, note=note),
    ]


def all_reduce_seconds(rank: int, world_size: int, device: torch.device, params: int, repeats: int) -> float | None:
    """Median seconds of the sync object's all-reduce of `params` fp32 gradients."""
    tensors = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in _chunks(params)]
    for t in tensors:
        t.grad = torch.randn_like(t)
    sync = ProcessGroupSync(device)
    times = [sync.all_reduce_gradients(tensors) for _ in range(repeats + 2)][2:]
    return statistics.median(times) if rank == 0 else None


def _chunks(total: int, size: int = 512 * 512) -> list[int]:
    """Parameter tensors of about a layer's size that add up to total."""
    return [size] * (total // size) + ([total % size] if total % size else [])


def bench_sync(params: int, workers: int, samples_per_sec: float, repeats: int) -> list[Row]:
    """The measured all-reduce here, and the computed time at each link with the samples that keep sync < 10%."""
    measured = spawn(all_reduce_seconds, workers, params, repeats, device=devices.CPU)[0]
    bytes_on_wire = 2 * (workers - 1) / workers * params * 4  # each worker sends (and receives) this in a ring
    rows = [Row("sync", "loopback (gloo, measured)", workers, 0, 0.0, 0.0, measured, [], note=f"{params:,} params")]
    for link, gbit in LINKS.items():
        seconds = bytes_on_wire * 8 / (gbit * 1e9)
        # sync / (compute + sync) < 10%  <=>  compute > 9 x sync  <=>  samples per worker > 9 x sync x rate
        need = max(1, math.ceil(9 * seconds * samples_per_sec))
        rows.append(
            Row(
                "sync",
                link,
                workers,
                0,
                0.0,
                0.0,
                seconds,
                [],
                note=f"{bytes_on_wire / 2**20:.1f} MiB per worker; sync < 10% of a step from {need} samples per worker "
                f"and step at this machine's {samples_per_sec:.1f} reference samples/s per worker",
            )
        )
    return rows


def bench_overlap(config: cfg.ExperimentConfig, workers: int, steps: int, repeats: int) -> list[Row]:
    """The LM's step with its all-reduce overlapped with the last backward and after it, alternated per repeat."""
    found: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(repeats):
        for overlap in (False, True):
            found[overlap].append(_run(config, workers, steps, 2, overlap=overlap))
    batch = config.training.global_batch_size
    rows = []
    for overlap, name in ((False, "all-reduce after the backward"), (True, "all-reduce overlapped")):
        step_s = statistics.median(r["step_s"] for r in found[overlap])
        rows.append(
            Row(
                "overlap",
                name,
                workers,
                batch,
                batch / step_s,
                step_s,
                statistics.median(r["sync_s"] for r in found[overlap]),
                found[overlap][0]["shares"],
                ratio=rows[0].step_s / step_s if rows else 1.0,
                note=f"{statistics.median(r['overlap'] for r in found[overlap]):.0%} of the gradient bytes started "
                "before the backward returned",
            )
        )
    return rows


def small_lm(work_dir: Path, device: str, batch: int) -> cfg.ExperimentConfig:
    """The overlap bench's model: the byte-level LM at hidden 256, 4 layers and 256 bytes on the CPU (3.2M
    parameters), hidden 1024, 8 layers and 512 bytes on a GPU (101M)."""
    from benchmarks.transformer import HEAD_DIM, synthetic_corpus

    big = device == devices.CUDA
    hidden = 1024 if big else 256
    model = {
        "name": "transformer",
        "hidden_size": hidden,
        "num_heads": hidden // HEAD_DIM,
        "layers": 8 if big else 4,
        "seq_len": 512 if big else 256,
    }
    training = {"global_batch_size": batch, "device": device, "lr": 1e-3, "warmup_steps": 2}
    data = {"name": "text", "path": str(synthetic_corpus(work_dir / "corpus.txt"))}
    return cfg.from_dict(cfg.ExperimentConfig, {"model": model, "data": data, "training": training})


def bench_scaling(config: cfg.ExperimentConfig, counts: list[int], steps: int, warmup: int = 5) -> list[Row]:
    """samples/s at a fixed per-worker batch: the plain Trainer in this process (no process group), then 1, 2, ...
    workers of one process group, a device each (weak scaling), each row's ratio against the plain Trainer's."""
    per_worker = config.training.global_batch_size
    device = devices.pick_device(config.training.device)
    alone = timed_steps(0, 1, device, config, steps, warmup)
    assert alone is not None
    devices.empty_cache(device)  # the workers' devices include this one
    compiled = f"compile {config.training.compile}"
    plain = f"1 process, plain Trainer ({device.type})"
    rate = alone["samples_per_sec"]
    rows = [Row("scaling", plain, 1, per_worker, rate, alone["step_s"], 0.0, alone["shares"], 1.0, compiled)]
    for n in counts:
        scaled = cfg.from_dict(
            cfg.ExperimentConfig,
            {**cfg.to_dict(config), "training": {**cfg.to_dict(config.training), "global_batch_size": per_worker * n}},
        )
        run = _run(scaled, n, steps, warmup)
        rows.append(
            Row(
                "scaling",
                f"{n} x {device.type} worker{'s' if n > 1 else ''} (process group)",
                n,
                per_worker * n,
                run["samples_per_sec"],
                run["step_s"],
                run["sync_s"],
                run["shares"],
                ratio=run["samples_per_sec"] / rate,
                note=f"{compiled}; compute {run['compute_s']:.4f} s a step",
            )
        )
    return rows


def sudoku(work_dir: Path, count: int) -> Path:
    """A Sudoku dataset for the bench's runs (generated once per work directory)."""
    data_dir = work_dir / "sudoku"
    if not (data_dir / "test" / "dataset.json").exists():
        build_dataset("sudoku", data_dir, count=count, test_count=16, givens=36, overwrite=True)
    return data_dir


def small_trm(data_dir: Path, batch: int, steps: int | None = None) -> cfg.ExperimentConfig:
    """The pair bench's model: a TRM whose step is mostly compute at one thread (hidden 128, H 2, L 3)."""
    model = {"hidden_size": 128, "L_layers": 2, "H_cycles": 2, "L_cycles": 3, "halt_max_steps": 4}
    training = {"global_batch_size": batch, "threads": 1, "lr": 1e-3, "warmup_steps": 2, "steps": steps}
    return cfg.from_dict(cfg.ExperimentConfig, {"model": model, "data": {"path": str(data_dir)}, "training": training})


def format_rows(rows: list[Row]) -> str:
    lines = [
        f"{'bench':<8} {'configuration':<34} {'workers':>7} {'batch':>5} {'samples/s':>10} {'step s':>8} "
        f"{'sync s':>8} {'ratio':>6}  shares / note"
    ]
    for r in rows:
        ratio = f"{r.ratio:>6.3f}" if r.ratio is not None else f"{'':>6}"
        extra = " ".join(x for x in (str(r.shares) if r.shares else "", r.note) if x)
        lines.append(
            f"{r.bench:<8} {r.name:<34} {r.workers:>7} {r.global_batch:>5} {r.samples_per_sec:>10.2f} "
            f"{r.step_s:>8.3f} {r.sync_s:>8.4f} {ratio}  {extra}"
        )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]


def run(
    parts: list[str],
    device: str,
    batch: int,
    slowdown: float,
    repeats: int,
    workers: list[int],
    work_dir: Path,
    compile_mode: str = "auto",
) -> list[Row]:
    """The parts asked for, in order; see the module docstring. compile_mode: the scaling rows' training.compile
    (auto: as training compiles)."""
    from benchmarks.timing import median_seconds
    from benchmarks.trm import reference_experiment

    data_dir = sudoku(work_dir, count=512)
    rows: list[Row] = []
    if "pair" in parts:
        rows += bench_pair(small_trm(data_dir, batch), slowdown, steps=6, repeats=repeats)
    if "ray" in parts:
        rows += bench_ray(small_trm(data_dir, batch, steps=40), work_dir, repeats)
    if "sync" in parts:
        reference = Trainer(reference_experiment("mlp_t", 512, 8, 2, device, data_dir, "auto"))
        rate = 8 / median_seconds(reference.train_step, reference.device, warmup=1, repeats=3)
        params = reference.model.num_parameters()
        reference.close()
        rows += bench_sync(params, max(2, max(workers)), rate, repeats=10)
    if "overlap" in parts:
        from benchmarks.transformer import caches_in

        with caches_in(work_dir / "cache"):
            rows += bench_overlap(small_lm(work_dir, device, batch), max(2, max(workers)), 6, repeats)
    if "scaling" in parts:
        scaling = reference_experiment("mlp_t", 512, batch, None, device, data_dir, "auto", compile_mode)
        rows += bench_scaling(scaling, workers, steps=20)
    return rows
