"""The byte-level transformer family: a language model (next byte) or a document classifier on text, the user's own
(a file, a directory of files, JSONL or CSV records) or the Python standard library's sources.

Cross-entropy is taken in fp32 whatever the forward dtype, summed and divided by the global batch's tokens (lm) or
documents (classify), so the gradient does not depend on the cut.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raytrm import config as cfg
from raytrm.data.text import open_text_dataset
from raytrm.families import Anchor, Family, register
from raytrm.families.task import Batch, Scalar, eval_batches, macro_f1, text_scores
from raytrm.models.transformer import Transformer
from raytrm.models.trm import rows

#: Where the embedded default was tuned (the size rule's anchor).
ANCHOR = Anchor(128, 2e-3, 50)

#: `raytrm train --model transformer`'s embedded default: a small byte-level LM on the standard library's sources
#: that shows bits per byte falling within a few minutes on a laptop's CPU.
EMBEDDED_DEFAULT: dict[str, Any] = {
    "model": {
        "name": "transformer",
        "task": "lm",
        "hidden_size": ANCHOR.width,
        "num_heads": 4,
        "layers": 3,
        "seq_len": 128,
    },
    "data": {"name": "text"},
    "training": {
        "global_batch_size": 32,
        "lr": ANCHOR.lr,
        "warmup_steps": ANCHOR.warmup_steps,
        "weight_decay": 0.1,
        "grad_clip": 1.0,
        "time_budget_s": 180.0,
        "log_interval": 10,
        "eval_interval": 200,
    },
}


class TransformerTask:
    """The byte-level transformer on text: mean cross-entropy per byte (lm) or per document (classify)."""

    sparse_optimizer = None
    carry = None
    cut_width = None  # micro-batches counted in samples: every sample runs seq_len tokens
    overlaps_sync = True  # the head and the last layers finish their gradients first: most bytes can leave early

    def __init__(
        self, config: cfg.ExperimentConfig, device: torch.device, dtype: torch.dtype, loss_dtype: torch.dtype
    ) -> None:
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

    def slot_costs(self, step: int) -> None:
        return None  # every sample runs seq_len tokens

    def widest(self, batch: Batch) -> Batch:
        return batch  # every sample runs seq_len tokens

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
        for batch in eval_batches(self.test_data, batch_size, max_batches, self.device):
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
        for batch in eval_batches(self.test_data, batch_size, max_batches, self.device):
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


def _require_data(data: cfg.DataConfig) -> None:
    """A text file, a directory of them, or records, where a path is given (else the standard library's sources)."""
    if data.path:
        from raytrm.data.text_cache import require_source

        require_source(data.path)


def _lr_exponent(model: cfg.ModelConfig) -> tuple[str, float]:
    """The transformer's lr falls as 1/sqrt(width)."""
    return "transformer", 0.5


register(
    Family(
        name="transformer",
        data_kinds=cfg.DATA_KINDS["transformer"],
        build=TransformerTask,
        require_data=_require_data,
        embedded_default=EMBEDDED_DEFAULT,
        anchor=ANCHOR,
        lr_exponent=_lr_exponent,
        scores=text_scores,
    )
)
