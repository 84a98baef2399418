"""Exact sync: every step's gradient summed over the workers (invariant 1: the update equals one process's); and
compressed, the same sum in bf16 with each worker's rounding fed back into its next gradient.

Where the task allows it (gradients that finish early in the backward: the transformer), the sum starts during the
backward of the step's last micro-batch (the collectives' `overlapped` all-reduce); otherwise it runs after the
backward, in buckets. A worker whose allocator refuses a micro-batch after some buckets left matches its peers'
collectives (`abandon`) and redoes its samples; the workers learn of it in the metric sum and all sum their
gradients again, so every rank ends the step with the same summed gradient.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from raytrm.sync.contract import GradientSync, OverlappedAllReduce, Replica
from raytrm.sync.mode import Mode, Reduced, Scalar, read_sums, register


@register
class Exact(Mode):
    """The gradient summed every step, exactly."""

    name = "exact"

    def __init__(self, replica: Replica, sync: GradientSync, *, overlaps: bool = False) -> None:
        super().__init__(replica, sync)
        self.overlaps = overlaps  # the task's gradients finish early in the backward: worth summing during it
        self._reducer: OverlappedAllReduce | None = None
        self._started = False  # this step's micro-batches began with the overlapped sum armed
        self._redone = False  # ...and this worker redid them after a refused allocation

    def _reducer_now(self) -> OverlappedAllReduce | None:
        if not self.overlaps or self.sync.world_size == 1:
            return None
        if self._reducer is None:
            self._reducer = self.sync.overlapped(list(self.replica.model.parameters()))
        return self._reducer

    @property
    def reducer(self) -> OverlappedAllReduce | None:
        """The overlapped all-reduce, once a step has made it (None where the sum runs after the backward)."""
        return self._reducer

    @property
    def overlapped(self) -> bool:
        return self._reducer_now() is not None and not self._redone

    def micro_batches(self, parts: Sequence[slice]) -> Iterator[slice]:
        reducer = self._reducer_now()
        if reducer is None:
            yield from parts
            return
        if self._started:  # the same step again: this worker redoes its samples, the buckets it sent are void
            if not self._redone:
                reducer.abandon()
                self._redone = True
            yield from parts
            return
        self._started = True
        reducer.start()
        for i, part in enumerate(parts):
            if i == len(parts) - 1:
                reducer.arm()
            yield part

    def reduce(self, loss: Scalar, totals: dict[str, Scalar]) -> Reduced:
        if self.sync.world_size == 1:  # a group of one: nothing to sum, nothing to read before the optimizer step
            return super().reduce(loss, totals)
        local, local_totals = read_sums(loss, totals, self.replica.device)
        keys = sorted(totals)
        values = [local, *(local_totals[k] for k in keys)]
        params = list(self.replica.model.parameters())
        reducer = self._reducer if self._started else None
        overlap = None
        if reducer is None:
            sync_s = self.sync.all_reduce_gradients(params)
            summed = self.sync.sum_floats(values)
        else:
            sync_s = 0.0 if self._redone else reducer.finish()
            summed = self.sync.sum_floats([*values, float(self._redone)])
            if summed.pop() == 0:
                reducer.commit()
            else:  # some rank redid its samples after sending its buckets: every rank sums its gradient again
                sync_s += self.sync.all_reduce_gradients(params)
            overlap = reducer.overlapped_bytes / reducer.total_bytes
        self._started = self._redone = False
        return Reduced(summed[0], dict(zip(keys, summed[1:], strict=True)), self.replica.global_batch, sync_s, overlap)

    def close(self) -> None:
        if self._reducer is not None:
            self._reducer.close()
            self._reducer = None


@register
class Compressed(Exact):
    """The gradient summed every step in bf16, each worker's rounding kept and added to its next gradient."""

    name = "compressed"

    def enter(self) -> None:
        self.sync.set_compression(True)

    def leave(self) -> float:
        self.sync.set_compression(False)
        return 0.0
