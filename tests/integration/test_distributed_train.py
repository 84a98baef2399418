"""`raytrm train --workers/--address` on the shared local Ray: Ray Train workers give one process's update, take
their tier's profile, survive a lost worker, and bad input is one line before any worker starts."""

from __future__ import annotations

import re
import threading
import time

import psutil
import pytest
import torch

from raytrm import config as cfg
from raytrm.data.build import build_dataset
from raytrm.distributed.ray_train import train_distributed
from raytrm.errors import UserError
from raytrm.train import checkpoint as ckpt
from raytrm.train.run.metrics import read_metrics
from raytrm.train.run.training import run_training

TIER_A, TIER_B = "macbook-air-8gb", "mac-desktop-16gb"  # the conftest's two logical nodes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def puzzles(tmp_path_factory):
    return build_dataset("sudoku", tmp_path_factory.mktemp("data") / "sudoku", count=200, test_count=16, seed=3)


def experiment(puzzles, **training) -> cfg.ExperimentConfig:
    return cfg.from_dict(
        cfg.ExperimentConfig,
        {
            "model": {"hidden_size": 32, "L_layers": 1, "H_cycles": 2, "L_cycles": 1, "halt_max_steps": 3},
            "data": {"path": str(puzzles)},
            "training": {
                "global_batch_size": 24,
                "lr": 3e-3,
                "warmup_steps": 2,
                "threads": 1,
                "seed": 4,
                "log_interval": 1,
                "sync_mode": "exact",  # one process's update, whatever `auto` would choose on a loaded machine
                **training,
            },
        },
    )


def assert_same_training(a_dir, b_dir, lr):
    a = ckpt.latest_good_checkpoint(a_dir / "checkpoints")
    b = ckpt.latest_good_checkpoint(b_dir / "checkpoints")
    assert a["step"] == b["step"]
    for key, value in a["model"].items():  # Adam turns rounding into at most ~lr a step
        torch.testing.assert_close(value, b["model"][key], rtol=0, atol=1e-2 * lr, msg=key)
    for key, value in a["carry"].items():
        if not value.is_floating_point():  # the same examples in the same slots, halted alike
            assert torch.equal(value, b["carry"][key]), key


def test_two_ray_train_workers_equal_one_process(ray_cluster, puzzles, tmp_path):
    config = experiment(puzzles, steps=5)
    summary = train_distributed(config, tmp_path / "two", workers=2, progress=False)
    run_training(config, tmp_path / "one")
    assert (summary["workers"], sum(summary["shares"]), summary["steps"]) == (2, 24, 5)
    assert_same_training(tmp_path / "one", tmp_path / "two", config.training.lr)
    rows = [r["workers"] for r in read_metrics(tmp_path / "two" / "metrics.jsonl") if "workers" in r]
    assert len(rows) == 5 and all(len(r) == 2 and r[0]["sync_s"] > 0 for r in rows)


def test_ray_train_workers_choose_their_sync_mode_from_the_link_and_say_why(ray_cluster, puzzles, tmp_path):
    summary = train_distributed(experiment(puzzles, steps=5, sync_mode="auto"), tmp_path / "auto", workers=2)
    assert summary["sync_mode"] in ("exact", "compressed", "local") and "Mbit/s" in summary["sync_reason"]
    assert len(summary["sync_share"]["workers"]) == 2 and 0 <= summary["sync_share"]["run"] < 1
    lines = read_metrics(tmp_path / "auto" / "metrics.jsonl")
    # Once: at the first step after the timed ones (3) that the memory governor no longer probes (its probe ends
    # with step 3, and the sync hook sees a step before the governor does).
    assert [(e["step"], e["mode"]) for e in lines if e.get("event") == "sync-choice"] == [(4, summary["sync_mode"])]
    assert all("sync_s" in r and "sync_share" in r for r in lines if "event" not in r)


