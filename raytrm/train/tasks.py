"""What the Trainer needs of a model family: its data, its model, one micro-batch's loss, and its evaluation.

The Trainer owns the life cycle (optimizers, EMA, accumulation cuts, out-of-memory redo, checkpoints); a task owns
what differs between families: TRM's carry and halting exploration, the transformer's language-model or classifier
loss. Every micro-batch's loss is divided by a count of the whole global batch (sequences for TRM and the
classifier, tokens for the language model), so the accumulated gradient does not depend on how the batch is cut.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raytrm import config as cfg
from raytrm.data.cache import open_dataset_for
from raytrm.data.text import open_text_dataset
from raytrm.models.losses import act_loss
from raytrm.models.transformer import Transformer
from raytrm.models.trm import TRM, Carry, Exploration, rows
from raytrm.train.optim import SignSGD

Batch = dict[str, torch.Tensor]
Scalar = torch.Tensor | float  # a 0-dim tensor on the device, or a number the host already knows


class Task(Protocol):
    """The contract between the Trainer and a model family."""

    model: nn.Module
    train_data: Any  # len() and batch(indices) -> dict of arrays, for raytrm.data.loader
    test_data: Any
    sparse_optimizer: SignSGD | None
    #: Tokens a training sample holds, where throughput is counted in tokens (the language model); else None.
    tokens_per_sample: int | None
    #: Whether most of the gradient is final well before the backward ends, so that summing it across workers during
    #: the backward pays (raytrm.sync.contract.OverlappedAllReduce).
    overlaps_sync: bool

    def begin_step(self, batch: Batch, global_batch: int, part: slice) -> Any: ...
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


def make_task(config: cfg.ExperimentConfig, device: torch.device, dtype: torch.dtype, loss_dtype: torch.dtype) -> Task:
    """The task of the config's model family, with its data opened and its model built on device."""
    if config.model.name == "transformer":
        return TransformerTask(config, device, dtype)
    return TRMTask(config, device, dtype, loss_dtype)


