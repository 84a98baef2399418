"""`raytrm tune` against a local Ray: a real study of tiny TRM trials, export, train --profile, over-budget trials,
resume after the driver is killed, and a staged run over two tiers on two logical nodes."""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

from raytrm import config as cfg
from raytrm.cli import main
from raytrm.tune import objectives
from raytrm.tune.layout import STUDY_DB, open_storage
from raytrm.tune.tuner import run_tune

TIER_A, TIER_B = "macbook-air-8gb", "mac-desktop-16gb"  # the conftest's two logical nodes

pytestmark = pytest.mark.slow

TINY = {
    "raytrm_space": 1,
    "base": {
        "model": {
            "variant": "mlp_t",
            "hidden_size": 32,
            "L_layers": 1,
            "H_cycles": 1,
            "L_cycles": 1,
            "halt_max_steps": 2,
        },
        "data": {"name": "sudoku", "train_puzzles": 200, "test_puzzles": 16, "augment": 0, "givens": 40},
        "training": {"global_batch_size": 16, "lr": 3.0e-3, "warmup_steps": 2, "threads": 1},
    },
    "params": {
        "training.micro_batch_size": {"type": "categorical", "choices": [4, 8, 16]},
        "model.L_cycles": {"type": "int", "low": 1, "high": 2},
    },
    "budget": {"warmup_s": 1, "measure_s": 2, "eval_puzzles": 16},
    "limits": {"max_throughput_decay": 1.0},
    "trials": 3,
    "tiers": [TIER_A],
}


def space_file(tmp_path, name="space", **changes) -> Path:
    doc = {**TINY, "name": name, **changes}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def study(run_dir: Path, name: str) -> optuna.Study:
    # open_storage, because the driver may be creating the schema of a new study.db right now
    return optuna.load_study(study_name=name, storage=open_storage(run_dir))


def complete(s: optuna.Study) -> list:
    return s.get_trials(states=(optuna.trial.TrialState.COMPLETE,))