def profile(config: cfg.ExperimentConfig, tier: str, micro: int, speed: float) -> cfg.Profile:
    data = {k: cfg.to_dict(getattr(config, k)) for k in ("model", "data", "training")}
    data["training"].update(micro_batch_size=micro, grad_accum_steps=24 // micro)
    return cfg.from_dict(
        cfg.Profile,
        {
            "tier": tier,
            **data,
            "limits": {"memory_budget_mb": 4000, "thermal_cap": "serious"},
            "measured": {"samples_per_sec": speed},
        },
    )


@pytest.mark.parametrize("elastic", [False, True], ids=["ray-train", "own-actors"])
def test_one_worker_per_machine_each_with_its_tier_profile(ray_cluster, puzzles, tmp_path, elastic):
    config = experiment(puzzles, steps=3)
    profiles = [profile(config, TIER_A, 4, 300.0), profile(config, TIER_B, 12, 100.0)]
    summary = train_distributed(
        config,
        tmp_path / "run",
        address=ray_cluster.address,
        profiles=profiles,
        profile_names=["a.yaml", "b.yaml"],
        progress=False,
        balance=False,
        elastic=elastic,
    )
    rows = [r["workers"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "workers" in r][-1]
    by_share = {row["share"]: row["micro_batch"] for row in rows}
    # Shares start from the profiles' measured speeds (3:1); each worker cuts its share at its tier's micro-batch.
    assert sorted(summary["shares"]) == [6, 18]
    assert by_share == {18: 4, 6: 6}  # tier B's 12 is capped by its share of 6


def test_a_lost_worker_restarts_the_group_from_the_last_checkpoint(ray_cluster, puzzles, tmp_path):
    config = experiment(puzzles, steps=60, checkpoint_interval=2)  # long enough to be killed mid-run
    run_dir = tmp_path / "run"
    done: dict = {}
    runner = threading.Thread(
        target=lambda: done.update(summary=train_distributed(config, run_dir, workers=2, progress=False))
    )
    runner.start()
    deadline = time.time() + 240
    while not ckpt.list_checkpoints(run_dir / "checkpoints") and time.time() < deadline:
        time.sleep(0.2)
    workers = [p for p in psutil.process_iter(["cmdline"]) if "RayTrainWorker" in " ".join(p.info["cmdline"] or [])]
    assert workers, "no Ray Train worker process found"
    workers[-1].kill()
    runner.join(timeout=400)
    assert done["summary"]["steps"] == 60
    assert done["summary"]["resumed_from_step"] is not None and done["summary"]["resumed_from_step"] >= 2
    # Ray Train's account of the restart is in the run's log, off the terminal: rank 0 warns of it itself
    restarted = f"the workers restarted after a failure (Ray's account: {run_dir / 'logs' / 'driver.log'})"
    assert restarted in (run_dir / "logs" / "worker-0.log").read_text()
    run_training(config, tmp_path / "straight")
    assert_same_training(tmp_path / "straight", run_dir, config.training.lr)


def test_bad_input_is_one_line_before_any_worker_starts(ray_cluster, puzzles, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # this machine's ~/.ray/auth_token, whatever its state, is not read
    config = experiment(puzzles, steps=2)
    with pytest.raises(UserError, match=r"--workers 0: expected a number of workers >= 1"):
        train_distributed(config, tmp_path / "a", workers=0)
    with pytest.raises(UserError, match=r"--workers 3: the cluster has 2 raytrm machine\(s\)"):
        train_distributed(config, tmp_path / "b", workers=3, address=ray_cluster.address)
    with pytest.raises(UserError, match=r"--profile for tier\(s\) macbook-pro-16gb: no node of the cluster"):
        train_distributed(
            config,
            tmp_path / "c",
            workers=2,
            profiles=[profile(config, "macbook-pro-16gb", 4, 1.0)],
            profile_names=["p.yaml"],
        )
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UserError, match=r"cannot write the run directory"):
        train_distributed(config, blocker / "run", workers=2)
    with pytest.raises(UserError, match=r"--address 127.0.0.1:1: cannot reach a Ray head there"):
        train_distributed(config, tmp_path / "d", workers=2, address="127.0.0.1:1")
    missing = experiment(puzzles, steps=2)
    missing.data.path = str(tmp_path / "no-such-dataset")
    with pytest.raises(UserError, match=r"no-such-dataset: no such dataset on this node"):
        train_distributed(missing, tmp_path / "e", workers=2)
    assert not any((tmp_path / name).exists() for name in "abcde")


def test_a_workers_bad_input_is_one_line_too(ray_cluster, puzzles, tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step-00000002.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match=r"no checkpoint verifies"):
        train_distributed(experiment(puzzles, steps=4), tmp_path / "run", workers=2, resume=True, max_failures=0)


def test_a_checkpoint_that_does_not_fit_stops_a_resume_before_any_worker_starts(ray_cluster, puzzles, tmp_path, capsys):
    """Checked by the driver: one line and exit 2, no retries, no worker's traceback (Ray Train never starts)."""
    from raytrm.cli import main

    run = tmp_path / "run"
    run_training(experiment(puzzles, steps=2), run)
    path = ckpt.list_checkpoints(run / "checkpoints")[-1]
    state = ckpt.load_checkpoint(path)
    step = state.pop("_header")["step"]
    state["carry"]["z_H"] = state["carry"]["z_H"][..., :8].clone()  # its checksum is valid: the shape is wrong
    ckpt.save_checkpoint(state, path.parent, step)
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--workers", "2", "--steps", "4", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.match(
        rf"raytrm: error: {re.escape(str(path))}: carry.z_H holds a tensor of shape \(24, \d+, 8\), this "
        r"config builds a tensor of shape \(24, \d+, 32\)",
        err[0],
    ), err[0]
    assert not (run / "ray").exists()  # Ray Train's storage: no trainer was started
