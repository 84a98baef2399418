"""The Hugging Face family: the user's own transformers model, a sequence classifier or a causal language model,
trained whole or with LoRA (peft) on the user's records, tokenized once with the model's tokenizer.

A global batch's records come sorted by length, longest first, and padded to the longest; each micro-batch is cut
to its own longest (dynamic padding), and padding is masked, so the cut changes the work, not the result. A
classifier's micro-batch is counted in padded tokens (`cut_width`, raytrm.train.micro_batches): a micro-batch of n
records at max length holds more records where they are short, within the same n x max length tokens. On a CPU's
threads side by side, the records are shared out by their tokens (`slot_costs`), not their count. The
cross-entropy is taken in fp32 whatever the forward's dtype, summed and divided by the global batch's documents
(classify) or tokens (lm), so the gradient does not depend on the cut either. With LoRA a checkpoint holds what
trains (the adapters and a classifier's head); the base weights are model.path's. At a run's end RUN_DIR/model is
written for transformers (raytrm.families.hf_model.save_model_dir).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raytrm import config as cfg
from raytrm.errors import ConfigError
from raytrm.families import Anchor, Family, register
from raytrm.families.hf_model import MODEL_DIR, build_model, is_lora, load_tokenizer, locate, save_model_dir
from raytrm.families.task import Batch, Scalar, classification_scores, eval_batches, text_scores
from raytrm.models.trm import rows

logger = logging.getLogger(__name__)

#: Labels a language model's batch may hold at positions that count for nothing (transformers' convention).
IGNORED = -100

#: The size rule's anchor. The width is BERT-base's, the kind of model this lr is usual for; the rule leaves a model
#: the user brings at this lr whatever its width (exponent 0). 2e-5 is full fine-tuning's usual lr, and full
#: fine-tuning is what model.lora_rank unset trains; LoRA's adapters want about ten times it (2e-4): give --lr with
#: --lora-rank.
ANCHOR = Anchor(768, 2e-5, 50)

#: `raytrm train --model hf --model-path DIR --data FILE`'s experiment: a classifier fine-tuned whole, as the
#: transformers Trainer's defaults do it (AdamW's betas, weight decay 0.01, gradients clipped at 1). model.path has
#: no default (no hub here): the config refuses hf without one, in one line. No EMA: fine-tuning's usual recipe has
#: none, and for a whole model it would hold another copy of every weight.
EMBEDDED_DEFAULT: dict[str, Any] = {
    "model": {"name": "hf", "task": "classify", "seq_len": 128},
    "data": {"name": "records"},
    "training": {
        "global_batch_size": 16,
        "lr": ANCHOR.lr,
        "warmup_steps": ANCHOR.warmup_steps,
        "betas": [0.9, 0.999],
        "weight_decay": 0.01,
        "grad_clip": 1.0,
        "ema": False,
        # The records are tokenized ahead and cached: a batch is an index into arrays, and a loader process (spawned
        # on macOS) would only copy them.
        "dataloader_workers": 0,
        "time_budget_s": 600.0,
        "log_interval": 10,
        "eval_interval": 100,
    },
}


def open_records(data: cfg.DataConfig, model: cfg.ModelConfig, tokenizer: Any) -> tuple[Any, Any]:
    """The training and held-out records, tokenized (raytrm.data.hf_records)."""
    from raytrm.data.hf_records import open_records as open_tokenized

    return open_tokenized(data, model, tokenizer)


@dataclasses.dataclass(frozen=True)
class Step:
    """What a step's micro-batches share: the loss divisor, and the lengths of this worker's records (None for a
    language model's windows, all of one length)."""

    divisor: int
    lengths: np.ndarray | None


class HFTask:
    """A transformers classifier or language model: cross-entropy per document (classify) or per token (lm)."""

    sparse_optimizer = None
    carry = None
    overlaps_sync = True  # the head and the last layers finish their gradients first: most bytes can leave early

    def __init__(
        self,
        config: cfg.ExperimentConfig,
        device: torch.device,
        dtype: torch.dtype,
        loss_dtype: torch.dtype,
        platform: str = sys.platform,
    ) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        if platform == "darwin" and config.training.dataloader_workers:
            logger.warning(
                "training.dataloader_workers %d on macOS: each loader process is spawned and copies the tokenized "
                "records; set it to 0 (raytrm's setting for an hf model), the batches are only gathered",
                config.training.dataloader_workers,
            )
        self.tokenizer = load_tokenizer(locate(str(config.model.path)))
        self.train_data, self.test_data = open_records(config.data, config.model, self.tokenizer)
        meta = self.train_data.metadata
        self.lm = meta.task == "lm"
        self.label_names = tuple(meta.label_names or ())
        self.tokens_per_sample = meta.tokens_per_sample
        # A classifier's micro-batch is counted in padded tokens, so that short records pack more to one; a language
        # model's windows are all of max length, counted in samples.
        self.cut_width = None if self.lm else config.model.seq_len
        torch.manual_seed(config.training.seed)  # a new head's (and LoRA's A's) initial weights
        self.pad_id = meta.pad_id
        self.model = build_model(config.model, self.label_names, meta.pad_id).to(device)
        self.model.compile_regions = compiled_regions(device.type)
        self.lora = is_lora(self.model)
        self._majority: int | None = None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward in the Trainer's dtype, over fp32 weights."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def begin_step(self, batch: Batch, global_batch: int, part: slice) -> Step:
        """The loss divisor (the global batch's documents or tokens), and this worker's records' lengths, read from
        the device once a step for the micro-batches' cuts."""
        lengths = batch["lengths"].cpu().numpy() if "lengths" in batch else None
        return Step(global_batch * (self.tokens_per_sample or 1), lengths)

    def widest(self, batch: Batch) -> Batch:
        """A classifier's records padded to max length (model.seq_len) and run at that width: the padding is masked,
        so the logits and the gradient are the batch's own, at the cost of its longest possible records. A language
        model's windows are all of that length already."""
        if "lengths" not in batch:
            return batch
        width = self.config.model.seq_len
        short = width - batch["input_ids"].shape[1]
        out = dict(batch)
        fills = {"input_ids": self.pad_id or 0, "attention_mask": 0, "token_type_ids": 0}
        for key, fill in fills.items():
            if key in out and short > 0:
                out[key] = F.pad(out[key], (0, short), value=fill)
        out["lengths"] = torch.full_like(batch["lengths"], width)
        return out

    def slot_costs(self, step: Step) -> np.ndarray | None:
        """A classifier's records cost their tokens (each micro-batch is cut to its longest); an lm's windows are
        alike."""
        return step.lengths

    def prepare_step(self, global_batch: int) -> None:
        pass  # nothing is drawn ahead: dropout draws on the device

    def forward(self, model: nn.Module, batch: Batch, part: slice, longest: int | None) -> torch.Tensor:
        """Logits of the records `part`, cut to `longest` tokens (the padding past it is masked anyway)."""
        ids = rows(batch["input_ids"], part)
        mask = rows(batch["attention_mask"], part) if "attention_mask" in batch else None
        if longest is not None and longest < ids.shape[1]:
            ids = ids[:, :longest]
            mask = mask[:, :longest] if mask is not None else None
        extra: dict[str, Any] = {"use_cache": False} if self.lm else {}
        if "token_type_ids" in batch:  # a pair's segments (BERT-style), cut as the ids are
            extra["token_type_ids"] = rows(batch["token_type_ids"], part)[:, : ids.shape[1]]
        with self.autocast():
            return model(input_ids=ids, attention_mask=mask, **extra).logits

    def micro_step(
        self, batch: Batch, part: slice, step: Step, model: nn.Module | None = None
    ) -> tuple[Scalar, dict[str, Scalar]]:
        longest = int(step.lengths[part].max()) if step.lengths is not None else None
        logits = self.forward(model or self.model, batch, part, longest)
        labels = rows(batch["labels"], part)
        if self.lm:
            labels = labels[:, : logits.shape[1]]
        # Cross-entropy in fp32 whatever the forward dtype; summed, then divided by the global count.
        total = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum", ignore_index=IGNORED)
        loss = total / step.divisor
        loss.backward()
        with torch.no_grad():
            counted = labels != IGNORED
            correct = ((logits.argmax(-1) == labels) & counted).sum()
            count: Scalar = counted.sum() if self.lm else labels.numel()
        return loss.detach(), {"loss_sum": total.detach(), "correct": correct, "count": count}

    def rates(self, totals: dict[str, float], global_batch: int) -> dict[str, float | None]:
        ce = totals["loss_sum"] / max(1.0, totals["count"])
        out: dict[str, float | None] = {"lm_loss" if self.lm else "ce_loss": ce}
        if self.lm:
            out["perplexity"] = math.exp(min(ce, 700.0))
        out["accuracy"] = totals["correct"] / max(1.0, totals["count"])
        return out

    def snapshot(self) -> None:
        return None  # no state besides the weights' gradients, which the Trainer discards

    def restore(self, saved: None) -> None:
        pass

    def evaluate(self, batch_size: int, max_batches: int | None) -> dict[str, Any]:
        if self.lm:
            return self._evaluate_lm(batch_size, max_batches)
        return self._evaluate_classifier(batch_size, max_batches)

    def _evaluate_lm(self, batch_size: int, max_batches: int | None) -> dict[str, float]:
        nats = tokens = 0.0
        for batch in eval_batches(self.test_data, batch_size, max_batches, self.device):
            logits = self.forward(self.model, batch, slice(None), None).float()
            labels = batch["labels"][:, : logits.shape[1]]
            nats += float(
                F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum", ignore_index=IGNORED)
            )
            tokens += float((labels != IGNORED).sum())
        loss = nats / max(1.0, tokens)
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)), "eval_tokens": tokens}

    def _evaluate_classifier(self, batch_size: int, max_batches: int | None) -> dict[str, Any]:
        preds, labels = [], []
        for batch in eval_batches(self.test_data, batch_size, max_batches, self.device):
            preds.append(self.forward(self.model, batch, slice(None), None).argmax(-1).cpu())
            labels.append(batch["labels"].cpu())
        pred, true = torch.cat(preds).numpy(), torch.cat(labels).numpy()
        scores = classification_scores(pred, true, len(self.label_names))
        return {
            "eval_accuracy": scores["accuracy"],
            "eval_macro_f1": scores["macro_f1"],
            "eval_majority_acc": float((true == self.majority_label()).mean()),
            "eval_documents": float(len(true)),
            "eval_confusion": scores["confusion"],  # rows the true labels, columns the predicted, in label order
            "eval_labels": list(self.label_names),  # the confusion's axes, so that the matrix reads on its own
        }

    def majority_label(self, chunk: int = 4096) -> int:
        """The training records' most frequent label: the baseline a classifier must beat."""
        if self._majority is None:
            counts = np.zeros(len(self.label_names), dtype=np.int64)
            for start in range(0, len(self.train_data), chunk):
                idx = np.arange(start, min(len(self.train_data), start + chunk))
                counts += np.bincount(self.train_data.batch(idx)["labels"], minlength=len(counts))
            self._majority = int(counts.argmax())
        return self._majority

    def trained_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the model: with LoRA the adapters and a classifier's head (the base weights are
        model.path's, loaded again on resume), else every weight."""
        if not self.lora:
            return self.model.state_dict()
        return {name: p.detach() for name, p in self.model.named_parameters() if p.requires_grad}

    def load_trained_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore trained_state's tensors (checked against it beforehand by raytrm.train.checkpoint_fit)."""
        if not self.lora:
            self.model.load_state_dict(state)
            return
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)

    def carry_state(self) -> None:
        return None

    def load_carry(self, state: dict[str, torch.Tensor] | None, device: torch.device) -> None:
        pass

    def rng_state(self) -> dict[str, torch.Tensor]:
        return {}  # dropout draws from torch's generator, which the Trainer saves

    def load_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        pass