def test_study_exports_a_profile_that_trains(ray_cluster, tmp_path, capsys):
    run = tmp_path / "run"
    assert (
        main(["tune", "--space", str(space_file(tmp_path, "small", horizon={"samples": 64})), "--out", str(run)]) == 0
    )
    out = capsys.readouterr().out
    # A horizon and the quality objective: the speed grid (3 micro-batches) point by point, then the learning
    # grid (L_cycles 1 and 2) once each, trained to the horizon.
    assert out.count(f"[{TIER_A} speed #") == 3 and out.count("[learning #") == 2, out
    assert "verified" in out and "runner-up" in out
    profile_path = run / "profiles" / f"{TIER_A}.yaml"
    profile = cfg.load_profile(profile_path)
    assert profile.tier == TIER_A and profile.limits.memory_budget_mb == 5632  # tiers.yaml's row
    assert profile.measured.samples_per_sec > 0 and profile.measured.objective["verify_samples_per_sec"] > 0
    # It trains for the space's horizon: 64 samples are 4 steps of 16.
    assert (profile.training.steps, profile.training.time_budget_s) == (4, None)
    assert profile.measured.objective["horizon"] == {"samples": 64}
    assert len(complete(study(run, f"small-{TIER_A}-speed"))) == 3
    learning = complete(study(run, "small-learning"))
    assert len(learning) == 2 and all(t.user_attrs["curve"][-1]["samples"] >= 64 for t in learning)
    assert profile.model.L_cycles == max(learning, key=lambda t: t.values[0]).params["model.L_cycles"]
    assert {p.name for p in (run / "plots").iterdir()} >= {f"{TIER_A}-speed-history.png", "learning-history.png"}
    # optuna's own CLI reads the study
    cli = subprocess.run(
        [
            str(Path(sys.executable).parent / "optuna"),
            "trials",
            "--study-name",
            "small-learning",
            "--storage",
            f"sqlite:///{run / STUDY_DB}",
            "-f",
            "json",
        ],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0 and cli.stdout.count('"number"') == 2, (cli.stdout[-300:], cli.stderr[-500:])
    # export by hand writes the same profile; train --profile runs exactly its settings
    assert main(["export", str(run), "--tier", TIER_A, "--out", str(tmp_path / "p.yaml")]) == 0
    assert cfg.load_profile(tmp_path / "p.yaml") == profile
    train_dir = tmp_path / "train"
    assert main(["train", "--profile", str(profile_path), "--steps", "2", "--out", str(train_dir), "--quiet"]) == 0
    summary = json.loads((train_dir / "summary.json").read_text())
    assert max(summary["micro_batches"]) <= profile.training.micro_batch_size
    assert summary["threads"]["threads"] == profile.training.threads


def test_over_budget_trial_is_recorded_infeasible(ray_cluster, tmp_path):
    # micro-batch 128 of a wider model needs ~1.6 GiB; the injected budget is 1200 MiB: the memory model's
    # prediction stops it before the big step, and the study goes on to a feasible one.
    base = json.loads(json.dumps(TINY["base"]))
    base["model"]["hidden_size"] = 256
    base["training"]["global_batch_size"] = 128
    path = space_file(
        tmp_path,
        "budget",
        base=base,
        trials=2,
        params={"training.micro_batch_size": {"type": "categorical", "choices": [8, 128]}},
        start_with=[{"training.micro_batch_size": 128}, {"training.micro_batch_size": 8}],
        limits={"memory_budget_mb": 1200, "max_throughput_decay": 1.0},
    )
    stream = io.StringIO()
    run_tune(str(path), out=str(tmp_path / "run"), stream=stream)
    trials = sorted(complete(study(tmp_path / "run", f"budget-{TIER_A}")), key=lambda t: t.number)
    assert [t.params["training.micro_batch_size"] for t in trials] == [128, 8]
    big, small = trials
    assert big.user_attrs["status"] == "over_budget" and big.constraints["memory"] > 0
    assert big.user_attrs["peak_memory_mb"] > 1200 and big.user_attrs["predicted_memory_mb"] > 1200
    assert objectives.is_feasible(small.constraints), small.user_attrs
    assert "INFEASIBLE(memory)" in stream.getvalue()
    profile = cfg.load_profile(tmp_path / "run" / "profiles" / f"{TIER_A}.yaml")
    assert profile.training.micro_batch_size == 8 and profile.measured.peak_memory_mb <= 1200


def test_resume_after_the_driver_is_killed(ray_cluster, tmp_path):
    import ray

    run = tmp_path / "run"
    path = space_file(tmp_path, "resume", trials=2)
    address = ray.get_runtime_context().gcs_address
    log = tmp_path / "driver.log"
    with log.open("w") as out:
        driver = subprocess.Popen(
            [sys.executable, "-m", "raytrm.cli", "tune", "--space", str(path), "--out", str(run), "--address", address],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    name = f"resume-{TIER_A}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if (run / STUDY_DB).exists():
                try:
                    if complete(study(run, name)):
                        break
                except KeyError:  # the study is not created yet
                    pass
            assert driver.poll() is None, "the driver ended before it was killed:\n" + log.read_text()[-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("no trial completed in time")
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    before = {t.number: (t.params, t.values) for t in complete(study(run, name))}
    assert len(before) == 1  # killed at the first trial's end, the second under way
    run_tune(resume=str(run), stream=io.StringIO())
    after = complete(study(run, name))
    assert len(after) == 2
    assert {t.number: (t.params, t.values) for t in after if t.number in before} == before  # kept, not rerun
    all_trials = study(run, name).trials
    assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL) for t in all_trials)
    assert (run / "profiles" / f"{TIER_A}.yaml").is_file()


def test_staged_tiers_share_the_learning_curves_and_each_gets_its_own_speed_and_pick(ray_cluster, tmp_path):
    run = tmp_path / "run"
    path = space_file(
        tmp_path,
        "staged",
        trials=2,
        tiers=[TIER_A, TIER_B],
        params={
            "training.micro_batch_size": {"type": "categorical", "choices": [8, 16]},
            "model.L_cycles": {"type": "int", "low": 1, "high": 2},
        },
        horizon={"minutes": 0.1},
        budget={"warmup_s": 0.5, "measure_s": 1.5, "eval_puzzles": 16, "evaluations": 2},
    )
    out = io.StringIO()
    paths = run_tune(str(path), out=str(run), stream=out)
    assert set(paths) == {TIER_A, TIER_B}, out.getvalue()
    nodes = ray_cluster.node_ids
    speed, spans = {}, {}
    for tier in (TIER_A, TIER_B):
        trials = complete(study(run, f"staged-{tier}-speed"))
        assert len(trials) == 2 and {t.user_attrs["node_id"] for t in trials} == {nodes[tier]}
        speed[tier] = max(trials, key=lambda t: t.values[0])
        runs = sorted((t.user_attrs["started_at"], t.user_attrs["ended_at"]) for t in trials)
        for (_, end), (start, _) in itertools.pairwise(runs):
            assert start >= end, f"two trials at once on the {tier} node"
        # In flight from the searcher's ask to the trial's end. When its process starts is the machine's business: a
        # loaded 2-core machine has taken longer to start one cold than another node took to run both of its trials.
        spans[tier] = [(t.datetime_start.timestamp(), t.user_attrs["ended_at"]) for t in trials]
    a, b = spans[TIER_A], spans[TIER_B]
    assert any(sa < eb and sb < ea for sa, ea in a for sb, eb in b), "the two tiers' searches never ran at once"
    # The two learning trials ran at once, one on each machine, each with its own tier's fastest micro-batch.
    learning = complete(study(run, "staged-learning"))
    assert sorted(t.user_attrs["tier"] for t in learning) == sorted([TIER_A, TIER_B])
    for t in learning:
        tier = t.user_attrs["tier"]
        assert t.user_attrs["node_id"] == nodes[tier]
        assert (
            t.user_attrs["experiment"]["training"]["micro_batch_size"]
            == speed[tier].params["training.micro_batch_size"]
        )
        # ... and was timed on the other tier, on that tier's node, with that tier's speed knobs.
        other = TIER_B if tier == TIER_A else TIER_A
        rate = json.loads((run / "rates" / f"{other}-{t.number}.json").read_text())
        assert rate["node_id"] == nodes[other] and rate["status"] == "ok" and rate["quality"] == 0.0
        assert rate["experiment"]["training"]["micro_batch_size"] == speed[other].params["training.micro_batch_size"]
        assert rate["experiment"]["model"]["L_cycles"] == t.params["model.L_cycles"]
    for tier in (TIER_A, TIER_B):
        profile = cfg.load_profile(paths[tier])
        assert profile.training.micro_batch_size == speed[tier].params["training.micro_batch_size"]
        assert profile.training.time_budget_s == 6.0 and profile.measured.objective["horizon"] == {"minutes": 0.1}
        assert profile.measured.objective["trained_on"] in (TIER_A, TIER_B)
    table = out.getvalue()
    assert table.count("trained on") >= 2 and table.count("verified :") == 2


def test_the_pruner_stops_a_trial_that_is_behind_at_its_first_evaluation(ray_cluster, tmp_path):
    # Two trials that learn, then one that cannot (a learning rate of 1e-7): the median pruner, past its two
    # start-up trials, stops the third at the evaluation half-way through its window.
    lr = {"training.lr": {"type": "categorical", "choices": [3.0e-3, 1.0e-7]}}
    path = space_file(
        tmp_path,
        "pruned",
        params={**TINY["params"], **lr},
        start_with=[
            {"training.micro_batch_size": 16, "model.L_cycles": 1, "training.lr": 3.0e-3},
            {"training.micro_batch_size": 16, "model.L_cycles": 2, "training.lr": 3.0e-3},
            {"training.micro_batch_size": 16, "model.L_cycles": 1, "training.lr": 1.0e-7},
        ],
        pruner="median",
        startup_trials=2,
        budget={"warmup_s": 1, "measure_s": 4, "evaluations": 2, "eval_puzzles": 16},
    )
    out = io.StringIO()
    run_tune(str(path), out=str(tmp_path / "run"), stream=out)
    trials = sorted(study(tmp_path / "run", f"pruned-{TIER_A}").trials, key=lambda t: t.number)
    states = [t.state for t in trials]
    assert states == [optuna.trial.TrialState.COMPLETE] * 2 + [optuna.trial.TrialState.PRUNED], out.getvalue()
    assert list(trials[2].intermediate_values) == [1] and trials[2].params["training.lr"] == 1.0e-7
    assert f"[{TIER_A} #2] pruned at evaluation 1" in out.getvalue()
    # The two trials that ran to the end reported their half-way evaluation too, and one of them is the profile.
    assert all(list(t.intermediate_values) == [1] for t in trials[:2])
    assert cfg.load_profile(tmp_path / "run" / "profiles" / f"{TIER_A}.yaml").training.lr == 3.0e-3


def test_a_re_run_waits_only_while_its_tier_has_a_machine(ray_cluster):
    """A verification on a Mac that leaves the cluster under it ends with TierLeft instead of waiting for Ray to place
    the task again on a machine of the tier, which would never come; one that finishes or raises is a result."""
    import ray

    from raytrm.constants import RESOURCE_MACHINE, tier_resource
    from raytrm.distributed.cluster import alive_tiers
    from raytrm.tune.verify import TierLeft, _remote, result_on_tier

    # Python functions the workers can import (this module is not on their path).
    assert result_on_tier(_remote(statistics.median, TIER_A).remote([1, 3]), TIER_A, poll_s=0.2) == 2
    failed = result_on_tier(_remote(statistics.median, TIER_A).remote([]), TIER_A, poll_s=0.2)
    assert failed == {"status": "failed", "error": "StatisticsError: no median for empty data"}
    leaving = "mac-mini-16gb"
    node = ray_cluster.add_node(num_cpus=1, resources={RESOURCE_MACHINE: 1, tier_resource(leaving): 1})
    try:
        ray_cluster.wait_for_nodes()
        ref = _remote(subprocess.getoutput, leaving).remote("sleep 600")
        time.sleep(2.0)  # the task placed and running on the node
    finally:
        ray_cluster.remove_node(node)
    begin = time.monotonic()
    with pytest.raises(TierLeft, match=f"tier {leaving}: its last machine left the cluster"):
        result_on_tier(ref, leaving, poll_s=0.2)
    assert time.monotonic() - begin < 60 and leaving not in alive_tiers()
    with pytest.raises(ray.exceptions.TaskCancelledError):  # cancelled: it holds nothing in the cluster
        ray.get(ref, timeout=30)
