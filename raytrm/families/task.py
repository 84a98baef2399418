"""The contract between the Trainer and a model family's task, and what the families' tasks share.

The Trainer owns the life cycle (optimizers, EMA, accumulation cuts, out-of-memory redo, checkpoints); a task owns
what differs between families: its data, its model, one micro-batch's loss, its evaluation, and any state it keeps
per sample (TRM's carry). Every micro-batch's loss is divided by a count of the whole global batch (sequences, or
tokens for a language model), so the accumulated gradient does not depend on how the batch is cut.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from raytrm.config import ModelConfig
from raytrm.families import Score
from raytrm.models.sign_sgd import SignSGD

Batch = dict[str, torch.Tensor]
Scalar = torch.Tensor | float  # a 0-dim tensor on the device, or a number the host already knows


class Task(Protocol):
    """What the Trainer asks of a model family."""

    model: nn.Module
    train_data: Any  # len() and batch(indices) -> dict of arrays, for raytrm.data.loader
    test_data: Any
    sparse_optimizer: SignSGD | None
    #: Tokens a training sample holds, where throughput is counted in tokens (the language model); else None.
    tokens_per_sample: int | None
    #: Where a micro-batch is counted in padded tokens (its records x its longest record, raytrm.train.micro_batches:
    #: a Hugging Face classifier's records, of varied lengths), the most tokens a record may hold (max length); None
    #: where it is counted in samples (every sample of a batch costs alike).
    cut_width: int | None
    #: Whether most of the gradient is final well before the backward ends, so that summing it across workers during
    #: the backward pays (raytrm.sync.contract.OverlappedAllReduce).
    overlaps_sync: bool

    def begin_step(self, batch: Batch, global_batch: int, part: slice) -> Any: ...
    #: What each of this worker's slots costs to run, where they differ (an hf classifier's records: their tokens, as
    #: each micro-batch is cut to its longest), for a CPU's threads to share a step's work evenly
    #: (raytrm.train.side_by_side.plan); None where every slot costs the same.
    def slot_costs(self, step: Any) -> Sequence[int] | None: ...
    #: The batch as costly as one of its size can be (a Hugging Face classifier's records padded to max length, each
    #: micro-batch run at that width), its result unchanged: what the memory governor measures its fit on. The batch
    #: itself where every batch of a size costs the same.
    def widest(self, batch: Batch) -> Batch: ...
    #: Host work for the next step, done while the device still runs this one (the Trainer calls it with the next
    #: global batch's gathering); begin_step uses it, and what it draws is not drawn twice.
    def prepare_step(self, global_batch: int) -> None: ...
    #: A micro-batch's loss and metric sums, as the device computed them: scalars (0-dim tensors) or plain numbers
    #: known on the host. The Trainer adds them up on the device and reads them once a step (Trainer._read).
    def micro_step(
        self, batch: Batch, part: slice, step: Any, model: nn.Module | None = None
    ) -> tuple[Scalar, dict[str, Scalar]]: ...
    def rates(self, totals: dict[str, float], global_batch: int) -> dict[str, float | None]: ...
    def snapshot(self) -> Any: ...
    def restore(self, saved: Any) -> None: ...
    def evaluate(self, batch_size: int, max_batches: int | None) -> dict[str, float]: ...
    def carry_state(self) -> dict[str, torch.Tensor] | None: ...
    def load_carry(self, state: dict[str, torch.Tensor] | None, device: torch.device) -> None: ...
    def rng_state(self) -> dict[str, torch.Tensor]: ...
    def load_rng_state(self, state: dict[str, torch.Tensor]) -> None: ...


def eval_batches(data: Any, batch_size: int, max_batches: int | None, device: torch.device) -> Iterator[Batch]:
    """The held-out split in order, batch_size samples a batch (at most max_batches), on the device."""
    n = len(data)
    for b, start in enumerate(range(0, n, batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        idx = np.arange(start, min(n, start + batch_size))
        yield {k: torch.from_numpy(v).long().to(device) for k, v in data.batch(idx).items()}


def standard_error(total: float, sum_sq: float, n: float) -> float:
    """Standard error of the mean of n values from their sum and sum of squares (sample variance, n - 1)."""
    if n < 2:
        return 0.0
    mean = total / n
    variance = max(0.0, (sum_sq - n * mean * mean) / (n - 1))
    return math.sqrt(variance / n)


def macro_f1(pred: np.ndarray, true: np.ndarray, classes: int) -> float:
    """F1 averaged over the classes that occur in the labels or the predictions."""
    scores = []
    for c in range(classes):
        tp = int(((pred == c) & (true == c)).sum())
        fp, fn = int(((pred == c) & (true != c)).sum()), int(((pred != c) & (true == c)).sum())
        if tp + fp + fn:
            scores.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores)) if scores else 0.0


def classification_scores(pred: np.ndarray, true: np.ndarray, classes: int) -> dict[str, Any]:
    """Accuracy, macro-F1 and the confusion matrix (rows the true labels, columns the predicted ones, both in the
    labels' order) of predicted against true class indices."""
    confusion = np.zeros((classes, classes), dtype=np.int64)
    np.add.at(confusion, (true, pred), 1)
    return {
        "accuracy": float((pred == true).mean()) if len(true) else 0.0,
        "macro_f1": macro_f1(pred, true, classes),
        "confusion": confusion.tolist(),
    }


def text_scores(model: ModelConfig) -> tuple[Score, ...]:
    """The scores of a text model (the byte transformer, a Hugging Face model): a classifier's macro-F1 (every class
    counts alike, whatever its share of the records) or accuracy; a language model's held-out loss."""
    if model.task == "classify":
        return Score("eval_macro_f1"), Score("eval_accuracy")
    return (Score("eval_loss", loss=True),)
