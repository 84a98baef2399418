"""Checkpoints: complete round trip, atomic writes, corrupt and foreign files refused with one line; the step a
checkpoint claims, and whether it fits the run (its experiment, every tensor's shape), checked before any restore."""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from raytrm.errors import UserError
from raytrm.train import checkpoint as ckpt
from raytrm.train.trainer import Trainer


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


# -- the step a checkpoint claims ---------------------------------------------------------------------------------


def trained_state(step: int = 3, batch: int = 4) -> dict:
    """What the Trainer saves, as far as the step checks read it."""
    return {"step": step, "samples_seen": step * batch, "config": {"training": {"global_batch_size": batch}}}


def rewrite_header(path, **fields) -> None:
    head, _, payload = path.read_bytes().partition(b"\n")
    path.write_bytes(json.dumps({**json.loads(head), **fields}).encode() + b"\n" + payload)


@pytest.mark.parametrize(
    "edit, piece",
    [
        ("negative header", "its header claims step -1, expected a step count >= 0"),
        ("header not a count", "its header claims step 'three', expected a step count >= 0"),
        ("header and contents", "its header says step 3, its contents step 5"),
        ("negative contents", "its header says step 3, its contents step -3"),
        ("name", "its name says step 7, its header step 3; rename it step-00000003.ckpt if that is its step"),
        ("samples", "it claims 13 samples seen at step 3, expected 12 (step x the global batch 4)"),
    ],
)
def test_a_checkpoint_claiming_an_impossible_step_is_refused(tmp_path, edit, piece):
    state = trained_state()
    if edit == "header and contents":
        state["step"] = 5
    if edit == "negative contents":
        state["step"] = -3
    if edit == "samples":
        state["samples_seen"] = 13
    path = ckpt.save_checkpoint(state, tmp_path, 3)
    if edit == "negative header":
        rewrite_header(path, step=-1)
    if edit == "header not a count":
        rewrite_header(path, step="three")
    if edit == "name":
        path = path.rename(path.with_name("step-00000007.ckpt"))
    with pytest.raises(UserError) as refused:
        ckpt.load_checkpoint(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: {piece}") and "\n" not in message
    assert message.endswith(f"move it out of {tmp_path} to resume from an earlier checkpoint")


def test_a_consistent_step_loads(tmp_path):
    assert ckpt.load_checkpoint(ckpt.save_checkpoint(trained_state(0), tmp_path, 0))["step"] == 0  # an import's
    assert ckpt.load_checkpoint(ckpt.save_checkpoint(trained_state(9), tmp_path, 9))["samples_seen"] == 36


def test_a_skipped_checkpoint_is_warned_of_only_where_an_earlier_one_is_taken(tmp_path, caplog):
    first = ckpt.save_checkpoint(trained_state(1), tmp_path, 1)
    newest = ckpt.save_checkpoint(trained_state(2), tmp_path, 2)
    rewrite_header(newest, step=-2)
    with caplog.at_level(logging.WARNING, logger="raytrm.train.checkpoint"):
        assert ckpt.latest_good_checkpoint(tmp_path)["step"] == 1
    assert f"skipping checkpoint {newest}: its header claims step -2" in caplog.text
    caplog.clear()
    first.unlink()
    refused = pytest.raises(UserError, match=r"no checkpoint verifies \(1 tried; newest: .*its header claims step -2")
    with caplog.at_level(logging.WARNING, logger="raytrm.train.checkpoint"), refused:
        ckpt.latest_good_checkpoint(tmp_path)
    assert caplog.text == ""  # the refusal is the one line


# -- whether a checkpoint fits the run ----------------------------------------------------------------------------


@pytest.fixture
def saved(tiny, tmp_path):
    """A trainer of the tiny config after two steps, and the checkpoint of its state as a resume reads it."""
    trainer = Trainer(tiny(), tmp_path)
    for _ in range(2):
        trainer.train_step()
    path = ckpt.save_checkpoint(trainer.state_dict(), tmp_path / "checkpoints", trainer.step)
    yield trainer, ckpt.load_checkpoint(path)
    trainer.close()


def test_a_checkpoint_of_another_experiment_names_each_field_and_keeps_the_checkpoint(tiny, tmp_path, saved):
    _, state = saved
    other = Trainer(tiny(model={"hidden_size": 64}, training={"lr": 1e-3}), tmp_path)
    with pytest.raises(UserError) as refused:
        other.load_state_dict(state)
    assert str(refused.value) == (
        f"{state['_header']['path']}: written for another experiment than {tmp_path / 'config.yaml'}: "
        f"model.hidden_size is 32 in the checkpoint, 64 in {tmp_path / 'config.yaml'}; training.lr is 0.003 in the "
        f"checkpoint, 0.001 in {tmp_path / 'config.yaml'}; the checkpoint is fine: set those fields in "
        f"{tmp_path / 'config.yaml'} back to the checkpoint's value to resume it, or start a new run with another --out"
    )
    longer = Trainer(tiny(training={"steps": 50, "threads": 2, "micro_batch_size": 8, "grad_accum_steps": 4}), tmp_path)
    longer.load_state_dict(state)  # how long it goes on, and the machine's settings, are the run's to change
    assert longer.step == 2


def _first(mapping: dict) -> str:
    return next(k for k, v in mapping.items() if torch.is_tensor(v) and v.dim() == 2)


def _rounds(trainer: Trainer, state: dict) -> dict:
    """The state a local round saves, as rank 0 of two workers would."""

    def params():
        return [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]

    def worker():
        table = trainer.model.puzzle_emb.weight
        rows = [{"ids": torch.tensor([0]), "base": table[[0]].clone(), "now": table[[0]].clone() + 1}]
        return {"params": params(), "sent": None, "optimizer": state["optimizer"], "samples": 16, "rows": rows}

    rounds = {"every": 4, "overlap": 0, "globals": params(), "momentum": params(), "steps": 1, "owed": 1}
    rounds |= {"pending": None, "left": 0, "ema": state["ema"], "workers": [worker(), worker()]}
    size = sum(p.numel() for p in params())
    return {"mode": "local", "rounds": rounds, "residuals": [torch.zeros(size), None]}


SHAPE_EDITS = {
    "model": (lambda s: s["model"], "model.{key} holds a tensor of shape (3, 3), this config builds a tensor of shape"),
    "ema": (lambda s: s["ema"]["shadow"], "ema.shadow.{key} holds a tensor of shape (3, 3)"),
    "carry": (lambda s: s["carry"], "carry.{key} holds a tensor of shape (3, 3), this config builds a tensor of shape"),
    "moment": (lambda s: s["optimizer"]["state"][0], "optimizer state[0].{key} holds a tensor of shape (3, 3)"),
    "rounds": (lambda s: s["sync"]["rounds"]["workers"][1]["params"], "sync.rounds.workers[1].params[{key}] holds"),
    "rows": (lambda s: s["sync"]["rounds"]["workers"][0]["rows"][0], "sync.rounds.workers[0].rows[0].{key} holds"),
    "residual": (lambda s: s["sync"]["residuals"], "sync.residuals[{key}] holds a tensor of shape (3, 3)"),
    "rng": (lambda s: s["rng"], "rng.{key} holds a tensor of shape (3, 3), this config builds a tensor of shape"),
}


@pytest.mark.parametrize("part", sorted(SHAPE_EDITS))
def test_every_tensor_is_checked_against_the_shapes_of_the_config(tiny, tmp_path, saved, part):
    trainer, state = saved
    state["sync"] = _rounds(trainer, state)
    Trainer(tiny(), tmp_path).load_state_dict(copy.deepcopy(state))  # as saved: it fits
    where, piece = SHAPE_EDITS[part]
    container = where(state)
    key = {"rows": "base", "rng": "torch"}.get(part) or (0 if isinstance(container, list) else _first(container))
    container[key] = torch.zeros(3, 3)
    fresh = Trainer(tiny(), tmp_path)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(UserError) as refused:
        fresh.load_state_dict(state)
    message = str(refused.value)
    assert message.startswith(f"{state['_header']['path']}: {piece.format(key=key)}"), message
    assert message.endswith(
        f"its config matches {tmp_path / 'config.yaml'}, so the file itself is broken or was not written by raytrm "
        f"train: move it out of {tmp_path / 'checkpoints'} to resume from the checkpoint before it, or start a new "
        "run with another --out"
    )
    assert all(torch.equal(v, before[k]) for k, v in fresh.model.state_dict().items())  # nothing was restored


def test_shares_of_another_global_batch_are_refused(tiny, tmp_path, saved):
    _, state = saved
    state["shares"] = [10, 10]
    with pytest.raises(UserError, match=r"shares holds \[10, 10\], this config builds shares of the global batch 32"):
        Trainer(tiny(), tmp_path).load_state_dict(state)
