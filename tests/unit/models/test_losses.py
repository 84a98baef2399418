"""Stablemax cross-entropy and the ACT loss: values, normalisation by the global batch, metrics."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from raytrm.models.losses import act_loss, log_stablemax, stablemax_cross_entropy


def test_stablemax_by_hand():
    # s(-1) = 1/2, s(0) = 1, s(2) = 3: probabilities 1/9, 2/9, 6/9.
    logits = torch.tensor([[-1.0, 0.0, 2.0]])
    torch.testing.assert_close(log_stablemax(logits.double()), torch.tensor([[1 / 9, 2 / 9, 6 / 9]]).double().log())
    loss = stablemax_cross_entropy(logits, torch.tensor([2]))
    assert loss.dtype == torch.float64
    assert math.isclose(loss.item(), -math.log(6 / 9), rel_tol=1e-12)
    assert stablemax_cross_entropy(logits, torch.tensor([-100])).item() == 0.0
    loss32 = stablemax_cross_entropy(logits, torch.tensor([0]), compute_dtype=torch.float32)
    assert loss32.dtype == torch.float32 and math.isclose(loss32.item(), math.log(9), rel_tol=1e-6)


def test_stablemax_gradient_is_finite_at_the_branch_points():
    logits = torch.tensor([[0.0, 1.0, -3.0, 2.0]], requires_grad=True)
    stablemax_cross_entropy(logits, torch.tensor([1])).sum().backward()
    assert torch.isfinite(logits.grad).all()


def _outputs(B=4, L=5, V=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[0, :2] = -100
    labels[1] = -100  # a sequence with nothing to score
    labels[2] = logits.detach()[2].argmax(-1)  # an exactly right sequence
    q = torch.randn(B, generator=g, requires_grad=True)
    carry = SimpleNamespace(
        labels=labels,
        halted=torch.tensor([True, True, True, False]),
        steps=torch.tensor([3, 1, 2, 5], dtype=torch.int32),
    )
    return {"logits": logits, "q_halt_logits": q}, carry


def test_act_loss_by_hand():
    out, carry = _outputs()
    loss, metrics = act_loss(out, carry, global_batch_size=10)
    logits, labels, q = out["logits"].detach(), carry.labels, out["q_halt_logits"].detach()
    lm = 0.0
    right = []
    for b in range(4):
        valid = labels[b] != -100
        tokens = [stablemax_cross_entropy(logits[b, t], labels[b, t]).item() for t in range(5) if valid[t]]
        lm += sum(tokens) / max(1, len(tokens))
        right.append(bool((logits[b].argmax(-1)[valid] == labels[b][valid]).all()))
    bce = F.binary_cross_entropy_with_logits(q, torch.tensor(right, dtype=torch.float32), reduction="sum").item()
    assert math.isclose(loss.item(), (lm + 0.5 * bce) / 10, rel_tol=1e-6)
    assert right[1] and right[2]
    # Metrics: halted sequences that have labels (0 and 2).
    assert metrics["count"].item() == 2
    assert metrics["exact_accuracy"].item() == int(right[0]) + 1
    assert metrics["steps"].item() == 3 + 2
    assert math.isclose(metrics["lm_loss"].item(), lm, rel_tol=1e-6)
    assert all(v.dtype == torch.float32 and not v.requires_grad for v in metrics.values())


def test_halves_add_up_to_the_global_loss_and_gradient():
    out, carry = _outputs(B=4)
    full, _ = act_loss(out, carry, global_batch_size=4)
    full.backward()
    grads = out["logits"].grad.clone(), out["q_halt_logits"].grad.clone()
    out["logits"].grad = out["q_halt_logits"].grad = None
    total = 0.0
    for part in (slice(0, 2), slice(2, 4)):
        half_out = {k: v[part] for k, v in out.items()}
        half_carry = SimpleNamespace(**{k: v[part] for k, v in vars(carry).items()})
        loss, _ = act_loss(half_out, half_carry, global_batch_size=4)
        loss.backward()
        total += loss.item()
    assert math.isclose(total, full.item(), rel_tol=1e-12)
    torch.testing.assert_close(out["logits"].grad, grads[0])
    torch.testing.assert_close(out["q_halt_logits"].grad, grads[1])
