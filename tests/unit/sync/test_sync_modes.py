"""The sync modes across gloo worker processes (no Ray): local rounds of one plain-SGD step with plain averaging are
exact sync, resume is exact in every mode (mid-round and with the exchange in flight too), and a worker lost
mid-round costs that round's deltas only: the run goes on from the last synchronized parameters."""

from __future__ import annotations

import pytest
import torch

from raytrm.constants import GLOO_IFNAME_ENV
from raytrm.distributed.launch import spawn
from raytrm.sync.process_group import ProcessGroupSync
from raytrm.train import checkpoint as ckpt
from raytrm.train.loop import Loop
from raytrm.train.run.stop_rules import StepLimit
from raytrm.train.run.training import run_training
from raytrm.train.trainer import Trainer

pytestmark = pytest.mark.slow  # worker processes

SHARES = [10, 22]


def sgd_worker(rank, world_size, device, config, steps):
    """Train with plain SGD as the (inner) optimizer; rank 0 returns its weights and EMA."""
    trainer = Trainer(config, sync=ProcessGroupSync(device), shares=SHARES)
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=config.training.lr)
    Loop(trainer, [StepLimit(steps)], measure_peak=False).run()
    out = {
        "model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "ema": {k: v.clone() for k, v in trainer.ema.shadow.items()},
    }
    trainer.close()
    return out if rank == 0 else None


def test_local_rounds_of_one_sgd_step_with_plain_averaging_are_exact_sync(tiny):
    # Worker i steps on its own samples' mean gradient; the deltas weighted by samples (10/32 and 22/32) sum to the
    # global batch's step. No puzzle embedding: SignSGD's sign of a sum is not a mean of signs.
    model = {"puzzle_emb_len": 0}
    base = {"lr": 0.5, "warmup_steps": 0, "weight_decay": 0.0}
    exact = spawn(sgd_worker, 2, tiny(model=model, training={**base, "sync_mode": "exact"}), 5)[0]
    local = {**base, "sync_mode": "local", "sync_every": 1, "sync_overlap": 0, "outer_lr": 1.0, "outer_momentum": 0.0}
    rounds = spawn(sgd_worker, 2, tiny(model=model, training=local), 5)[0]
    for part in ("model", "ema"):
        for key, value in exact[part].items():
            torch.testing.assert_close(rounds[part][key], value, rtol=1e-5, atol=1e-6, msg=f"{part} {key}")
    # Not trivially equal: the weights moved.
    first = spawn(sgd_worker, 2, tiny(model=model, training={**base, "sync_mode": "exact"}), 1)[0]
    assert any(not torch.allclose(first["model"][k], exact["model"][k]) for k in exact["model"])


def crossing_worker(rank, world_size, device):
    """A round's sum in flight, then a small exchange on rank 0; the small exchange first on rank 1. Legal only where
    the two travel apart: within one group, collectives leave in the order issued and these would not match."""
    sync = ProcessGroupSync(device)
    deltas = [torch.full((1000,), float(rank + 1)), torch.full((3,), 10.0 * (rank + 1))]
    sync.sum_tensors(deltas).wait()  # every rank at the same point, as a round's first sum is
    if rank == 0:
        pending = sync.sum_tensors(deltas)
        rows = sync.gather_floats([0.5])
    else:
        rows = sync.gather_floats([1.5])
        pending = sync.sum_tensors(deltas)
    pending.wait()
    return rows, deltas, sync.interface


def test_a_rounds_sum_in_flight_does_not_hold_up_the_small_exchanges(monkeypatch):
    # On a slow link the rows and stop votes a round's boundary exchanges would otherwise wait out the whole sum.
    monkeypatch.setenv(GLOO_IFNAME_ENV, "lo")  # gloo bound to an interface, as a cluster's run binds the fastest path
    (rows, deltas, interface), (rows_1, _, interface_1) = spawn(crossing_worker, 2, timeout_s=120)
    assert rows == rows_1 == [[0.5], [1.5]]
    assert interface == interface_1 == "lo"  # the sync knows the interface its sums go through (the report names it)
    assert torch.equal(deltas[0], torch.full((1000,), 6.0)) and torch.equal(deltas[1], torch.full((3,), 60.0))


