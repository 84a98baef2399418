"""The distributed run loop without Ray (gloo processes): rank 0 writes the run directory, resume is exact on the
same worker count and continues the same samples on another, and a slow worker gets a smaller share."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.distributed import slow_down
from raytrm import config as cfg
from raytrm.distributed.launch import spawn
from raytrm.sync.process_group import ProcessGroupSync
from raytrm.train import checkpoint as ckpt
from raytrm.train.run.metrics import read_metrics
from raytrm.train.run.training import run_training

pytestmark = pytest.mark.slow  # worker processes: tens of seconds per file


def run_worker(rank, world_size, device, config, run_dir, resume=False, shares=None, balance=False, slow=None):
    """One worker of a distributed run_training; `slow` = (rank, factor) makes that rank's compute factor x slower."""
    if slow is not None and slow[0] == rank:
        slow_down(slow[1])
    summary = run_training(
        config, run_dir, resume=resume, sync=ProcessGroupSync(device), shares=shares, balance=balance
    )
    return summary if rank == 0 else None


def state(run_dir):
    return ckpt.latest_good_checkpoint(run_dir / "checkpoints")


def assert_states(a, b, atol, carry_atol):
    assert a["step"] == b["step"]
    for part in ("model",):
        for key in a[part]:
            torch.testing.assert_close(a[part][key], b[part][key], rtol=0, atol=atol, msg=key)
    for key in a["ema"]["shadow"]:
        torch.testing.assert_close(a["ema"]["shadow"][key], b["ema"]["shadow"][key], rtol=0, atol=atol, msg=key)
    for key, value in a["carry"].items():
        if value.is_floating_point():
            torch.testing.assert_close(value, b["carry"][key], rtol=0, atol=carry_atol, msg=key)
        else:  # the same examples in the same slots, the same step counts and halting
            assert torch.equal(value, b["carry"][key]), key


def test_rank0_writes_the_run_with_per_worker_rows(tiny, tmp_path):
    config = tiny(training={"steps": 4, "memory_budget_mb": 8192})
    summary = spawn(run_worker, 2, config, tmp_path / "run", False, [12, 20])[0]
    assert (summary["workers"], summary["shares"], summary["steps"]) == (2, [12, 20], 4)
    names = sorted(p.name for p in tmp_path.joinpath("run").iterdir())
    assert [n for n in names if n != "tensorboard"] == ["checkpoints", "config.yaml", "metrics.jsonl", "summary.json"]
    if "tensorboard" in names:  # the optional extra: rank 0's event file only
        assert len(list(tmp_path.joinpath("run", "tensorboard").glob("events.out.tfevents.*"))) == 1
    lines = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "workers" in r]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    for record in lines:
        assert [w["share"] for w in record["workers"]] == [12, 20]
        assert all(w["sync_s"] > 0 and w["samples_per_sec"] > 0 for w in record["workers"])
        # Each worker's memory governor caps its share once it has fitted its memory (after 3 probe steps).
        caps = [w["share_cap"] for w in record["workers"]]
        assert caps == [None, None] if record["step"] < 3 else all(c > b for c, b in zip(caps, [12, 20], strict=True))
    # Each worker's governor chose its own micro-batch after its probe steps; rank 0 wrote both choices.
    chosen = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("event") == "choose"]
    assert sorted(r["rank"] for r in chosen) == [0, 1]
    assert {r["step"] for r in chosen} == {3}


def test_resume_is_exact_on_the_same_workers_and_continues_on_others(tiny, tmp_path):
    config = tiny(training={"steps": 6})
    spawn(run_worker, 2, config, tmp_path / "straight", False, [10, 22])
    spawn(run_worker, 2, tiny(training={"steps": 3}), tmp_path / "split", False, [10, 22])
    resumed = spawn(run_worker, 2, config, tmp_path / "split", True, [10, 22])[0]
    assert resumed["resumed_from_step"] == 3
    # Same workers, same shares: the same operations in the same order, so the same bits.
    assert_states(state(tmp_path / "straight"), state(tmp_path / "split"), atol=0, carry_atol=0)

    # Three workers continue what two began: the same samples and slots, summed in another order.
    spawn(run_worker, 2, tiny(training={"steps": 3}), tmp_path / "grown", False, [10, 22])
    spawn(run_worker, 3, config, tmp_path / "grown", True, [5, 13, 14])
    alone = run_training(config, tmp_path / "alone")
    assert alone["steps"] == 6
    # Adam moves a weight by about lr a step and amplifies rounding where v is ~0: compare on that scale; the
    # states are O(1) after weights that differ by rounding (as in the one-process accumulation test).
    assert_states(state(tmp_path / "alone"), state(tmp_path / "grown"), atol=1e-2 * config.training.lr, carry_atol=1e-4)


# A distributed run in its own process group, so one signal kills the launcher and every worker at once.
CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
from raytrm import config as cfg
from raytrm.distributed.launch import spawn
from test_distributed_run import run_worker
spawn(run_worker, 2, cfg.load(cfg.ExperimentConfig, sys.argv[2]), sys.argv[3], False, [10, 22])
"""


@pytest.mark.parametrize("seed", [0])  # each seed is three two-worker runs: 40 s
def test_killed_at_a_random_moment_then_resumed_equals_an_uninterrupted_run(tiny, tmp_path, seed):
    # Every worker SIGKILLed at once, a random moment after a random checkpoint (mid-step, mid-sync or mid-write),
    # then resumed on as many workers with the same shares: the same bits as a run never stopped.
    config = tiny(training={"steps": 12, "checkpoint_interval": 2})
    spawn(run_worker, 2, config, tmp_path / "straight", False, [10, 22])
    rng = random.Random(seed)
    nth, delay = rng.randrange(1, 3), rng.uniform(0.0, 0.3)  # after the 1st or 2nd of 6 checkpoints
    run_dir = tmp_path / "killed"
    config_file = cfg.write_yaml(config, tmp_path / "config.yaml")
    with open(tmp_path / "child.log", "w") as log:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(Path(__file__).parent), str(config_file), str(run_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 300
            while len(ckpt.list_checkpoints(run_dir / "checkpoints")) < nth:
                assert child.poll() is None, (tmp_path / "child.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "no checkpoint in time"
                time.sleep(0.02)
            time.sleep(delay)
        finally:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    kept = ckpt.latest_good_checkpoint(run_dir / "checkpoints")
    assert kept is not None and 2 * nth <= kept["step"] < 12, "killed before its checkpoint, or after the run ended"
    resumed = spawn(run_worker, 2, config, run_dir, True, [10, 22])[0]
    assert resumed["resumed_from_step"] == kept["step"] and resumed["steps"] == 12
    assert_states(state(tmp_path / "straight"), state(run_dir), atol=0, carry_atol=0)


def test_a_slow_worker_gets_a_smaller_share(tiny, tmp_path):
    config = tiny(training={"steps": 8, "global_batch_size": 48})
    summary = spawn(run_worker, 2, config, tmp_path / "run", False, None, True, (1, 3.0))[0]
    events = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("event") == "rebalance"]
    assert events, "the balancer never moved the shares"
    first = events[0]
    assert first["shares_from"] == [24, 24] and sum(first["shares_to"]) == 48
    assert first["shares_to"][1] < first["shares_to"][0]
    assert first["predicted_step_s_to"] < first["predicted_step_s_from"]
    assert "worker 1" in first["reason"]
    assert summary["shares"][1] < summary["shares"][0]
    assert [e["shares_to"] for e in summary["rebalances"]] == [e["shares_to"] for e in events]
