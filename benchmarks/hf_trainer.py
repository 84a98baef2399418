"""The transformers `Trainer` as the reference of `python -m benchmarks hf`, driven one optimizer step at a time.

The Trainer is used as its users use it: `Trainer(model, TrainingArguments(...), train_dataset, data_collator=
DataCollatorWithPadding(tokenizer))`, `trainer.train()`. Its arguments are its defaults but for what the comparison
fixes: the batch, the device, the precision, no evaluation, saving, reporting or progress bar, loader workers 0, and
raytrm's optimizer settings (lr, betas, weight decay, clipping, warm-up); its optimizer is its default (AdamW, fused
with torch >= 2.8, on a CPU as on CUDA) and its sampling is per-batch dynamic padding without length grouping (its
default), its loader's pinned memory on CUDA too.

Its precision is raytrm's: the weights are loaded in fp32 on both sides, and where raytrm's forward runs in bf16
(its default on CUDA) it is autocast over those fp32 weights (raytrm.families.hf.HFTask.autocast), which is what
`TrainingArguments(bf16=True)` does (accelerate's mixed precision: autocast around the forward, fp32 master weights,
fp32 optimizer states); fp32 is neither flag.

Its dataset is the records raytrm trains on, with raytrm's tokens (the same tokenizer call, read from raytrm's
cache), as lists, the form `datasets.map(tokenizer)` gives; the collator pads each batch to its longest record. Its
sampler draws raytrm's epoch order (raytrm.data.loader.epoch_permutation), so its step k trains on the records of
raytrm's step k: a round of the benchmark compares the two on one batch.

`train()` runs in the benchmark's thread, and a callback runs raytrm's step at the end of each of its own
(`on_step_end`): the two alternate, one step each, in one thread, each at the thread's torch threads. On a GPU the
clock is read after the device has finished the work queued before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raytrm import config as cfg
from raytrm.data.loader import epoch_permutation
from raytrm.hardware import device as devices


class TokenizedList(torch.utils.data.Dataset):
    """raytrm's training records (raytrm.data.hf_records.LabelledRecords) as the Trainer's features: lists of ids."""

    def __init__(self, records: Any) -> None:
        cache, self.labels = records.cache, records.labels
        self.features = []
        for i, record in enumerate(records.records):
            a, b = int(cache.offsets[record]), int(cache.offsets[record + 1])
            feature = {"input_ids": cache.tokens[a:b].tolist(), "attention_mask": [1] * (b - a)}
            if cache.token_types is not None:
                feature["token_type_ids"] = cache.token_types[a:b].tolist()
            feature["labels"] = int(records.labels[i])
            self.features.append(feature)

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.features[index]


class EpochOrder(torch.utils.data.Sampler):
    """raytrm's order of the records: its e-th pass yields epoch e's permutation."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch = size, seed, 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self):  # type: ignore[no-untyped-def]
        order = epoch_permutation(self.size, self.seed, self.epoch)
        self.epoch += 1
        return iter(order.tolist())


class TrainerReference:
    """A transformers Trainer on raytrm's records whose loop runs another step after each of its own (`alternate`)."""

    def __init__(
        self,
        experiment: cfg.ExperimentConfig,
        records: Any,
        model_dir: Path,
        out_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        from transformers import (
            AutoModelForSequenceClassification,
            AutoTokenizer,
            DataCollatorWithPadding,
            PrinterCallback,
            Trainer,
            TrainingArguments,
        )

        train = experiment.training
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        names = list(records.metadata.label_names)
        torch.manual_seed(train.seed)  # the new head's weights
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_dir,
            num_labels=len(names),
            id2label=dict(enumerate(names)),
            label2id={n: i for i, n in enumerate(names)},
            dtype=torch.float32,
        )
        self.dataset = TokenizedList(records)
        self.args = TrainingArguments(
            output_dir=str(out_dir),
            per_device_train_batch_size=train.global_batch_size,
            learning_rate=train.lr,
            adam_beta1=train.betas[0],
            adam_beta2=train.betas[1],
            weight_decay=train.weight_decay,
            max_grad_norm=train.grad_clip or 0.0,
            warmup_steps=train.warmup_steps,
            dataloader_num_workers=0,
            use_cpu=device.type == devices.CPU,
            **precision(dtype),
            eval_strategy="no",
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            seed=train.seed,
        )
        order = EpochOrder(len(self.dataset), train.seed)

        class _Trainer(Trainer):
            def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler:
                return order

        self.trainer = _Trainer(
            model=self.model,
            args=self.args,
            train_dataset=self.dataset,
            data_collator=DataCollatorWithPadding(self.tokenizer),
            processing_class=self.tokenizer,
        )
        self.trainer.remove_callback(PrinterCallback)  # its summary line at the end of train()
        self.device = device

    def alternate(self, other: Callable[[], object], warmup: int, repeats: int) -> tuple[list[float], list[float]]:
        """`train()` for warmup + repeats steps, `other()` after each of them; returns the seconds of the timed
        steps of other and of the Trainer, round by round.

        A Trainer step is timed from the end of `other()` to the end of its own next step (`on_step_end`): the whole
        of its loop's cycle, the batch gathered and padded, the forward, the backward, clipping, the optimizer, the
        schedule and its callbacks. Each clock is read once the device has run what was queued before it.
        """
        from transformers import TrainerCallback

        others: list[float] = []
        theirs: list[float] = []
        device = self.device

        class _Alternate(TrainerCallback):
            mark = 0.0

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                timed = state.global_step > warmup
                devices.synchronize(device)
                if timed:
                    theirs.append(time.perf_counter() - self.mark)
                start = time.perf_counter()
                other()
                devices.synchronize(device)
                if timed:
                    others.append(time.perf_counter() - start)
                self.mark = time.perf_counter()

        self.args.max_steps = warmup + repeats
        callback = _Alternate()
        self.trainer.add_callback(callback)
        try:
            self.trainer.train()
        finally:
            self.trainer.remove_callback(callback)
        return others, theirs


def precision(dtype: torch.dtype) -> dict[str, bool]:
    """TrainingArguments' flags for raytrm's forward dtype: autocast to it over fp32 weights, as raytrm runs it."""
    if dtype == torch.float32:
        return {}
    if dtype == torch.bfloat16:
        return {"bf16": True}
    # fp16: the Trainer adds a gradient scaler raytrm's step has not; the two would not run the same step.
    raise ValueError(f"the hf bench compares fp32 or bf16 forwards, not {dtype}")


def padded_tokens(model: torch.nn.Module, counts: list[int]) -> Any:
    """Count the token positions (padding included) of every forward of the model, and of its copies, into counts."""

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            counts.append(int(np.prod(ids.shape)))

    return model.register_forward_pre_hook(hook, with_kwargs=True)
