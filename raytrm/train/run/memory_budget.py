"""The memory budget in the loop: the governor's cuts for `raytrm train`, the pre-check and the limit for a trial.

Both run the same MemoryGovernor (raytrm.train.memory.governor) on the same measured step peaks. `adapting`: the
governor probes small cuts, chooses the largest that fits, shrinks under pressure or an allocator's refusal and grows
back (raytrm train). `holding`: a trial measures the micro-batch it is asked; the governor probes a quarter and a half
of it (real training steps, part of the warm-up), and the fit's prediction for the asked cut halts the trial before
a step the machine cannot hold (on the CPU an oversized step raises nothing: the kernel kills the process). After
that a measured peak over the budget halts it.

The governor's cut is in the trainer's unit (raytrm.train.micro_batches): samples, or a classifier's padded tokens,
where the config's micro-batch and global batch count records at their widest (max length) and each step's point is
the tokens it had in flight. Steps of varied widths leave freed blocks in glibc's heap that the next steps' peaks
count, and the peaks creep up the run; so where a token cut's step peaks above the margin's line, the heap is given
back before the next step (`Cut.release`): a release costs a share of a step (the pages are faulted in again), so
it is made only where the creep shows.

On a GPU an adapting governor's settled points are kept per GPU and torch version, keyed by the model, its data and
the step's shape (raytrm.fastpaths.tuned's store): the next run of the same model there starts at the fitted cut
instead of compiling every cut on the way up to it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from raytrm import schema
from raytrm.fastpaths.tuned import TunedChoices, store_path
from raytrm.hardware.pressure import MemoryReader
from raytrm.train.loop import Cut, Decision, Hook, Loop, Step, Stop
from raytrm.train.memory.governor import GovernorSettings, MemoryGovernor
from raytrm.train.trainer import Trainer

MiB = 2**20
PROBE_MIN_MICRO = 4  # below this a trial's probe steps would cost more than they tell


class MemoryBudget(Hook):
    """Runs a memory governor around each step; the trainer starts at the governor's first cut."""

    def __init__(self, trainer: Trainer, governor: MemoryGovernor, reader: MemoryReader | None = None) -> None:
        self.trainer, self.governor, self.reader = trainer, governor, reader
        self.rank0 = trainer.sync.rank == 0
        #: A holding governor's predicted peak for the asked cut, in bytes, once its probe is fitted.
        self.predicted: float | None = None
        #: Why a holding run went over its budget: "predicted" or "measured"; None while it holds.
        self.over_budget: str | None = None
        self._seen = 0  # the governor's events before this step
        self.releases = 0  # steps before which the heap was given back
        #: Where this run keeps its settled points for the next run of the model (GPUs only), and under what key.
        self.kept: tuple[TunedChoices, str] | None = None
        if not governor.hold:
            self.on_out_of_memory = governor.on_out_of_memory
        trainer.set_micro_batch(governor.micro_batch)

    @classmethod
    def adapting(
        cls, trainer: Trainer, settings: GovernorSettings | None = None, reader: MemoryReader | None = None
    ) -> MemoryBudget | None:
        """`raytrm train`'s governor, where the config sets a budget (else None)."""
        train = trainer.config.training
        if not train.memory_budget_mb:
            return None
        kept = _kept_fits(trainer)
        found, known = kept[0].get(kept[1]) if kept else (False, None)
        units = trainer.cut.units
        governor = MemoryGovernor(
            budget_bytes=train.memory_budget_mb * MiB,
            global_batch=units(train.global_batch_size),
            max_micro_batch=units(train.micro_batch_size or train.global_batch_size),
            settings=settings or GovernorSettings(),
            known_points=tuple(tuple(point) for point in known) if found else (),
            unit=trainer.cut.unit,
            widest_sample=units(1),
        )
        budget = cls(trainer, governor, reader or MemoryReader(device=trainer.device))
        # Only a run that probed keeps its points: a started one's first step (one-time allocations) would raise them.
        budget.kept = None if found else kept
        return budget

    @classmethod
    def holding(cls, trainer: Trainer, budget_mb: float) -> MemoryBudget:
        """A trial's: its micro-batch, probed at a quarter and a half first where it is large enough to tell."""
        train, units = trainer.config.training, trainer.cut.units
        micro = train.micro_batch
        probe = (units(micro // 4), units(micro // 2)) if micro >= PROBE_MIN_MICRO else ()
        governor = MemoryGovernor(
            budget_bytes=budget_mb * MiB,
            global_batch=units(train.global_batch_size),
            max_micro_batch=units(micro),
            probe_cuts=probe,
            hold=True,
            unit=trainer.cut.unit,
            widest_sample=units(1),
        )
        return cls(trainer, governor)

    def start(self, loop: Loop) -> Cut:
        return Cut(None, probing=self.governor.probing, widest=self.governor.measuring)

    def before_step(self, loop: Loop) -> None:
        self._seen = len(self.governor.events)

    def after_step(self, loop: Loop, step: Step) -> list[Decision]:
        governor, trainer = self.governor, self.trainer
        probed = governor.probing
        pressure = self.reader.read().pressure if self.reader is not None else None
        # A cut in tokens holds whole records: the step's point is the tokens it had in flight, not its cut.
        size = trainer.cut.in_flight if trainer.cut.width else None
        micro = governor.after_step(trainer.step, step.peak_bytes, pressure, size)
        release = size is not None and step.peak_bytes > (1 - governor.settings.margin) * governor.budget_bytes
        self.releases += release
        cut = Cut(micro, probing=governor.probing, widest=governor.measuring, release=release)
        step.events += governor.events[self._seen :]
        if self.kept is not None and governor.settled and self.rank0:
            self.kept[0].put(self.kept[1], governor.measured_points())
            self.kept = None  # once a run: its later points follow pressure, not the model
        if not governor.hold:
            # A share cap matters only beside other workers: alone, the step skips measuring it.
            if trainer.sync.world_size > 1:
                step.share_cap = governor.share_cap(trainer.local_batch, trainer.slot_bytes())
            return [cut]
        budget = governor.budget_bytes
        if probed and not governor.probing:
            self.predicted = governor.predicted_peak(governor.micro_batch)
            if self.predicted is not None and self.predicted > budget:
                self.over_budget = "predicted"
                return [
                    cut,
                    Stop(
                        f"over budget: {self.predicted / MiB:.0f} MiB predicted at micro-batch "
                        f"{governor.micro_batch} {governor.unit}, budget {budget / MiB:.0f} MiB"
                    ),
                ]
        elif not probed and loop.peak_bytes > budget:
            self.over_budget = "measured"
            peak = f"{loop.peak_bytes / MiB:.0f} MiB"
            return [cut, Stop(f"over budget: a step peaked at {peak}, budget {budget / MiB:.0f} MiB")]
        return [cut]

    def state_dict(self) -> dict[str, Any]:
        return self.governor.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue the governor of a resumed run: rank 0's, which the checkpoint holds; the others start afresh."""
        if state and self.rank0:
            self.governor.load_state_dict(state)

    def summary(self) -> dict[str, Any]:
        """The memory part of summary.json: budget, fit, predicted and measured peak, adaptations, heap releases."""
        return {**self.governor.summary(self.trainer.micro_batch), "heap_releases": self.releases}


def _kept_fits(trainer: Trainer) -> tuple[TunedChoices, str] | None:
    """The store of settled points for this GPU and torch, and this run's key in it; None off a GPU."""
    if trainer.device.type != "cuda":
        return None
    config, train = trainer.config, trainer.config.training
    shape = {
        "model": schema.to_dict(config.model),
        "data": schema.to_dict(config.data),
        "dtype": str(trainer.dtype),
        "compile": train.compile,
        "global_batch": train.global_batch_size,
        "local_batch": trainer.local_batch,
        **({"unit": trainer.cut.unit} if trainer.cut.width else {}),  # points in tokens are not those in samples
    }
    key = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:32]
    name = torch.cuda.get_device_name(trainer.device)
    return TunedChoices(store_path("memory-fit", name, f"torch{torch.__version__}")), key
