"""Exact resume, as the tests of every model family check it: a run stopped and resumed equals one that was not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from raytrm.train import checkpoint as ckpt
from raytrm.train.run.metrics import read_metrics

#: Fields of a metrics row that time the run or read the machine: they differ between any two runs.
TIMING_FIELDS = {"samples_per_sec", "tokens_per_sec", "rss_mb", "peak_rss_mb", "cpu_percent"}


def without_timings(run_dir: Path) -> list[dict[str, Any]]:
    """A run's metrics rows less their timing fields."""
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in read_metrics(run_dir / "metrics.jsonl")]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key}"


def assert_same_run(straight: Path, split: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The newest checkpoints of two run directories hold the same bits (weights, EMA, optimizer state, TRM's
    carry where there is one) and their metrics rows agree but for timings; returns the two checkpoints."""
    a = ckpt.latest_good_checkpoint(straight / "checkpoints")
    b = ckpt.latest_good_checkpoint(split / "checkpoints")
    _same(a["model"], b["model"], "model")
    if a.get("ema") is not None or b.get("ema") is not None:
        _same(a["ema"]["shadow"], b["ema"]["shadow"], "ema")
    states = zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values(), strict=True)
    for i, (sa, sb) in enumerate(states):
        _same(sa, sb, f"optimizer state {i}")
    if a.get("carry") is not None or b.get("carry") is not None:
        _same(a["carry"], b["carry"], "carry")
    assert without_timings(straight) == without_timings(split)
    return a, b
