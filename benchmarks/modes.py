"""`python -m benchmarks distributed --parts modes`: the quality each sync mode reaches at equal samples, two workers.

Two gloo worker processes (raytrm.distributed.launch; no network shaping: a link changes how fast samples come,
never what they teach) train the quick space's model (tune_spaces/quick.yaml's base, its EMA, evaluated on its 512
test puzzles) for the same number of samples in each mode: exact sync, compressed, and local rounds for each H
asked, with plain averaging (outer lr 1, no momentum), with DiLoCo's outer Nesterov (lr 0.7, momentum 0.9), and
with plain averaging whose exchange lands one step late (the overlapped round). Every variant runs the same
training seeds, from a first seed on (so seeds can run side by side in separate processes); a row gives each seed's
eval cell accuracy, the mean, and the gap to exact sync paired by seed (its mean, and the worst seed's). Shares stay
fixed, so a seed's run does not depend on timing: equal, or (`--shares 2 1 1`) one worker per weight with the global
batch split in proportion, as the balancer splits it for a Studio and two MacBooks (a local round then weighs each
worker's delta by its samples).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import statistics
from pathlib import Path
from typing import Any

from benchmarks.distributed import Row
from raytrm import config as cfg
from raytrm.distributed.launch import spawn
from raytrm.sync.process_group import ProcessGroupSync
from raytrm.train.run.training import run_training

logger = logging.getLogger(__name__)

#: The samples each run trains: 500 steps of the quick space's global batch of 32, about its one-minute horizon on
#: a 2-core CPU.
SAMPLES = 16_000
EVERY = (5, 20, 50)
SEEDS = 3
METRIC = "eval_cell_acc"


@dataclasses.dataclass
class ModeRow(Row):
    """A variant's quality at equal samples, over seeds, beside exact sync's."""

    seeds: list[int] = dataclasses.field(default_factory=list)
    accuracy: list[float] = dataclasses.field(default_factory=list)
    gap: float | None = None  # mean over seeds of (this variant - exact), paired by seed
    worst_gap: float | None = None


#: The kinds of variant, as --variants names them.
KINDS = ("exact", "compressed", "plain", "nesterov", "behind")


def variants(
    every: list[int] | tuple[int, ...], kinds: list[str] | tuple[str, ...] = KINDS
) -> list[tuple[str, dict[str, Any]]]:
    """Each variant's name and its training settings, of the kinds asked (exact sync always: the gaps' reference)."""
    out: list[tuple[str, dict[str, Any]]] = [("exact", {"sync_mode": "exact"})]
    if "compressed" in kinds:
        out.append(("compressed", {"sync_mode": "compressed"}))
    plain = {"outer_lr": 1.0, "outer_momentum": 0.0}
    for h in every:
        local = {"sync_mode": "local", "sync_every": h, "sync_overlap": 0}
        if "plain" in kinds:
            out.append((f"local H={h} plain", {**local, **plain}))
        if "nesterov" in kinds:
            out.append((f"local H={h} Nesterov 0.7/0.9", {**local, "outer_lr": 0.7, "outer_momentum": 0.9}))
        if h > 1 and "behind" in kinds:
            out.append((f"local H={h} plain, 1 step behind", {**local, **plain, "sync_overlap": 1}))
    return out


def quick_experiment(seed: int, samples: int, settings: dict[str, Any]) -> cfg.ExperimentConfig:
    """The quick space's base experiment with a training seed, a sample count and sync settings."""
    from raytrm.tune.space import load_space

    data = copy.deepcopy(load_space("quick").base)
    training = data.setdefault("training", {})
    batch = training.get("global_batch_size", cfg.TrainConfig().global_batch_size)
    training.update(seed=seed, steps=max(1, samples // batch), threads=1, log_interval=10**6, **settings)
    return cfg.from_dict(cfg.ExperimentConfig, data, "<quick space>")


def _worker(
    rank: int, world_size: int, device: Any, config: cfg.ExperimentConfig, run_dir: str, shares: list[int] | None
) -> dict | None:
    summary = run_training(config, run_dir, sync=ProcessGroupSync(device), shares=shares, balance=False)
    return summary if rank == 0 else None


def run(
    work_dir: Path,
    every: list[int] | None,
    seeds: int,
    samples: int | None,
    device: str = "cpu",
    first_seed: int = 0,
    weights: list[float] | None = None,
    kinds: list[str] | None = None,
) -> list[ModeRow]:
    """The modes part of `python -m benchmarks distributed`, its data kept in the work directory."""
    from benchmarks.transformer import caches_in

    names = variants(every or EVERY, kinds or KINDS)
    with caches_in(work_dir / "cache"):
        return bench_modes(work_dir / "modes", names, seeds, samples or SAMPLES, device, first_seed, weights)


def bench_modes(
    work_dir: Path,
    names: list[tuple[str, dict[str, Any]]],
    seeds: int,
    samples: int,
    device: str = "cpu",
    first_seed: int = 0,
    weights: list[float] | None = None,
) -> list[ModeRow]:
    """Every variant at seeds first_seed .. first_seed + seeds - 1, seed-major (a partial run has whole seeds), then
    a row per variant; two workers with equal shares, or one per weight with shares in proportion."""
    from raytrm.data.cache import dataset_dir_for
    from raytrm.sync.shares import split

    seed_list = list(range(first_seed, first_seed + seeds))
    span = f"seed {first_seed}" if seeds == 1 else f"seeds {first_seed}-{seed_list[-1]}"
    base = quick_experiment(0, samples, {})
    dataset_dir_for(base.data)  # once, before the workers race to build it
    workers = len(weights) if weights else 2
    shares = split(base.training.global_batch_size, weights) if weights else None
    found: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in names}
    for seed in seed_list:
        for k, (name, settings) in enumerate(names):
            config = quick_experiment(seed, samples, {**settings, "device": device})
            run_dir = str(work_dir / f"seed{seed}-{k}")
            found[name].append(spawn(_worker, workers, config, run_dir, shares, device=device)[0])
            logger.info("seed %d, %s: %s %.4f", seed, name, METRIC, found[name][-1][METRIC])
    exact = [s[METRIC] for s in found["exact"]]
    rows = []
    for name, _ in names:
        runs = found[name]
        accuracy = [s[METRIC] for s in runs]
        gaps = [a - e for a, e in zip(accuracy, exact, strict=True)]
        batch = runs[0]["samples_seen"] // max(runs[0]["steps"], 1)
        rate = statistics.median(s["samples_per_sec"] for s in runs)
        row = ModeRow(
            "modes",
            name,
            workers,
            batch,
            rate,
            batch / rate,
            statistics.median((s.get("sync_share") or {}).get("run", 0.0) for s in runs) * batch / rate,
            list(runs[0].get("shares", [])),
            note=f"cell acc {statistics.mean(accuracy):.4f} ({', '.join(f'{a:.4f}' for a in accuracy)}); "
            f"gap to exact {statistics.mean(gaps):+.4f} (worst {min(gaps):+.4f}) at {runs[0]['samples_seen']} samples, "
            + span,
            seeds=seed_list,
            accuracy=accuracy,
            gap=statistics.mean(gaps),
            worst_gap=min(gaps),
        )
        rows.append(row)
    return rows
