"""Faults without Ray: a training process killed at any moment, a full disk, a tuning trial out of memory.

- Killed by SIGKILL anywhere (mid-step, mid-write of a checkpoint, between steps), then resumed: the run ends where an
  uninterrupted one ends, bit for bit, metrics included (docs/architecture.md, invariant 6).
- A checkpoint write that meets a full disk keeps the previous checkpoint and says so in one line (invariant 7).
- A trial that runs out of memory is recorded infeasible, with what it measured before (invariant 4).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap

import optuna
import pytest
import torch

from raytrm import config as cfg
from raytrm.cli import main
from raytrm.errors import UserError
from raytrm.models.trm import TRM
from raytrm.train import checkpoint as ckpt
from raytrm.train.run.training import run_training
from raytrm.tune import objectives
from raytrm.tune.search import record
from raytrm.tune.space import build_experiment, load_space
from raytrm.tune.trial import measure
from tests.support.resume import without_timings

STEPS, INTERVAL = 8, 2

# The child trains the config and prints "checkpoint STEP" once each checkpoint is in place. With a stall, it stops
# inside the payload write of checkpoint number nth, from 0 ("torn": half the bytes written; "unsynced": all written,
# not yet flushed to disk or renamed into place) and prints "writing", so the parent kills it exactly there.
CHILD = textwrap.dedent("""
    import os, stat, sys, tempfile, time
    from raytrm import config as cfg
    from raytrm.train import checkpoint
    from raytrm.train.run.training import run_training

    config_file, run_dir, stall, nth = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    writes = []

    class Stalling:
        def __init__(self, f):
            self.f = f
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self.f.__exit__(*exc)
        def __getattr__(self, name):
            return getattr(self.f, name)
        def write(self, data):
            if len(data) > 4096 and stall == "torn" and len(writes) == nth + 1:
                self.f.write(data[: len(data) // 2])
                self.f.flush()
                print("writing", flush=True)
                time.sleep(600)
            return self.f.write(data)

    real_mkstemp, real_fdopen, real_fsync = tempfile.mkstemp, os.fdopen, os.fsync

    def mkstemp(*args, **kwargs):  # the temporary files of checkpoints, not those of config.yaml and others
        fd, path = real_mkstemp(*args, **kwargs)
        if kwargs.get("prefix", "").startswith(".step-"):
            writes.append(fd)
        return fd, path

    def fdopen(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        return Stalling(f) if writes and fd == writes[-1] else f

    def fsync(fd):
        if stall == "unsynced" and len(writes) == nth + 1 and fd == writes[-1] and stat.S_ISREG(os.fstat(fd).st_mode):
            print("writing", flush=True)
            time.sleep(600)
        real_fsync(fd)

    checkpoint.tempfile.mkstemp, checkpoint.os.fdopen, checkpoint.os.fsync = mkstemp, fdopen, fsync
    announce = lambda step, path: print(f"checkpoint {step}", flush=True)
    run_training(cfg.load(cfg.ExperimentConfig, config_file), run_dir, on_checkpoint=announce)
""")


def _final_state(run_dir) -> dict:
    state = ckpt.latest_good_checkpoint(run_dir / "checkpoints")
    assert state is not None and state["step"] == STEPS
    return state


def _assert_same(a, b, where: str = "state") -> None:
    """Equal to the bit: tensors, numbers and containers of them."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _kill(config_file, run_dir, stall: str, nth: int, delay: float, log) -> str:
    """Start the child, kill it at the chosen moment; returns what it last said."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(config_file), str(run_dir), stall, str(nth)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    wanted = "writing" if stall != "none" else f"checkpoint {nth * INTERVAL}"
    said = ""
    for line in child.stdout:
        said = line.strip()
        if said == wanted:
            break
    if said == wanted and stall == "none":
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=delay)  # a random moment after that checkpoint: mid-step, mid-write, or done
    child.send_signal(signal.SIGKILL)
    child.wait()
    return said


# (stall, nth checkpoint from 0, seed): killed inside a checkpoint's write, or at a random moment after one.
MOMENTS = [
    pytest.param("unsynced", 1, 0, id="unsynced-write-of-the-second-checkpoint"),
    pytest.param("torn", 0, 0, id="torn-write-of-the-first-checkpoint", marks=pytest.mark.slow),
    pytest.param("torn", 2, 0, id="torn-write-of-the-third-checkpoint", marks=pytest.mark.slow),
    *[pytest.param("none", None, seed, id=f"random-moment-{seed}", marks=pytest.mark.slow) for seed in range(2)],
]


@pytest.mark.parametrize("stall, nth, seed", MOMENTS)
def test_killed_at_any_moment_then_resumed_equals_an_uninterrupted_run(tiny, tmp_path, stall, nth, seed):
    config = tiny(training={"steps": STEPS, "checkpoint_interval": INTERVAL})
    run_training(config, tmp_path / "straight")
    config_file = cfg.write_yaml(config, tmp_path / "config.yaml")
    run_dir = tmp_path / "killed"
    rng = random.Random(seed)
    if nth is None:
        nth = rng.randrange(1, STEPS // INTERVAL)
    with open(tmp_path / "child.log", "w") as log:
        said = _kill(config_file, run_dir, stall, nth, rng.uniform(0.0, 1.5), log)
    assert said, (tmp_path / "child.log").read_text()[-3000:]
    kept = [p.name for p in ckpt.list_checkpoints(run_dir / "checkpoints")]
    if stall != "none":  # a write cut short leaves its temporary file, never a checkpoint that looks complete
        assert kept == [ckpt.checkpoint_path("", s).name for s in range(INTERVAL, (nth + 1) * INTERVAL, INTERVAL)]
    if kept:
        resumed = run_training(config, run_dir, resume=True)
        assert resumed["resumed_from_step"] == int(kept[-1][5:13])
    else:
        with pytest.raises(UserError, match="nothing to resume"):
            run_training(config, run_dir, resume=True)
        resumed = run_training(config, run_dir)
    straight, again = _final_state(tmp_path / "straight"), _final_state(run_dir)
    for key in ("model", "optimizer", "sparse_optimizer", "ema", "carry", "rng", "step", "samples_seen", "config"):
        _assert_same(straight[key], again[key], key)
    assert without_timings(tmp_path / "straight") == without_timings(run_dir)


class _DiskFull:
    """A checkpoint file whose write (or flush to disk) fails with ENOSPC after `after` bytes."""

    def __init__(self, f, where: str, after: int = 1000) -> None:
        self.f, self.where, self.left = f, where, after

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def write(self, data):
        if self.where == "write" and len(data) > self.left:
            self.f.write(data[: self.left])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left -= len(data)
        return self.f.write(data)


def _fill_disk(monkeypatch, where: str, from_write: int) -> None:
    """The `from_write`-th checkpoint write from now (1-based) and later ones meet a full disk (write or fsync)."""
    real_mkstemp, real_fdopen, real_fsync = tempfile.mkstemp, os.fdopen, os.fsync
    seen = {"writes": 0, "fd": None}

    def mkstemp(*args, **kwargs):  # the temporary files of checkpoints, not those of config.yaml and others
        fd, path = real_mkstemp(*args, **kwargs)
        if kwargs.get("prefix", "").startswith(".step-"):
            seen["writes"] += 1
            seen["fd"] = fd if seen["writes"] >= from_write else None
        return fd, path

    def fdopen(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        return _DiskFull(f, where) if fd == seen["fd"] else f

    def fsync(fd):
        if where == "fsync" and fd == seen["fd"] and stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(ckpt.tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(ckpt.os, "fdopen", fdopen)
    monkeypatch.setattr(ckpt.os, "fsync", fsync)


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch, where):
    ckpt.save_checkpoint({"w": torch.zeros(1000), "step": 1}, tmp_path, 1)
    _fill_disk(monkeypatch, where, from_write=1)
    with pytest.raises(UserError) as refused:
        ckpt.save_checkpoint({"w": torch.ones(1000), "step": 2}, tmp_path, 2)
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert "No space left on device" in message and "step-00000001.ckpt is kept" in message
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001.ckpt"]  # no torn temporary file either
    assert ckpt.latest_good_checkpoint(tmp_path)["step"] == 1


def test_a_full_disk_stops_training_with_one_line_and_the_run_resumes(tiny, tmp_path, monkeypatch, capsys):
    config = cfg.write_yaml(tiny(training={"checkpoint_interval": 2}), tmp_path / "tiny.yaml")
    run = tmp_path / "run"
    _fill_disk(monkeypatch, "write", from_write=2)
    assert main(["train", "--config", str(config), "--steps", "4", "--out", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "step-00000002.ckpt is kept" in err[0], err
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000002.ckpt"]
    monkeypatch.undo()  # space freed
    assert main(["train", "--out", str(run), "--resume", "--steps", "4", "--quiet"]) == 0
    assert ckpt.latest_good_checkpoint(run / "checkpoints")["step"] == 4


def _out_of_memory_at(monkeypatch, call: int, kind: str) -> None:
    """The TRM's `call`-th forward fails to allocate: for real on the CPU allocator, or as CUDA and MPS raise."""
    real, calls = TRM.forward, {"n": 0}

    def forward(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] >= call:
            if kind == "cpu":
                torch.empty(2**50, dtype=torch.uint8)  # the host allocator refuses: a real out-of-memory error
            raise torch.OutOfMemoryError("MPS backend out of memory (MPS allocated: 7.90 GB, other allocations: 1 GB)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TRM, "forward", forward)


def _out_of_memory_trial(monkeypatch, kind: str) -> dict:
    space = load_space("quick")
    experiment = cfg.to_dict(build_experiment(space.base, {"training.micro_batch_size": 32, "model.H_cycles": 1}))
    experiment["training"]["threads"] = 1
    _out_of_memory_at(monkeypatch, call=6, kind=kind)  # one forward a step: five steps, then out of memory
    return measure(
        experiment,
        warmup_s=0.0,
        measure_s=30.0,
        memory_budget_mb=None,
        thermal_cap=None,
        max_throughput_decay=1.0,
        eval_puzzles=16,
    )


@pytest.mark.parametrize("kind", ["cpu", "device"])
def test_an_out_of_memory_trial_is_recorded_infeasible(monkeypatch, kind):
    result = _out_of_memory_trial(monkeypatch, kind)
    assert result["status"] == "failed" and "memory" in result["error"].lower(), result.get("error")
    study = optuna.create_study(direction="maximize")
    constraints = record(study, study.ask(), result, "quality")
    frozen = study.trials[0]
    assert frozen.state == optuna.trial.TrialState.COMPLETE and constraints["failed"] == 1
    assert not objectives.is_feasible(frozen.constraints) and objectives.best_trials(study, "quality") == []
    assert frozen.user_attrs["status"] == "failed" and "memory" in frozen.user_attrs["error"].lower()


def test_an_out_of_memory_trial_keeps_what_it_measured(monkeypatch):
    # Five steps ran before the sixth ran out of memory: their throughput and peak are the trial's measurements.
    result = _out_of_memory_trial(monkeypatch, "cpu")
    assert result["steps"] == 5 and result["samples_per_sec"] > 0 and result["peak_memory_mb"] > 0, result
