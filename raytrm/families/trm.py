"""The Tiny Recursive Model family: TRM (attention or mlp_t) on puzzles, generated or in the reference's layout.

Its task keeps one carry per slot of this worker's share of the global batch (micro-batches read and write theirs)
and draws the halting exploration for the whole global batch on every worker, so neither depends on the cut, a redo
or the split between workers; the puzzle embedding trains with SignSGD (raytrm.models.sign_sgd).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from raytrm import config as cfg
from raytrm.data.cache import open_dataset_for
from raytrm.families import Anchor, Family, Score, register
from raytrm.families.task import Batch, Scalar, eval_batches, standard_error
from raytrm.models.losses import act_loss
from raytrm.models.sign_sgd import SignSGD
from raytrm.models.trm import TRM, Carry, Exploration, rows

#: Where the embedded default was tuned (the size rule's anchor).
ANCHOR = Anchor(64, 3e-3, 20)

#: `raytrm train`'s embedded default: small enough for a laptop's CPU, large enough to learn Sudoku rules.
EMBEDDED_DEFAULT: dict[str, Any] = {
    "model": {
        "variant": "mlp_t",
        "hidden_size": ANCHOR.width,
        "L_layers": 2,
        "H_cycles": 2,
        "L_cycles": 2,
        "halt_max_steps": 2,
    },
    "data": {"name": "sudoku", "train_puzzles": 4000, "test_puzzles": 200, "augment": 4, "givens": 40},
    "training": {
        "global_batch_size": 64,
        "lr": ANCHOR.lr,
        "warmup_steps": ANCHOR.warmup_steps,
        "weight_decay": 0.1,
        "puzzle_emb_lr": 1e-2,
        "puzzle_emb_weight_decay": 0.1,
        "time_budget_s": 180.0,
        "log_interval": 10,
        "eval_interval": 200,
    },
}


class TRMTask:
    """TRM on puzzles: one carry for this worker's slots of the global batch; micro-batches read and write theirs."""

    tokens_per_sample = None
    cut_width = None  # micro-batches counted in puzzles
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

    def slot_costs(self, step: Exploration) -> None:
        return None  # every puzzle runs the same recursion

    def widest(self, batch: Batch) -> Batch:
        return batch  # every puzzle runs the same recursion

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
        for batch in eval_batches(self.test_data, batch_size, max_batches, self.device):
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
            "eval_cell_acc_se": standard_error(cell_acc_sum, cell_acc_sq, count),
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


def _require_data(data: cfg.DataConfig) -> None:
    """A dataset directory in the reference's layout, where a path is given (else the puzzles are generated)."""
    if data.path:
        from raytrm.data.build import require_dataset

        require_dataset(Path(data.path).expanduser())


def _lr_exponent(model: cfg.ModelConfig) -> tuple[str, float]:
    """TRM-attention's lr falls as 1/width (muP's rule for Adam on hidden matrices); TRM-MLP keeps the anchor's at
    every width (raytrm.train.run.size_rule says why)."""
    return f"trm/{model.variant}", 1.0 if model.variant == "attention" else 0.0


register(
    Family(
        name="trm",
        data_kinds=cfg.DATA_KINDS["trm"],
        build=TRMTask,
        require_data=_require_data,
        embedded_default=EMBEDDED_DEFAULT,
        anchor=ANCHOR,
        lr_exponent=_lr_exponent,
        scores=lambda model: (Score("eval_cell_acc"), Score("eval_exact_acc")),
    )
)
