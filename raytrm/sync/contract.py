"""The sync contract: the collectives a data-parallel worker is handed, the one-worker case, and what a sync mode
needs of the worker it serves.

The Trainer never imports Ray or calls torch.distributed itself: it is handed a `GradientSync` (the collectives:
sum gradients, gather the puzzle embedding's sparse rows, sum metrics, move carry slots) and builds its sync
strategy (raytrm.sync.strategy) over it. `LocalSync` is the one-process case (every call returns its input);
`raytrm.sync.process_group.ProcessGroupSync` is the same contract over a torch.distributed group.

Every worker divides its loss by the whole global batch's count (the task's rule), so worker i's gradient is already
(b_i / B) g_i and the exact global gradient is a plain sum: no weights to get wrong, whatever the shares.

The sync modes ask two more things of it: the gradient sum compressed to bf16 with error
feedback (`set_compression`, each worker's residual in `compression_state`), and the sum of any tensors, started
now and awaited later (`sum_tensors`), which carries a local round's parameter deltas and times the link.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch


class OverlappedAllReduce(Protocol):
    """The gradient all-reduce started during the backward of a step's last micro-batch.

    Round by round: `start`, `arm` before the last micro-batch, then `finish` and `commit` (every rank's step
    succeeded), or `abandon` (this rank failed part-way: match the peers' collectives, keep nothing).
    """

    #: Bytes of gradient that started while the backward still computed others, in the latest round; and all of them.
    overlapped_bytes: int
    total_bytes: int

    def start(self) -> None: ...
    def arm(self) -> None: ...
    def finish(self) -> float: ...
    def abandon(self) -> None: ...
    def commit(self) -> None: ...
    def close(self) -> None: ...


class PendingSum(Protocol):
    """A sum of tensors over the workers, in flight: `wait` returns the seconds it waited, the tensors hold the sum."""

    def wait(self) -> float: ...


class GradientSync(Protocol):
    """What the Trainer needs from its peers; every method is a collective that every rank calls in the same order."""

    rank: int
    world_size: int

    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> float: ...
    def overlapped(self, params: Sequence[torch.nn.Parameter]) -> OverlappedAllReduce | None: ...
    def gather_rows(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def sum_floats(self, values: Sequence[float]) -> list[float]: ...
    def gather_floats(self, values: Sequence[float]) -> list[list[float]]: ...
    def gather_objects(self, obj: Any) -> list[Any]: ...
    def gather_slots(self, local: torch.Tensor, part: slice, total: int) -> torch.Tensor: ...
    def any(self, flag: bool) -> bool: ...
    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...
    def sum_tensors(self, tensors: Sequence[torch.Tensor]) -> PendingSum: ...
    def set_compression(self, on: bool) -> None: ...
    def compression_state(self) -> torch.Tensor | None: ...
    def load_compression_state(self, residual: torch.Tensor | None) -> None: ...


class Done:
    """A sum that needed no exchange."""

    def wait(self) -> float:
        return 0.0


class LocalSync:
    """One worker: nothing to exchange."""

    rank, world_size = 0, 1

    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> float:
        return 0.0

    def overlapped(self, params: Sequence[torch.nn.Parameter]) -> None:
        return None

    def gather_rows(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ids, grads

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        return list(values)

    def gather_floats(self, values: Sequence[float]) -> list[list[float]]:
        return [list(values)]

    def gather_objects(self, obj: Any) -> list[Any]:
        return [obj]

    def gather_slots(self, local: torch.Tensor, part: slice, total: int) -> torch.Tensor:
        return local

    def any(self, flag: bool) -> bool:
        return flag

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def sum_tensors(self, tensors: Sequence[torch.Tensor]) -> Done:
        return Done()

    def set_compression(self, on: bool) -> None:
        pass

    def compression_state(self) -> None:
        return None

    def load_compression_state(self, residual: torch.Tensor | None) -> None:
        pass


class Averaged(Protocol):
    """The EMA of the weights, as a local round updates it: folded in once per inner step a landed update covers."""

    def fold(self, named: Iterable[tuple[str, torch.Tensor]], steps: int) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Replica(Protocol):
    """What a sync mode needs of the worker it serves (the Trainer is one): its model and optimizers, its share of
    the global batch, and the device its tensors live on."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    #: SignSGD of the puzzle embedding's rows (its `embeddings` and its row exchange, `gather`), or None.
    sparse_optimizer: Any
    ema: Averaged | None
    device: torch.device
    global_batch: int
    step: int

    @property
    def local_batch(self) -> int: ...