def compiled_regions(device_type: str) -> tuple[str, ...]:
    """What raytrm.train.compile compiles of a transformers model: its whole forward on CUDA (the sequence length
    turns dynamic at the second length seen, so one graph serves every padded width); nothing elsewhere, since
    inductor's Metal backend does not serve every model's operations and a CPU gains nothing per FLOP from it."""
    return ("forward",) if device_type == "cuda" else ()


def _require_data(data: cfg.DataConfig) -> None:
    """The records' file (and the held-out one, where given) exists: an hf model trains on the user's own."""
    for field, path in (("data.path", data.path), ("data.validation_path", data.validation_path)):
        if field == "data.path" and not path:
            raise ConfigError(
                "the experiment", field, None, "a CSV, JSONL or Parquet file of records", "give --data FILE"
            )
        if path and not Path(path).expanduser().is_file():
            raise ConfigError(path, field, "no such file", "a CSV, JSONL or Parquet file of records", "check the path")


def _lr_exponent(model: cfg.ModelConfig) -> tuple[str, float]:
    """A model the user brings keeps its lr at every width: raytrm did not choose its shape."""
    return "a Hugging Face model", 0.0


def _finish(task: HFTask, run_dir: Path) -> None:
    """RUN_DIR/model: the trained model (LoRA merged in, or its adapters alone: model.lora_merge), its tokenizer and
    its labels' names, for transformers."""
    save_model_dir(task.model, task.tokenizer, Path(run_dir) / MODEL_DIR, merge=task.config.model.lora_merge)


def _infer(experiment: dict[str, Any]) -> None:
    """A classifier where the records have a label column, a language model where they have text alone."""
    from raytrm.data.records import field_names

    data, model = experiment.setdefault("data", {}), experiment.setdefault("model", {})
    if not data.get("path"):
        return
    path = Path(data["path"]).expanduser()
    label = data.get("label_field", cfg.DataConfig().label_field)
    fields = field_names(path) if path.is_file() else []
    model["task"] = "classify" if label in fields else "lm"
    logger.info(
        "%s: %s (its %s), so a %s; --task sets it yourself",
        path,
        f"a {label!r} column" if label in fields else f"no {label!r} column",
        "fields: " + ", ".join(fields) if fields else "text",
        "classifier" if model["task"] == "classify" else "language model",
    )


register(
    Family(
        name="hf",
        data_kinds=cfg.DATA_KINDS["hf"],
        build=HFTask,
        require_data=_require_data,
        embedded_default=EMBEDDED_DEFAULT,
        anchor=ANCHOR,
        lr_exponent=_lr_exponent,
        scores=text_scores,
        finish=_finish,
        infer=_infer,
    )
)
