"""SignSGD for sparse embedding tables (TRM's puzzle embedding), beside the table it trains, as the TRM reference
keeps its CastedSparseEmbeddingSignSGD beside its sparse embedding: only the rows seen since the last step move."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch


def evaluate_closure(closure: Callable[[], float] | None) -> float | None:
    """The optimizer protocol's closure: re-evaluate the loss with gradients on, when one is given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class SparseTable(Protocol):
    """What SignSGD needs of a sparse embedding (raytrm.models.layers.SparseEmbedding)."""

    weight: torch.Tensor

    def sparse_grad(self) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def clear_grad(self) -> None: ...


Gather = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def sparse_signsgd_(
    table: torch.Tensor, ids: torch.Tensor, grads: torch.Tensor, lr: float, weight_decay: float
) -> None:
    """table[r] = table[r] * (1 - lr * wd) - lr * sign(sum of the grads of r), for each distinct id r in ids.

    Every tensor here has ids' length, so on a GPU the host never waits for the device (torch.unique would: the
    number of distinct ids is data). The ids are sorted (stably: each row's grads are summed in their given order,
    as unique's inverse would sum them), each run of one id is a group, and every entry of a group computes its
    row's new value; a repeated id writes the same value more than once.
    """
    order = ids.argsort(stable=True)
    sorted_ids = ids[order]
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    torch.ne(sorted_ids[1:], sorted_ids[:-1], out=starts[1:])
    group = starts.cumsum(0) - 1
    summed = torch.zeros_like(grads).index_add_(0, group, grads[order])
    rows = table[sorted_ids]
    rows.mul_(1 - lr * weight_decay).add_(summed[group].sign(), alpha=-lr)
    table[sorted_ids] = rows.to(table.dtype)


class SignSGD(torch.optim.Optimizer):
    """SignSGD with decoupled weight decay for sparse embedding tables: only the rows seen since the last step move.

    Gradients of a row repeated in the batch (or over accumulated micro-batches) are summed before the sign, so
    accumulation gives the same update as one big batch. `step` consumes the gathered rows (they belong to the
    forwards of this step); `gather`, if given, combines (ids, grads) across workers before the update, e.g. an
    all-gather, as the reference does.
    """

    def __init__(
        self,
        embeddings: SparseTable | Iterable[SparseTable],
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        gather: Gather | None = None,
    ) -> None:
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"invalid lr {lr} or weight_decay {weight_decay}: expected >= 0")
        self.embeddings: list[SparseTable] = (
            [embeddings] if hasattr(embeddings, "sparse_grad") else list(embeddings)  # type: ignore[arg-type]
        )
        self.gather = gather
        groups = [{"params": [e.weight]} for e in self.embeddings]
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.param_groups:
            group["lr"] = value

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = evaluate_closure(closure)
        for group, embedding in zip(self.param_groups, self.embeddings, strict=True):
            seen = embedding.sparse_grad()
            embedding.clear_grad()
            if self.gather is not None:  # a collective: called by every worker, even one that saw no row
                empty = (
                    embedding.weight.new_empty(0, dtype=torch.long),
                    embedding.weight.new_empty(0, embedding.weight.shape[1]),
                )
                seen = self.gather(*(seen or empty))
            if seen is None or seen[0].numel() == 0:
                continue
            ids, grads = seen
            sparse_signsgd_(embedding.weight, ids, grads, group["lr"], group["weight_decay"])
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for embedding in self.embeddings:
            embedding.clear_grad()
