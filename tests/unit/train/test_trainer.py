"""The Trainer's invariants: accumulation changes how a batch is cut, never the update; resume is exact."""

from __future__ import annotations

import pytest
import torch

from raytrm.train.run.training import run_training
from raytrm.train.trainer import Trainer
from tests.support.resume import assert_same_run


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_close_dicts(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


def grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {k: p.grad.clone() for k, p in trainer.model.named_parameters()}
    ids, rows = trainer.model.puzzle_emb.sparse_grad()
    out["puzzle_emb"] = torch.zeros_like(trainer.model.puzzle_emb.weight).index_add_(0, ids, rows)
    return out


def assert_same_gradients(a: Trainer, b: Trainer) -> None:
    """Accumulated gradients equal to fp32 rounding, relative to each tensor's largest entry."""
    ga, gb = grads(a), grads(b)
    for key in ga:
        scale = float(ga[key].abs().max())
        torch.testing.assert_close(ga[key], gb[key], rtol=1e-4, atol=1e-5 * scale, msg=lambda m, k=key: f"{k}: {m}")


def test_accumulation_gives_the_same_update_carry_included(tiny):
    lr = 3e-3
    whole = Trainer(tiny(training={"global_batch_size": 32, "grad_accum_steps": 1, "lr": lr}))
    parts = Trainer(tiny(training={"global_batch_size": 32, "grad_accum_steps": 4, "lr": lr}))
    assert (whole.micro_batch, parts.micro_batch) == (32, 8)
    for _ in range(4):  # several steps, so halted slots are refilled from later batches
        loss_a, metrics_a = whole.forward_backward()
        loss_b, metrics_b = parts.forward_backward()
        assert abs(loss_a - loss_b) < 1e-5 * max(1.0, abs(loss_a))
        assert metrics_a.keys() == metrics_b.keys()
        for key, value in metrics_a.items():  # None where no sequence halted this step, in both
            assert value == (None if metrics_b[key] is None else pytest.approx(metrics_b[key], rel=1e-5)), key
        # The gradient itself, before Adam: Adam and SignSGD are blind to a loss scale, the gradient is not.
        assert_same_gradients(whole, parts)
        whole.optimizer_step()
        parts.optimizer_step()
    # Adam moves a weight by at most about lr a step; where v is ~0 it amplifies rounding, so compare on that scale.
    assert_close_dicts(params(whole), params(parts), rtol=0, atol=1e-2 * lr)
    joined = parts.carry.to_dict()
    for key, value in whole.carry.to_dict().items():
        if value.is_floating_point():  # states of O(1) after weights that differ by rounding
            torch.testing.assert_close(value, joined[key], rtol=0, atol=1e-4)
        else:  # which example each slot holds, its step count and halting: exactly the same
            assert torch.equal(value, joined[key]), key
    assert_close_dicts(whole.ema.state_dict()["shadow"], parts.ema.state_dict()["shadow"], rtol=0, atol=1e-2 * lr)


def test_a_step_that_gathers_the_next_batch_early_trains_on_the_same_batches(tiny):
    """train_step gathers batch k + 1 while the device runs step k: the stream, the losses and the weights are those
    of the plain forward_backward and optimizer_step, and a batch given by the caller leaves the stream alone."""
    early, plain = Trainer(tiny()), Trainer(tiny())
    given = early.batches.next(early.step)
    plain.batches.next(plain.step)
    for step in range(4):
        if step == 2:  # the caller's batch: the stream's batch 2 stays the next one, early or not
            result = early.train_step(batch=given)
            loss, metrics = plain.forward_backward(batch=given)
        else:
            result = early.train_step()
            loss, metrics = plain.forward_backward()
        plain.optimizer_step()
        assert result.loss == loss and result.metrics == metrics, step
    assert_close_dicts(params(early), params(plain), rtol=0, atol=0)
    assert torch.equal(early.batches.next(early.step)["inputs"], plain.batches.next(plain.step)["inputs"])


def test_resume_is_exact(tiny, tmp_path):
    straight = run_training(tiny(training={"steps": 6}), tmp_path / "straight")
    run_training(tiny(training={"steps": 3}), tmp_path / "split")
    resumed = run_training(tiny(training={"steps": 6}), tmp_path / "split", resume=True)
    assert resumed["resumed_from_step"] == 3
    a, b = assert_same_run(tmp_path / "straight", tmp_path / "split")
    assert a["step"] == b["step"] == 6 and a["ema"] is not None and a["carry"] is not None
    assert straight["eval_cell_acc"] == resumed["eval_cell_acc"]


def test_exploration_drawn_ahead_is_the_steps_own_and_a_checkpoint_saves_the_state_before_it(tiny):
    # The Trainer has TRM's task draw a step's halting exploration while the step before it runs (prepare_step).
    at_start, ahead = Trainer(tiny()), Trainer(tiny())
    try:
        batch, n = at_start.batches.next(at_start.step), at_start.global_batch
        part = slice(0, n)

        def begin(trainer: Trainer) -> torch.Tensor:
            return trainer.task.begin_step(batch, n, part).min_halt_steps

        expected = [begin(at_start) for _ in range(3)]
        assert not torch.equal(expected[0], expected[1])  # the draws differ from step to step
        got = [begin(ahead)]
        ahead.task.prepare_step(n)
        saved = ahead.task.rng_state()  # a checkpoint between the steps
        got.append(begin(ahead))
        ahead.task.prepare_step(n // 2)  # drawn for another global batch: drawn again, from the same state
        got.append(begin(ahead))
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
        ahead.task.load_rng_state(saved)  # resumed from that checkpoint: the second step's draws again
        assert torch.equal(begin(ahead), expected[1])
    finally:
        at_start.close()
        ahead.close()


def test_recutting_mid_run_changes_nothing_but_the_cut(tiny):
    lr = 3e-3
    fixed = Trainer(tiny(training={"global_batch_size": 32, "lr": lr}))
    moving = Trainer(tiny(training={"global_batch_size": 32, "grad_accum_steps": 4, "lr": lr}))
    for micro in [8, 8, 12, 32, 5]:
        assert sum(moving.set_micro_batch(micro)) == 32
        fixed.forward_backward()
        moving.forward_backward()
        assert_same_gradients(fixed, moving)
        fixed.optimizer_step()
        moving.optimizer_step()
    assert moving.cuts == [5, 5, 5, 5, 4, 4, 4]
    for key, value in fixed.carry.to_dict().items():
        if not value.is_floating_point():
            assert torch.equal(value, moving.carry.to_dict()[key]), key
