"""The scaling rows: the plain Trainer's row first, measured in the bench's process, then each worker count against it
(the runs are faked: their timing needs GPUs)."""

from __future__ import annotations

from benchmarks import distributed
from raytrm import config as cfg


def test_scaling_rows_put_each_worker_count_against_the_plain_trainer(monkeypatch):
    training = {"global_batch_size": 8, "compile": "auto", "device": "cpu"}
    config = cfg.from_dict(cfg.ExperimentConfig, {"training": training}, "scaling")
    seen = []

    def timed_steps(rank, world_size, device, experiment, steps, warmup):
        seen.append(("plain", experiment.training.global_batch_size))
        return {"samples_per_sec": 100.0, "step_s": 0.08, "sync_s": 0.0, "compute_s": 0.08, "shares": [8]}

    def run(experiment, workers, steps, warmup):
        batch = experiment.training.global_batch_size
        seen.append((workers, batch))
        rate = {1: 97.0, 2: 192.0}[workers]
        shares = [batch // workers] * workers
        return {"samples_per_sec": rate, "step_s": batch / rate, "sync_s": 0.001, "compute_s": 0.07, "shares": shares}

    monkeypatch.setattr(distributed, "timed_steps", timed_steps)
    monkeypatch.setattr(distributed, "_run", run)
    rows = distributed.bench_scaling(config, [1, 2], steps=20)
    assert seen == [("plain", 8), (1, 8), (2, 16)]  # a fixed batch per worker
    assert [(r.name, r.workers, r.global_batch) for r in rows] == [
        ("1 process, plain Trainer (cpu)", 1, 8),
        ("1 x cpu worker (process group)", 1, 8),
        ("2 x cpu workers (process group)", 2, 16),
    ]
    assert [r.ratio for r in rows] == [1.0, 0.97, 1.92]
    assert all(r.note.startswith("compile auto") for r in rows)
