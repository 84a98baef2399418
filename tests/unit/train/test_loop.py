"""The training loop's rules: schedule, time budget, loader workers giving the same batches."""

from __future__ import annotations

import pytest

from raytrm import config as cfg
from raytrm.train.run import run_training
from raytrm.train.trainer import Trainer, lr_at


def test_warmup_then_constant_or_cosine():
    t = cfg.from_dict(cfg.TrainConfig, {"lr": 1.0, "warmup_steps": 4})
    assert [lr_at(s, t, 100) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    c = cfg.from_dict(cfg.TrainConfig, {"lr": 1.0, "warmup_steps": 0, "schedule": "cosine", "min_lr_ratio": 0.1})
    assert lr_at(0, c, 10) == pytest.approx(1.0)
    assert lr_at(5, c, 10) == pytest.approx(0.55)
    assert lr_at(10, c, 10) == pytest.approx(0.1)


def test_time_budget_stops_the_run(tiny, tmp_path):
    summary = run_training(tiny(training={"time_budget_s": 1.0}), tmp_path)
    assert summary["steps"] >= 1
    assert summary["train_seconds"] < 1.0 + 5.0  # stops at the first step boundary past the budget


def test_loader_workers_give_the_same_batches(tiny):
    inline = Trainer(tiny(training={"dataloader_workers": 0}))
    workers = Trainer(tiny(training={"dataloader_workers": 1}))
    for _ in range(3):
        a, b = inline._next_global_batch(), workers._next_global_batch()
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].equal(b[key]), key
    workers.close()
