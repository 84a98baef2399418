"""Losses: stablemax cross-entropy and the ACT loss of TRM (the reference's ACTLossHead).

Losses are normalised by the GLOBAL batch size, not the micro-batch: each sequence contributes its own share, so
the losses of micro-batches (or of workers) add up to the loss of the whole batch and their gradients sum to its
gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
import torch.nn.functional as F

from raytrm.models.ops import cast

IGNORE_LABEL_ID = -100


def log_stablemax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log(s(x) / sum s(x)) with s(x) = 1/(1-x) for x < 0, x + 1 otherwise: a softmax without exponentials."""
    # Clamping the branch that is not taken keeps its gradient finite (0 * inf would be NaN through where).
    s = torch.where(x < 0, 1 / (1 - x.clamp(max=0)), x + 1)
    return torch.log(s / s.sum(dim=dim, keepdim=True))


def stablemax_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_LABEL_ID,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Per-token loss [..., L] of logits [..., L, V]; 0 where labels == ignore_index.

    compute_dtype: float64 as in the reference; pass float32 where the device has no float64 (MPS).
    """
    valid = labels != ignore_index
    logprobs = log_stablemax(cast(logits, compute_dtype), dim=-1)
    picked = logprobs.gather(-1, torch.where(valid, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    return -torch.where(valid, picked, 0)


class _ScoredCarry(Protocol):
    labels: torch.Tensor
    halted: torch.Tensor
    steps: torch.Tensor


def act_loss(
    outputs: Mapping[str, torch.Tensor],
    carry: _ScoredCarry,
    *,
    global_batch_size: int,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRM's loss for one supervision step, divided by global_batch_size, and its metrics.

    loss = (sum over sequences of the mean stablemax CE over its valid tokens
            + 0.5 * sum of BCE(q_halt, sequence exactly right)) / global_batch_size.
    outputs and carry are what the model's forward returned: "logits", "q_halt_logits"; labels, halted, steps.
    Metrics are detached float32 sums over this batch (add them over micro-batches and workers), as in the
    reference: count (halted sequences with labels), accuracy (sum of their token accuracies), exact_accuracy,
    q_halt_accuracy, steps (sum of their step counts), lm_loss and q_halt_loss (unnormalised sums).
    """
    logits, q_halt_logits = outputs["logits"], outputs["q_halt_logits"]
    labels, halted, steps = carry.labels, carry.halted, carry.steps
    token_loss = stablemax_cross_entropy(logits, labels, compute_dtype=compute_dtype)

    with torch.no_grad():
        mask = labels != IGNORE_LABEL_ID
        counts = mask.sum(-1)
        divisor = counts.clamp_min(1)
        is_correct = mask & (logits.argmax(-1) == labels)
        seq_correct = is_correct.sum(-1) == counts
        scored = halted & (counts > 0)  # metrics count only sequences that finished with this step
        metrics = {
            "count": scored.sum(),
            "accuracy": torch.where(scored, is_correct.sum(-1) / divisor, 0).sum(),
            "exact_accuracy": (scored & seq_correct).sum(),
            "q_halt_accuracy": (scored & ((q_halt_logits >= 0) == seq_correct)).sum(),
            "steps": torch.where(scored, steps, 0).sum(),
        }

    lm_loss = (token_loss / divisor.unsqueeze(-1)).sum()
    q_halt_loss = F.binary_cross_entropy_with_logits(
        q_halt_logits, seq_correct.to(q_halt_logits.dtype), reduction="sum"
    )
    metrics["lm_loss"] = lm_loss.detach()
    metrics["q_halt_loss"] = q_halt_loss.detach()
    loss = (lm_loss + 0.5 * q_halt_loss) / global_batch_size
    return loss, {k: v.to(torch.float32) for k, v in metrics.items()}
