"""Local rounds, the `local` sync mode (DiLoCo-style): each worker takes H inner steps alone on its own samples, then
the workers average their parameter deltas, weighted by samples, and an outer optimizer applies the average.

A round starts from the synchronized parameters g. Worker i takes k inner steps on its share (stepping alone: its
own samples' mean gradient, its own optimizer), reaching x_i; its delta is (n_i / N) (g - x_i),
with n_i the samples it trained in the round and N = k B all of them, so one sum over the workers gives the
sample-weighted mean delta d. The outer optimizer is SGD with Nesterov momentum m on g: v = m v + d,
g -= lr (d + m v) (plain averaging at lr 1, m 0), and every worker continues from the new g. With inner SGD, H = 1,
outer lr 1 and m = 0 this is the exact sync's step: the sum over i of (b_i / B) lr g_i is lr times the global mean.

Overlap (`overlap` = t > 0): the deltas' sum travels while the workers take the next t inner steps on from x_i; when
it lands, each worker keeps the progress of those steps on top of the new g (x = g' + x - x_i). The next round counts
its H steps from the exchange, so a round's delta covers every step since the last one.

The puzzle embedding's rows (TRM's sparse table, trained by SignSGD) move only on the worker that saw them; at the
round's end each touched row becomes its value at the round's start plus the mean delta of the workers that moved it.
The EMA follows the synchronized parameters: each landed update is folded in once per inner step it covers.

`state_dict` holds g, the momentum and the round's counts, and each worker's own parameters, inner optimizer and
rows (a collective); `load_state_dict` gives each worker its own back, or, on another number of workers, drops the
round in flight (its deltas) and starts every worker from g.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from raytrm.hardware import device as devices
from raytrm.sync.contract import Done, GradientSync, PendingSum, Replica
from raytrm.sync.mode import Mode, Reduced, Scalar, register

logger = logging.getLogger(__name__)


def on_cpu(obj: Any) -> Any:
    """A nest of dicts, lists and tuples with every tensor copied to the CPU (what travels to rank 0's checkpoint)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(devices.CPU, copy=True)
    if isinstance(obj, dict):
        return {k: on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_cpu(v) for v in obj)
    return obj


@register
class Local(Mode):
    """The local mode's rounds on one worker (see the module docstring); every rank builds one at the same step."""

    name = "local"
    steps_alone = True

    def __init__(
        self,
        replica: Replica,
        sync: GradientSync,
        every: int,
        *,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        overlap: int = 0,
    ) -> None:
        super().__init__(replica, sync)
        self.configure(every, overlap)
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.names = [n for n, p in replica.model.named_parameters() if p.requires_grad]
        self.params = [p for p in replica.model.parameters() if p.requires_grad]
        with torch.no_grad():
            self.globals = [p.detach().clone() for p in self.params]
        self.deltas = [torch.zeros_like(p) for p in self.params]
        self.momentum: list[torch.Tensor] | None = None
        self.steps = 0  # inner steps in the round so far
        self.samples = 0  # this worker's samples in the round so far
        self.owed = 0  # inner steps since the last landed update: the EMA folds it in that many times
        self._in_flight: PendingSum | None = None
        self._left = 0  # inner steps until the sum in flight is awaited
        self._sent: list[torch.Tensor] | None = None  # this worker's parameters when the deltas left
        optimizer = replica.sparse_optimizer
        self.rows = RoundRows(optimizer, self.sync) if optimizer is not None else None

    def configure(self, every: int, overlap: int) -> None:
        """Rounds of `every` inner steps, the exchange travelling behind `overlap` of them (from the next round)."""
        if every < 1 or not 0 <= overlap < max(every, 1):
            raise ValueError(f"rounds of {every} steps with an overlap of {overlap}: expected 0 <= overlap < every")
        self.every, self.overlap = every, overlap

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def boundary(self) -> bool:
        return self.steps == 0

    def reduce(self, loss: Scalar, totals: dict[str, Scalar]) -> Reduced:
        """This worker's own sums; its gradient scaled to its own samples' mean (the task divided by the global
        batch's count, so the accumulated gradient is b_i / B of that mean)."""
        replica = self.replica
        if self.sync.world_size == 1:
            return super().reduce(loss, totals)
        for p in replica.model.parameters():
            if p.grad is not None:
                p.grad.mul_(replica.global_batch / replica.local_batch)
        return Reduced(loss, totals, replica.local_batch)

    def after_step(self) -> float:
        """Count the inner step just taken; land the update in flight when due, close the round when due. Returns
        the seconds spent on the exchange."""
        self.steps += 1
        self.samples += self.replica.local_batch
        self.owed += 1
        waited = 0.0
        if self._in_flight is not None:
            self._left -= 1
            if self._left <= 0:
                waited += self._land()
        if self.steps >= self.every:
            waited += self.end_round(wait=False)
        return waited

    def end_round(self, wait: bool = True) -> float:
        """End the round: start summing the weighted deltas (and exchange the rows); the update lands now, or after
        `overlap` more steps unless `wait`. Returns the seconds spent."""
        waited = self._land() if self._in_flight is not None else 0.0
        if self.steps == 0:
            return waited
        weight = self.samples / (self.steps * self.replica.global_batch)
        with torch.no_grad():
            for d, g, p in zip(self.deltas, self.globals, self.params, strict=True):
                d.copy_(g).sub_(p).mul_(weight)
        begin = time.perf_counter()
        pending = self.sync.sum_tensors(self.deltas)
        if self.rows is not None:
            self.rows.exchange()
        waited += time.perf_counter() - begin
        self.steps = self.samples = 0
        self._in_flight = pending
        if self.overlap and not wait:
            self._left = self.overlap
            self._sent = [p.detach().clone() for p in self.params]
            return waited
        return waited + self._land()

    def _land(self) -> float:
        """Await the deltas' sum, take the outer step on g and move this worker onto it (keeping the steps taken since
        the deltas left), then fold the EMA; returns the seconds waited."""
        assert self._in_flight is not None
        waited = self._in_flight.wait()
        self._in_flight = None
        self._outer_step()
        with torch.no_grad():
            if self._sent is None:
                for p, g in zip(self.params, self.globals, strict=True):
                    p.copy_(g)
            else:
                for p, g, sent in zip(self.params, self.globals, self._sent, strict=True):
                    p.add_(g - sent)
        self._sent = None
        if self.replica.ema is not None and self.owed:
            self.replica.ema.fold(zip(self.names, self.globals, strict=True), self.owed)
        self.owed = 0
        return waited

    def _outer_step(self) -> None:
        """g -= lr (d + m v) with v = m v + d: SGD with Nesterov momentum on the mean delta (m = 0: plain)."""
        m = self.outer_momentum
        with torch.no_grad():
            if m:
                if self.momentum is None:
                    self.momentum = [torch.zeros_like(d) for d in self.deltas]
                for v, d in zip(self.momentum, self.deltas, strict=True):
                    v.mul_(m).add_(d)
                    d.add_(v, alpha=m)
            for g, d in zip(self.globals, self.deltas, strict=True):
                g.sub_(d, alpha=self.outer_lr)

    def leave(self) -> float:
        """Leave the local mode: land everything, then average the workers' inner optimizer states, so the exact
        steps that follow move every worker alike. Returns the seconds spent."""
        waited = self.end_round(wait=True)
        state = self.replica.optimizer.state
        moments = [v for p in self.params for v in state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0]
        if moments:
            waited += self.sync.sum_tensors(moments).wait()
            with torch.no_grad():
                for v in moments:
                    v.div_(self.sync.world_size)
        if self.rows is not None:
            self.rows.close()
        return waited

    # -- checkpoints -------------------------------------------------------------------------------------------------

    def state_dict(self, with_ema: bool = False) -> dict[str, Any]:
        """g, the momentum, the counts and the update in flight; every worker's parameters, inner optimizer and
        rows (a collective: every rank calls it at the same step); with_ema, the EMA too (the Trainer's own state
        is taken after a landing that folds it)."""
        if self._in_flight is not None:  # wait now (the same sum): it lands when due, as it would have
            self._in_flight.wait()
            self._in_flight = Done()
        mine = {
            "params": [p.detach() for p in self.params],
            "sent": self._sent,
            "optimizer": self.replica.optimizer.state_dict(),
            "samples": self.samples,
            "rows": self.rows.state_dict() if self.rows is not None else None,
        }
        shared = {
            "every": self.every,
            "overlap": self.overlap,
            "globals": self.globals,
            "momentum": self.momentum,
            "steps": self.steps,
            "owed": self.owed,
            "pending": self.deltas if self._in_flight is not None else None,
            "left": self._left,
            "ema": self.replica.ema.state_dict() if with_ema and self.replica.ema is not None else None,
        }
        return {**on_cpu(shared), "workers": self.sync.gather_objects(on_cpu(mine))}

    def load_state_dict(self, state: dict[str, Any] | None, landed: bool = False) -> None:
        """Continue saved rounds (after the Trainer loaded rank 0's model and optimizer). landed: the run landed this
        round at its end, after saving it, so on another number of workers its model (the Trainer's) goes on."""
        if state is None:
            return
        device = self.params[0].device
        workers = state["workers"]
        same = len(workers) == self.sync.world_size
        with torch.no_grad():
            if state["momentum"] is not None:
                self.momentum = [v.to(device) for v in state["momentum"]]
            if landed and not same:
                for g, p in zip(self.globals, self.params, strict=True):
                    g.copy_(p)
                return
            for g, saved in zip(self.globals, state["globals"], strict=True):
                g.copy_(saved)
            if state["pending"] is not None:
                for d, saved in zip(self.deltas, state["pending"], strict=True):
                    d.copy_(saved)
        self.owed = int(state["owed"])
        if state.get("ema") is not None and self.replica.ema is not None:
            self.replica.ema.load_state_dict(state["ema"])
        if self.rows is not None:
            self.rows.load_state_dict([w["rows"] for w in workers], self.sync.rank if same else None)
        if same:
            mine = workers[self.sync.rank]
            with torch.no_grad():
                for p, saved in zip(self.params, mine["params"], strict=True):
                    p.copy_(saved)
            self.replica.optimizer.load_state_dict(mine["optimizer"])
            self.steps, self.samples = int(state["steps"]), int(mine["samples"])
            if state["pending"] is not None:
                self._in_flight, self._left = Done(), int(state["left"])
                self._sent = [s.to(device) for s in mine["sent"]] if mine["sent"] is not None else None
            return
        # Another number of workers: a complete sum still lands; the partial round's deltas are dropped.
        if state["pending"] is not None:
            self._in_flight = Done()
            self._land()
        with torch.no_grad():
            for p, g in zip(self.params, self.globals, strict=True):
                p.copy_(g)
        if state["steps"]:
            logger.warning(
                "resumed on %d workers where %d saved the run: the %d inner steps of the round in progress are "
                "dropped; every worker continues from the last synchronized parameters",
                self.sync.world_size,
                len(workers),
                state["steps"],
            )


class RoundRows:
    """The rows of the sparse tables (SignSGD's) a worker moves in a round, with their values at the round's start.

    It takes the optimizer's `gather` (the per-step exchange of exact sync) for the round: the rows a step touches
    are recorded, and moved by this worker alone.
    """

    def __init__(self, optimizer: Any, sync: GradientSync) -> None:
        self.optimizer, self.sync = optimizer, sync
        self.tables = [e.weight for e in optimizer.embeddings]
        self.touched = [torch.zeros(t.shape[0], dtype=torch.bool, device=t.device) for t in self.tables]
        self.ids: list[list[torch.Tensor]] = [[] for _ in self.tables]
        self.base: list[list[torch.Tensor]] = [[] for _ in self.tables]
        self._calls = 0
        self._gather = optimizer.gather
        optimizer.gather = self._record

    def _record(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """SignSGD's gather for each table in turn: note the rows first touched this round, with their values."""
        k = self._calls % len(self.tables)
        self._calls += 1
        new = ids.unique()
        new = new[~self.touched[k][new]]
        if new.numel():
            self.touched[k][new] = True
            self.ids[k].append(new)
            self.base[k].append(self.tables[k][new].clone())
        return ids, grads

    def _rows(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.tables[k]
        if not self.ids[k]:
            return table.new_zeros(0, dtype=torch.long), table.new_zeros(0, table.shape[1])
        return torch.cat(self.ids[k]), torch.cat(self.base[k])

    @torch.no_grad()
    def exchange(self) -> None:
        """Every touched row of every worker becomes its round-start value plus the mean of its workers' deltas (a
        collective; the tables end equal on every worker)."""
        for k, table in enumerate(self.tables):
            ids, base = self._rows(k)
            delta = table[ids].float() - base.float()
            every_id, every_delta = self.sync.gather_rows(ids, delta)
            table[ids] = base
            if every_id.numel():
                uniq, inverse = every_id.unique(return_inverse=True)
                summed = torch.zeros(len(uniq), table.shape[1], device=table.device).index_add_(0, inverse, every_delta)
                count = torch.zeros(len(uniq), device=table.device).index_add_(
                    0, inverse, torch.ones_like(inverse, dtype=torch.float32)
                )
                table[uniq] = (table[uniq].float() + summed / count[:, None]).to(table.dtype)
            self.touched[k][ids] = False
            self.ids[k], self.base[k] = [], []

    def close(self) -> None:
        """Give the optimizer its per-step exchange back."""
        self.optimizer.gather = self._gather

    def state_dict(self) -> list[dict[str, torch.Tensor]]:
        return [
            {"ids": ids, "base": base, "now": self.tables[k][ids]}
            for k, (ids, base) in enumerate(self._rows(k) for k in range(len(self.tables)))
        ]

    @torch.no_grad()
    def load_state_dict(self, saved: list[list[dict[str, torch.Tensor]]], rank: int | None) -> None:
        """Every worker's touched rows back to their round-start values (the loaded table is rank 0's), then, with
        `rank`, this worker's own rows and their record."""
        for k, table in enumerate(self.tables):
            for worker in saved:
                table[worker[k]["ids"].to(table.device)] = worker[k]["base"].to(table.device, table.dtype)
            self.touched[k].zero_()
            self.ids[k], self.base[k] = [], []
            if rank is None:
                continue
            own = saved[rank][k]
            ids = own["ids"].to(table.device)
            if ids.numel():
                table[ids] = own["now"].to(table.device, table.dtype)
                self.touched[k][ids] = True
                self.ids[k], self.base[k] = [ids], [own["base"].to(table.device, table.dtype)]
