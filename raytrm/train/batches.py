"""A worker's stream of global batches: each a pure function of (seed, step), gathered ahead of the step that uses it.

The stream starts at the Trainer's step (a resumed run continues where it stopped) and is restarted when the step
jumps (a resume into a running Trainer). `prefetch` gathers the next global batch while the device still runs this
step and queues its copy behind this step's work: on CUDA through page-locked memory, so the host does not wait for
the copy and the next step starts on its first kernels; elsewhere the copy stays at the step's start.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from raytrm.data.loader import global_batches
from raytrm.hardware import device as devices


class BatchStream:
    """The global batches of one run; `next` hands the prefetched one first."""

    def __init__(self, data: Any, global_batch: int, seed: int, workers: int, device: torch.device) -> None:
        self.data, self.global_batch, self.seed, self.workers, self.device = data, global_batch, seed, workers, device
        self._batches: Iterator[dict[str, torch.Tensor]] | None = None
        self._prefetched: dict[str, torch.Tensor] | None = None

    def next(self, step: int) -> dict[str, torch.Tensor]:
        """The global batch of `step` (the stream's next: it starts at the step it is first asked for)."""
        if self._prefetched is not None:
            batch, self._prefetched = self._prefetched, None
            return batch
        if self._batches is None:
            self._batches = global_batches(
                self.data.batch, len(self.data), self.global_batch, self.seed, first_step=step, workers=self.workers
            )
        return next(self._batches)

    def prefetch(self, step: int) -> None:
        """Gather the global batch after `step`'s now, its copy to the device queued behind the work in flight."""
        batch = self.next(step + 1)
        if self.device.type == devices.CUDA:
            batch = {k: devices.queued_copy(v, self.device) for k, v in batch.items()}
        self._prefetched = batch

    def restart(self) -> None:
        """Forget the stream (and its loader processes): the next batch asked for starts it anew at its step."""
        self._batches = self._prefetched = None
