"""What a worker exchanges with its peers after a step: step times, memory caps, per-worker rows, new shares.

Every rank gathers the same measurements and runs the same deterministic balancer on them, so all ranks reach the
same shares at the same global-batch boundary without a coordinator. Alone (one worker) nothing is exchanged. The
training loop's hook (raytrm.train.run.peers) calls `exchange` after every step, or at a local round's end with the
round's steps.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from typing import Any, Protocol

from raytrm.sync.contract import GradientSync
from raytrm.sync.shares import ShareBalancer

logger = logging.getLogger(__name__)


class Timed(Protocol):
    """A step's times as the Trainer measured them (its StepResult)."""

    seconds: float
    compute_seconds: float
    sync_seconds: float


class Sharing(Protocol):
    """The worker whose shares the peers decide (the Trainer)."""

    sync: GradientSync
    global_batch: int
    shares: list[int]
    step: int
    micro_batch: int
    last_overlap: float

    def set_shares(self, shares: Sequence[int]) -> None: ...


class Peers:
    """A worker's view of the others: rebalancing and the per-worker rows of metrics.jsonl."""

    def __init__(self, trainer: Sharing, balance: bool = True) -> None:
        self.trainer = trainer
        self.sync = trainer.sync
        self.rank0 = self.sync.rank == 0
        self.alone = self.sync.world_size == 1
        self.balancer = (
            ShareBalancer(trainer.global_batch, self.sync.world_size, shares=trainer.shares)
            if balance and not self.alone
            else None
        )
        self.rows: list[dict[str, Any]] = []
        self._warned = False  # caps that cannot hold the global batch are said once

    def exchange(
        self,
        result: Timed,
        cap: int | None = None,
        events: Sequence[dict[str, Any]] = (),
        held: Sequence[Timed] = (),
    ) -> list[dict[str, Any]]:
        """Gather every worker's times and memory cap, rebalance the shares if that pays or a worker holds more than
        its cap; returns the events to log: every worker's own (its memory governor's and thermal guard's `events`,
        each tagged with its rank), then the rebalance. cap: the most samples this worker's memory model lets it
        hold; held: the earlier steps of a local round, whose times are averaged with this one's for the rows (the
        balancer takes their median)."""
        if self.alone:
            return list(events)
        trainer = self.trainer
        shares = list(trainer.shares)
        steps = [*held, result]
        mine = [
            sum(r.compute_seconds for r in steps) / len(steps),
            sum(r.sync_seconds for r in steps) / len(steps),
            trainer.last_overlap,
            max(trainer.cuts),  # samples, whatever the cut counts
            -1 if cap is None else cap,
            sum(r.seconds for r in steps) / len(steps),
            statistics.median(r.compute_seconds for r in steps),  # the balancer's: a slow first step left aside
            len(events),
        ]
        gathered = self.sync.gather_floats(mine)
        counts = [row.pop() for row in gathered]
        medians = [row.pop() for row in gathered]
        logged = []
        if any(counts):  # adaptations are rare: their objects travel only when some worker has one
            for rank, theirs in enumerate(self.sync.gather_objects(list(events))):
                logged += [{**event, "rank": rank} for event in theirs]
        self.rows = [
            {
                "rank": rank,
                "share": share,
                "samples_per_sec": share / max(compute, 1e-9),
                "compute_s": compute,
                "sync_s": sync_s,  # what the sync added to this worker's step (a round's exchange: per step)
                "sync_share": sync_s / step_s if step_s > 0 else 0.0,  # of this worker's step wall time
                "sync_overlap": overlap,  # the fraction of the gradient summed while the backward still ran
                "micro_batch": int(micro),
                "share_cap": int(limit) if limit >= 1 else None,
            }
            for rank, (share, (compute, sync_s, overlap, micro, limit, step_s)) in enumerate(
                zip(shares, gathered, strict=True)
            )
        ]
        if self.balancer is None:
            return logged
        dropped = self.balancer.set_caps([row["share_cap"] for row in self.rows])
        if dropped and self.rank0 and not self._warned:
            logger.warning(
                "step %d: memory caps ignored, the global batch must be held anyway: %s", trainer.step, dropped
            )
            self._warned = True
        self.balancer.observe(trainer.step, medians, steps=len(steps))
        decision = self.balancer.decide(trainer.step)
        if decision is None:
            return logged
        trainer.set_shares(decision.shares_to)
        if self.rank0:
            logger.info("step %d: shares %s -> %s: %s", trainer.step, shares, decision.shares_to, decision.reason)
        return [*logged, decision.to_event()]

    def state_dict(self) -> dict[str, Any] | None:
        return self.balancer.state_dict() if self.balancer is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue the balancer of a resumed run; on another number of workers it starts afresh."""
        if self.balancer is None or not state:
            return
        self.balancer.load_state_dict(state)
        if self.balancer.shares != self.trainer.shares:
            self.trainer.set_shares(self.balancer.shares)

    def summary(self) -> dict[str, Any]:
        """The workers' part of summary.json."""
        if self.alone:
            return {}
        return {
            "workers": self.sync.world_size,
            "shares": list(self.trainer.shares),
            "rebalances": [event.to_event() for event in self.balancer.events] if self.balancer else [],
            "worker_rows": self.rows,
        }
