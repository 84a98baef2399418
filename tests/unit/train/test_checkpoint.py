"""Checkpoints: complete round trip, atomic writes, corrupt and foreign files refused with one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from raytrm.errors import UserError
from raytrm.train import checkpoint as ckpt


def state(step: int) -> dict:
    return {
        "model": {"w": torch.full((3,), float(step))},
        "step": step,
        "rng": torch.get_rng_state(),
        "config": {"lr": 1e-4},
        "carries": [{"z": torch.zeros(2, 2)}],
        "nested": [1, "two", 3.0],
    }


def test_round_trip_and_keep(tmp_path):
    for step in (10, 20, 30, 40):
        ckpt.save_checkpoint(state(step), tmp_path, step, keep=3)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step-00000020.ckpt",
        "step-00000030.ckpt",
        "step-00000040.ckpt",
    ]
    loaded = ckpt.latest_good_checkpoint(tmp_path)
    assert loaded["step"] == 40
    assert torch.equal(loaded["model"]["w"], torch.full((3,), 40.0))
    assert loaded["nested"] == [1, "two", 3.0]
    assert loaded["_header"]["raytrm_checkpoint"] == ckpt.CHECKPOINT_FORMAT


def test_corrupt_checkpoint_is_refused_and_resume_falls_back(tmp_path):
    ckpt.save_checkpoint(state(1), tmp_path, 1)
    newest = ckpt.save_checkpoint(state(2), tmp_path, 2)
    data = bytearray(newest.read_bytes())
    data[-5] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"step-00000002.ckpt: checkpoint is corrupt .*delete it"):
        ckpt.load_checkpoint(newest)
    assert ckpt.latest_good_checkpoint(tmp_path)["step"] == 1


def test_foreign_file_is_refused(tmp_path):
    path = tmp_path / "step-00000001.ckpt"
    torch.save({"w": torch.zeros(1)}, path)
    with pytest.raises(UserError, match="not a raytrm checkpoint"):
        ckpt.load_checkpoint(path)
    with pytest.raises(UserError, match="no checkpoint verifies"):
        ckpt.latest_good_checkpoint(tmp_path)


def test_newer_format_is_refused(tmp_path):
    path = ckpt.save_checkpoint(state(1), tmp_path, 1)
    head, _, payload = path.read_bytes().partition(b"\n")
    path.write_bytes(head.replace(b'"raytrm_checkpoint": 1', b'"raytrm_checkpoint": 9') + b"\n" + payload)
    with pytest.raises(UserError, match="checkpoint format 9, this raytrm reads format 1"):
        ckpt.load_checkpoint(path)


def test_kill_during_write_leaves_the_previous_checkpoint(tmp_path):
    ckpt.save_checkpoint(state(1), tmp_path, 1)
    # A child process starts a large checkpoint and is killed mid-write.
    script = textwrap.dedent(f"""
        import os, sys, torch
        from raytrm.train import checkpoint as ckpt
        real_fsync = os.fsync
        def stall(fd):
            sys.stdout.write("writing\\n"); sys.stdout.flush()
            import time; time.sleep(60)
        os.fsync = stall
        ckpt.save_checkpoint({{"w": torch.zeros(4_000_000), "step": 2}}, {str(tmp_path)!r}, 2)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert any(name.endswith(".tmp") for name in leftovers), leftovers
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000001.ckpt"]
    assert ckpt.latest_good_checkpoint(tmp_path)["step"] == 1