def _test_batches(data: Any, batch_size: int, max_batches: int | None, device: torch.device):
    n = len(data)
    for b, start in enumerate(range(0, n, batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        idx = np.arange(start, min(n, start + batch_size))
        yield {k: torch.from_numpy(v).long().to(device) for k, v in data.batch(idx).items()}


# -- TRM -----------------------------------------------------------------------------------------------------------


class TRMTask:
    """TRM on puzzles: one carry for this worker's slots of the global batch; micro-batches read and write theirs."""

    tokens_per_sample = None
    # One network runs in every H/L cycle, so each weight's gradient is final only as the backward ends: there is
    # nothing to send while it runs.
    overlaps_sync = False

    def __init__(
        self, config: cfg.ExperimentConfig, device: torch.device, dtype: torch.dtype, loss_dtype: torch.dtype
    ) -> None:
        self.config, self.device, self.loss_dtype = config, device, loss_dtype
        train = config.training
        self.train_data, self.test_data = open_dataset_for(config.data)
        meta = self.train_data.metadata
        torch.manual_seed(train.seed)
        self.model = TRM(config.model, meta.vocab_size, meta.seq_len, meta.num_puzzle_identifiers, dtype=dtype).to(
            device
        )
        self.sparse_optimizer = (
            SignSGD(self.model.puzzle_emb, lr=train.puzzle_emb_lr, weight_decay=train.puzzle_emb_weight_decay)
            if self.model.puzzle_emb is not None
            else None
        )
        self.explore_rng = torch.Generator().manual_seed(train.seed + 1)
        #: The next step's exploration, drawn ahead by prepare_step: (the generator's state before it, the global
        #: batch it was drawn for, the draws).
        self._drawn: tuple[torch.Tensor, int, Exploration] | None = None
        # Slots keep their state across steps, so the cut can change between steps without touching any slot.
        self.carry: Carry | None = None

    def _draw(self, global_batch: int) -> Exploration:
        # Drawn for the whole global batch on every worker, then sliced: the draws do not depend on the cut, on a
        # redo, or on how the batch is split between workers.
        model_cfg = self.config.model
        return Exploration.draw(
            global_batch,
            model_cfg.halt_exploration_prob,
            model_cfg.halt_max_steps,
            generator=self.explore_rng,
            device=self.device,
        )

    def prepare_step(self, global_batch: int) -> None:
        """Draw the next step's exploration now: on the host and, on CUDA, copied behind this step's work, so the
        next step's first kernels do not wait for the host's draws."""
        state = self.explore_rng.get_state()
        self._drawn = (state, global_batch, self._draw(global_batch))

    def begin_step(self, batch: Batch, global_batch: int, part: slice) -> Exploration:
        """batch holds this worker's slots `part` of the global batch."""
        drawn, self._drawn = self._drawn, None
        if drawn is not None and drawn[1] == global_batch:
            exploration = drawn[2][part]
        else:
            if drawn is not None:  # drawn for another global batch: draw again from the same state
                self.explore_rng.set_state(drawn[0])
            exploration = self._draw(global_batch)[part]
        if self.carry is None:
            self.carry = self.model.initial_carry(batch)
        self._global_batch = global_batch
        return exploration

    def micro_step(
        self, batch: Batch, part: slice, step: Exploration, model: nn.Module | None = None
    ) -> tuple[Scalar, dict[str, Scalar]]:
        """Forward and backward of the slots `part`, on model (the task's, or a replica sharing its weights)."""
        assert self.carry is not None
        micro = {k: rows(v, part) for k, v in batch.items()}
        carry, outputs = (model or self.model)(self.carry[part], micro, step[part])
        loss, metrics = act_loss(outputs, carry, global_batch_size=self._global_batch, compute_dtype=self.loss_dtype)
        loss.backward()
        slots = len(self.carry.halted)
        if part.indices(slots) == (0, slots, 1):
            self.carry = carry  # the micro-batch is every slot: its carry is the new one, without copying it in
        else:
            self.carry.assign_(part, carry)
        return loss.detach(), metrics

    def rates(self, totals: dict[str, float], global_batch: int) -> dict[str, float | None]:
        return _rates(totals, global_batch)

    def snapshot(self) -> Carry:
        assert self.carry is not None
        return Carry.from_dict({k: v.clone() for k, v in self.carry.to_dict().items()})

    def restore(self, saved: Carry) -> None:
        self.carry = saved

    def evaluate(self, batch_size: int, max_batches: int | None) -> dict[str, float]:
        """Cell and exact accuracy on the test split, with the halting steps used."""
        model = self.model
        correct_cells = valid_cells = exact = count = steps_used = baseline_cells = 0.0
        cell_acc_sum = cell_acc_sq = 0.0  # per-puzzle cell accuracy and its square, summed: their spread over puzzles
        for batch in _test_batches(self.test_data, batch_size, max_batches, self.device):
            n = len(batch["inputs"])
            carry = model.initial_carry(batch)
            done = torch.zeros(n, dtype=torch.bool, device=self.device)
            preds = torch.zeros_like(batch["labels"])
            used = torch.zeros(n, dtype=torch.int32, device=self.device)
            for _ in range(self.config.model.halt_max_steps):
                carry, out = model(carry, batch)
                newly = carry.halted & ~done
                preds[newly] = out["logits"][newly].argmax(-1)
                used[newly] = carry.steps[newly]
                done |= carry.halted
                if bool(done.all()):
                    break
            labels = batch["labels"]
            mask = labels != -100
            hits = (preds == labels) & mask
            per_puzzle = hits.sum(-1).double() / mask.sum(-1).clamp(min=1).double()
            cell_acc_sum += float(per_puzzle.sum())
            cell_acc_sq += float((per_puzzle**2).sum())
            correct_cells += float(hits.sum())
            valid_cells += float(mask.sum())
            exact += float((hits.sum(-1) == mask.sum(-1)).sum())
            baseline_cells += float(((batch["inputs"] == labels) & mask).sum())
            steps_used += float(used.sum())
            count += n
        exact_acc = exact / max(1, count)
        return {
            "eval_cell_acc": correct_cells / max(1, valid_cells),
            "eval_exact_acc": exact_acc,
            # Standard errors over puzzles: how far another draw of as many test puzzles could move each score.
            "eval_cell_acc_se": _standard_error(cell_acc_sum, cell_acc_sq, count),
            "eval_exact_acc_se": math.sqrt(exact_acc * (1 - exact_acc) / count) if count > 1 else 0.0,
            "eval_steps": steps_used / max(1, count),
            "eval_copy_givens_acc": baseline_cells / max(1, valid_cells),
            "eval_puzzles": count,
        }

    def carry_state(self) -> dict[str, torch.Tensor] | None:
        return self.carry.to_dict() if self.carry is not None else None

    def load_carry(self, state: dict[str, torch.Tensor] | None, device: torch.device) -> None:
        self.carry = Carry.from_dict(state).to(device) if state is not None else None

    def rng_state(self) -> dict[str, torch.Tensor]:
        # A step's draws drawn ahead belong to that step: a checkpoint saves the state before them.
        return {"explore": self._drawn[0] if self._drawn is not None else self.explore_rng.get_state()}

    def load_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        self._drawn = None
        self.explore_rng.set_state(state["explore"])


def _standard_error(total: float, sum_sq: float, n: float) -> float:
    """Standard error of the mean of n values from their sum and sum of squares (sample variance, n - 1)."""
    if n < 2:
        return 0.0
    mean = total / n
    variance = max(0.0, (sum_sq - n * mean * mean) / (n - 1))
    return math.sqrt(variance / n)


#: Loss-head metrics that are sums over the sequences that halted this step (the reference's convention).
HALTED_RATES = ("accuracy", "exact_accuracy", "q_halt_accuracy", "steps")


def _rates(totals: dict[str, float], batch_size: int) -> dict[str, float | None]:
    """Turn the loss head's sums into rates: per halted sequence (None when none halted), losses per sample."""
    halted = totals.get("count", 0.0)
    out: dict[str, float | None] = {"halted": halted}
    for key, value in totals.items():
        if key in HALTED_RATES:
            out[key] = value / halted if halted else None
        elif key != "count":
            out[key] = value / batch_size
    return out


# -- transformer ---------------------------------------------------------------------------------------------------


class TransformerTask:
    """The byte-level transformer on text: mean cross-entropy per byte (lm) or per document (classify)."""

    sparse_optimizer = None
    carry = None
    overlaps_sync = True  # the head and the last layers finish their gradients first: most bytes can leave early

    def __init__(self, config: cfg.ExperimentConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.config, self.device = config, device
        self.train_data, self.test_data = open_text_dataset(config.data, config.model)
        meta = self.train_data.metadata
        self.lm = meta.task == "lm"
        self.tokens_per_sample = meta.seq_len if self.lm else None
        torch.manual_seed(config.training.seed)
        self.model = Transformer(config.model, meta.vocab_size, meta.num_classes, meta.pad_id, dtype=dtype).to(device)
        self._baseline: np.ndarray | None = None

    def begin_step(self, batch: Batch, global_batch: int, part: slice) -> int:
        """The loss divisor: the global batch's tokens (lm) or documents (classify)."""
        return global_batch * (self.tokens_per_sample or 1)

    def prepare_step(self, global_batch: int) -> None:
        pass  # nothing is drawn ahead: dropout draws on the device

    def micro_step(
        self, batch: Batch, part: slice, divisor: int, model: nn.Module | None = None
    ) -> tuple[Scalar, dict[str, Scalar]]:
        labels = rows(batch["labels"], part)
        logits = (model or self.model)(rows(batch["inputs"], part))
        # Cross-entropy in fp32 whatever the forward dtype; summed, then divided by the global count.
        total = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum")
        loss = total / divisor
        loss.backward()
        with torch.no_grad():
            correct = (logits.argmax(-1) == labels).sum()
        return loss.detach(), {"loss_sum": total.detach(), "correct": correct, "count": labels.numel()}

    def rates(self, totals: dict[str, float], global_batch: int) -> dict[str, float | None]:
        ce = totals["loss_sum"] / totals["count"]
        out: dict[str, float | None] = {"lm_loss" if self.lm else "ce_loss": ce}
        if self.lm:
            out["bits_per_byte"] = ce / math.log(2)
        out["accuracy"] = totals["correct"] / totals["count"]
        return out

    def snapshot(self) -> None:
        return None  # no state besides the weights' gradients, which the Trainer discards

    def restore(self, saved: None) -> None:
        pass

    def evaluate(self, batch_size: int, max_batches: int | None) -> dict[str, float]:
        if self.lm:
            return self._evaluate_lm(batch_size, max_batches)
        return self._evaluate_classifier(batch_size, max_batches)

    def unigram_bits(self) -> np.ndarray:
        """-log2 p(byte) under the training bytes' frequencies (add-one smoothed): the baseline a model must beat."""
        if self._baseline is None:
            counts = self.train_data.byte_counts() + 1.0
            self._baseline = -np.log2(counts / counts.sum())
        return self._baseline

    def _evaluate_lm(self, batch_size: int, max_batches: int | None) -> dict[str, float]:
        baseline = torch.from_numpy(self.unigram_bits()).to(self.device)
        nats = baseline_bits = tokens = 0.0
        for batch in _test_batches(self.test_data, batch_size, max_batches, self.device):
            logits = self.model(batch["inputs"]).float()
            labels = batch["labels"]
            nats += float(F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum"))
            baseline_bits += float(baseline[labels].sum())
            tokens += labels.numel()
        loss = nats / max(1.0, tokens)
        return {
            "eval_loss": loss,
            "eval_bits_per_byte": loss / math.log(2),
            "eval_unigram_bits_per_byte": baseline_bits / max(1.0, tokens),
            "eval_bytes": tokens,
        }

    def _evaluate_classifier(self, batch_size: int, max_batches: int | None) -> dict[str, float]:
        preds, labels = [], []
        for batch in _test_batches(self.test_data, batch_size, max_batches, self.device):
            preds.append(self.model(batch["inputs"]).argmax(-1).cpu())
            labels.append(batch["labels"].cpu())
        pred, true = torch.cat(preds).numpy(), torch.cat(labels).numpy()
        classes = self.train_data.metadata.num_classes
        majority = int(np.bincount(self.train_data.labels, minlength=classes).argmax())
        return {
            "eval_accuracy": float((pred == true).mean()),
            "eval_macro_f1": macro_f1(pred, true, classes),
            "eval_majority_acc": float((true == majority).mean()),
            "eval_documents": float(len(true)),
        }

    def carry_state(self) -> None:
        return None

    def load_carry(self, state: dict[str, torch.Tensor] | None, device: torch.device) -> None:
        pass

    def rng_state(self) -> dict[str, torch.Tensor]:
        return {}  # dropout draws from torch's global generator, which the Trainer saves

    def load_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        pass


def macro_f1(pred: np.ndarray, true: np.ndarray, classes: int) -> float:
    """F1 averaged over the classes that occur in the labels or the predictions."""
    scores = []
    for c in range(classes):
        tp = int(((pred == c) & (true == c)).sum())
        fp, fn = int(((pred == c) & (true != c)).sum()), int(((pred != c) & (true == c)).sum())
        if tp + fp + fn:
            scores.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores)) if scores else 0.0