def run_worker(rank, world_size, device, config, run_dir, resume=False, fail_at=None):
    """One worker of run_training; with fail_at, rank 1 dies after that step (its peers then fail too)."""
    if fail_at is not None and rank == 1:
        from raytrm.train.trainer import Trainer as T

        real = T.optimizer_step

        def optimizer_step(self):
            real(self)
            if self.step == fail_at:
                raise RuntimeError(f"worker 1 lost after step {fail_at} (injected by the test)")

        T.optimizer_step = optimizer_step
    shares = SHARES if world_size == 2 else None
    summary = run_training(config, run_dir, resume=resume, sync=ProcessGroupSync(device), shares=shares, balance=False)
    return summary if rank == 0 else None


def latest(run_dir):
    return ckpt.latest_good_checkpoint(run_dir / "checkpoints")


def assert_same_bits(a, b):
    assert a["step"] == b["step"]
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, rtol=0, atol=0, msg=key)
    for key, value in a["ema"]["shadow"].items():
        torch.testing.assert_close(b["ema"]["shadow"][key], value, rtol=0, atol=0, msg=key)
    for key, value in a["carry"].items():
        assert torch.equal(b["carry"][key], value), key


@pytest.mark.parametrize(
    ("mode", "half"),
    [
        ({"sync_mode": "compressed"}, 3),
        ({"sync_mode": "local", "sync_every": 3, "sync_overlap": 0}, 4),  # stopped mid-round
        ({"sync_mode": "local", "sync_every": 3, "sync_overlap": 1}, 3),  # stopped with the exchange in flight
        ({"sync_mode": "local", "sync_every": 2, "sync_overlap": 1, "outer_lr": 0.7, "outer_momentum": 0.9}, 3),
    ],
)
def test_resume_is_exact_in_every_mode(tiny, tmp_path, mode, half):
    spawn(run_worker, 2, tiny(training={**mode, "steps": 2 * half}), tmp_path / "straight")
    spawn(run_worker, 2, tiny(training={**mode, "steps": half}), tmp_path / "split")
    resumed = spawn(run_worker, 2, tiny(training={**mode, "steps": 2 * half}), tmp_path / "split", True)[0]
    assert resumed["resumed_from_step"] == half and resumed["sync_mode"] == mode["sync_mode"]
    assert_same_bits(latest(tmp_path / "straight"), latest(tmp_path / "split"))


def test_a_worker_lost_mid_round_drops_the_round_and_the_run_goes_on(tiny, tmp_path):
    local = {"sync_mode": "local", "sync_every": 4, "sync_overlap": 0, "checkpoint_interval": 2}
    # Rank 1's own error, or rank 0's gloo error (the peer closed or reset the connection): whichever reaches the
    # launcher first.
    with pytest.raises(RuntimeError, match=r"worker 1 lost|[Cc]onnection (closed|reset) by peer"):
        spawn(run_worker, 2, tiny(training={**local, "steps": 8}), tmp_path / "run", False, 3)
    saved = latest(tmp_path / "run")
    assert saved["step"] == 2 and saved["sync"]["rounds"]["steps"] == 2  # two inner steps into the first round
    synchronized = saved["sync"]["rounds"]["globals"]
    # The worker left resumes alone: the round's deltas are dropped, it starts from the synchronized weights.
    spawn(run_worker, 1, tiny(training={**local, "steps": 2}), tmp_path / "run", True)
    restarted = latest(tmp_path / "run")
    names = [n for n, p in Trainer(tiny()).model.named_parameters() if p.requires_grad]
    for name, value in zip(names, synchronized, strict=True):
        torch.testing.assert_close(restarted["model"][name], value, rtol=0, atol=0, msg=name)
    # And the run goes on to its end.
    summary = spawn(run_worker, 1, tiny(training={**local, "steps": 8}), tmp_path / "run", True)[0]
    assert summary["steps"] == 8 and summary["samples_seen"] == 8 * 32
