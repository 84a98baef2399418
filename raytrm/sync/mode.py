"""A sync mode: how one worker's step joins its peers', in the two places a step meets them.

The Trainer cuts its share of the global batch into micro-batches, runs them through `micro_batches` (where a mode
may start the gradient's sum during the last backward), then hands the loss and metric sums to `reduce`, which
returns them summed over the workers (or, for a worker stepping alone, as its own) with the gradients ready for the
optimizer. After the optimizer step the run's strategy (raytrm.sync.strategy) calls `after_step`, where a mode
that exchanges less often than every step (local rounds) does its exchange; `boundary` says whether the workers may
exchange anything else after this step.

A mode is one class registered under its name (`register`); every mode must keep invariants 2 and 6 (no sample lost
or doubled, resume exact), and a mode that sums every step's gradient also keeps invariant 1 (the update equals one
process's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch

from raytrm.hardware import device as devices
from raytrm.sync.contract import GradientSync, Replica

Scalar = torch.Tensor | float  # a 0-dim tensor on the device, or a number the host already knows


@dataclasses.dataclass
class Reduced:
    """A step's sums after the mode's exchange: the loss and metric sums over `samples` samples (every micro-batch's
    loss is divided by the global batch's count, as the tasks do), what the exchange waited, and the share of the
    gradient's bytes summed while the backward still ran (None: no overlapped sum this step)."""

    loss: Scalar
    totals: dict[str, Scalar]
    samples: int
    sync_seconds: float = 0.0
    overlap: float | None = None


def read_sums(loss: Scalar, totals: dict[str, Scalar], device: torch.device) -> tuple[float, dict[str, float]]:
    """The sums as host floats, with one wait for the device, not one a value."""
    keys = list(totals)
    values = [loss, *totals.values()]
    on_device = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    if on_device:
        # In float64 where the device has it: the loss is summed in float64 there, and the host's floats are.
        stacked = torch.stack([values[i].to(devices.loss_dtype(device)) for i in on_device])
        for i, value in zip(on_device, stacked.tolist(), strict=True):
            values[i] = value
    floats = [float(v) for v in values]
    return floats[0], dict(zip(keys, floats[1:], strict=True))


class Mode:
    """One sync mode on one worker; the base class is a worker alone: nothing to exchange, nothing read."""

    name: ClassVar[str] = "alone"
    #: The worker steps on its own samples (no per-step exchange): its gradient is its own samples' mean, and the EMA
    #: waits for the synchronized parameters.
    steps_alone: ClassVar[bool] = False

    def __init__(self, replica: Replica, sync: GradientSync) -> None:
        self.replica, self.sync = replica, sync

    @property
    def overlapped(self) -> bool:
        """This step's micro-batches start the gradient's sum during their last backward (so they run one by one)."""
        return False

    def micro_batches(self, parts: Sequence[slice]) -> Iterator[slice]:
        """The step's micro-batches, in order; called again for the same step when this worker redoes its samples
        (an allocator refused a micro-batch)."""
        yield from parts

    def reduce(self, loss: Scalar, totals: dict[str, Scalar]) -> Reduced:
        """The step's sums over every worker, the gradients summed in place; alone, the sums as they are (on the
        device, read once after the optimizer step)."""
        return Reduced(loss, totals, self.replica.global_batch)

    def after_step(self) -> float:
        """After the optimizer step: an exchange that is due; returns the seconds it waited."""
        return 0.0

    @property
    def boundary(self) -> bool:
        """The workers may exchange after this step (not inside a local round)."""
        return True

    def enter(self) -> None:
        """The run switches to this mode (every rank at the same step)."""

    def leave(self) -> float:
        """The run leaves this mode: land what it holds; returns the seconds that waited."""
        return 0.0

    def state_dict(self, with_ema: bool = False) -> dict[str, Any] | None:
        """What a resume needs of the mode (a collective where it gathers the workers')."""
        return None

    def load_state_dict(self, state: dict[str, Any] | None, landed: bool = False) -> None:
        """Continue the saved mode (after the worker's own state)."""

    def close(self) -> None:
        """Release what the mode holds on the model (hooks)."""


#: The modes by name (each module registers its own).
REGISTRY: dict[str, type[Mode]] = {}


def register(cls: type[Mode]) -> type[Mode]:
    """Class decorator: make a mode known by its name."""
    REGISTRY[cls.name] = cls
    return cls


register(Mode)
