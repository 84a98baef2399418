"""A run whose workers come and go: the loop's side of raytrm.sync.membership.

At every boundary where the members look (`boundary`), rank 0 reads the join requests and, at the first two looks,
the collectives' deadline the latest step implies: the grace times a step's sum and compute (the sum: the model's
over the measured link and the steps a round's sum travels behind, where longer than the step's own). A fresh run's
first look follows its first step, whose one-time costs make its deadline loose but far shorter than the one the
run started with; the next, past ADMIT_EVERY steps, reads a steady step. A new deadline, far from the one in force,
is set on the live groups: the same workers go on, with no new membership.

When a collective of a step fails because a peer missed its deadline or left (`lost`), or when the members agree at
a boundary that a worker waits to join, the loop calls `recover`, which:

1. forms the next membership (`Membership.regroup`; a worker the others left behind joins again, `join`);
2. has the sync read its rank and its group's size again (`regrouped`);
3. gives every member the state of the member furthest along (the model or what trains of it, the optimizers, the
   EMA, the step, the samples seen, the RNG states): a newcomer, a worker back from sleep and a worker whose last
   collective failed where the others' completed all continue from the same weights, taken from a live peer. The
   state is several times the gradient's bytes: its transfer gets the deadline once for each gradient's worth per
   member, not one deadline, which on a slow link it would miss at every membership;
4. splits the global batch over the new set by each member's own pace (its seconds per sample over its latest
   steps; a newcomer counts as the mean of the others), which the peers' balancer refits from their next steps, and
   starts every slot's carry afresh (TRM's halting state of the slots a lost worker held left with it);
5. builds the sync strategy anew over the new set, so the mode is chosen again for it (`auto`), and tells the hooks
   (`on_regroup`: per-worker state such as the peers' rows is made again).

It returns the `membership` event (rank 0's): the step, the epoch, its members, who left and who entered, the seconds
waited before the change (since the last step's end: the step that failed and its collective's deadline) and the
seconds the change took, which the metrics log shows. A new deadline is a `deadline` event.
"""

from __future__ import annotations

import logging
import math
import pickle
import time
from collections.abc import Callable
from typing import Any, TypeVar

from raytrm.sync.membership import Dropped, Membership, PeerLost, deadline_s, is_peer_lost
from raytrm.sync.shares import by_pace, shard
from raytrm.sync.strategy import SyncStrategy
from raytrm.train import trainer_state

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The looks at which rank 0 takes the collectives' deadline from the latest step: after the first step, and past
#: ADMIT_EVERY steps (raytrm.train.loop).
TIMED_LOOKS = 2


class Elastic:
    """The loop's `regroup` (raytrm.train.loop.Regroup) for a Trainer whose sync follows `membership`'s groups."""

    def __init__(self, membership: Membership, *, clock: Any = time.monotonic) -> None:
        self.membership, self.clock = membership, clock
        #: Every change of the run's workers this worker saw (the `membership` events, every rank's).
        self.changes: list[dict[str, Any]] = []
        #: Looks at which rank 0 took the deadline from the latest step (TIMED_LOOKS at most; a membership ends them).
        self.timed = 0

    def enter(self, trainer: Any, sync_factory: Any) -> None:
        """A worker that was not in the run (new, or started again after it left): ask to join, wait until the
        members admit it at a boundary, then take the furthest member's state. The Trainer is built before, alone
        (`sync_factory` makes its sync once the group exists), so the members wait for no model to be built."""
        view = self.membership.join()
        trainer.sync = sync_factory()
        self._take_furthest_state(trainer, newcomer=True)
        trainer.strategy = _strategy(trainer)
        self.changes.append(
            {"event": "membership", "step": trainer.step, "epoch": view.epoch, "entered": [self.membership.me]}
        )

    def alone(self, tag: str, work: Callable[[], T] | None) -> T | None:
        """Work rank 0 does alone (an evaluation): rank 0 (`work` given) does it, then lets the others go on; the
        others (`work` None) hold for it, since a collective's deadline would take rank 0 for lost meanwhile.
        Every member calls this at the same point with the same tag."""
        if work is None:
            self.membership.hold(tag)
            return None
        result = work()
        self.membership.release(tag)
        return result

    def lost(self, error: BaseException) -> bool:
        return isinstance(error, PeerLost) or is_peer_lost(error)

    def boundary(self, loop: Any) -> list[dict[str, Any]]:
        """At a boundary where the members look (every member at the same step): rank 0 reads the join requests and,
        until the deadline is set from a measured step, the deadline the latest step implies; one sum tells every
        member. A new deadline is taken on the live groups (the same workers go on, no new membership); a join
        request forms the next membership. Returns the events to log."""
        sync = loop.trainer.sync
        joins, deadline = self._news(loop) if sync.rank == 0 else (0.0, 0.0)
        joins, deadline = sync.sum_floats([joins, deadline])
        events = self._retime(loop, deadline) if deadline > 0 else []
        return events + self.recover(loop) if joins > 0 else events

    def _news(self, loop: Any) -> tuple[float, float]:
        """Rank 0's: the join requests waiting, and a new deadline (0: none), published for the epochs to come."""
        joins, deadline = float(self.membership.pending_joins()), 0.0
        if self.timed < TIMED_LOOKS and loop.last_step is not None:
            self.timed += 1
            measured = deadline_s(self._sum_seconds(loop), loop.last_step.result.compute_seconds)
            if abs(measured - self.membership.deadline) > 0.5 * self.membership.deadline:
                self.membership.publish_deadline(measured)
                deadline = measured
        return joins, deadline

    def _retime(self, loop: Any, seconds: float) -> list[dict[str, Any]]:
        """Every collective of the live groups bounded by the new deadline from now on; the event (rank 0's)."""
        before, self.membership.deadline = self.membership.deadline, seconds
        trainer = loop.trainer
        trainer.sync.set_timeout(seconds)
        if trainer.sync.rank != 0:
            return []
        logger.info(
            "step %d: collectives' deadline %.1f s -> %.1f s, from the measured step", trainer.step, before, seconds
        )
        return [
            {"event": "deadline", "step": trainer.step, "deadline_s": round(seconds, 3), "from_s": round(before, 3)}
        ]

    @staticmethod
    def _sum_seconds(loop: Any) -> float:
        """What the run's slowest sum may take from its start: the last step's sync, or, where the run measured its
        link, the model's sum over it and the steps a round's sum travels behind (a local round's inner step sums
        nothing, yet the round's sum of deltas is bounded by the same deadline)."""
        result, strategy = loop.last_step.result, loop.trainer.strategy
        if strategy.link is None:
            return result.sync_seconds
        behind = strategy.overlap * result.compute_seconds
        return max(result.sync_seconds, strategy.link.seconds(strategy.model_bytes) + behind)

    def recover(self, loop: Any) -> list[dict[str, Any]]:
        """The next membership, the furthest member's state on every member, the work split over the new set."""
        begin = self.clock()
        waited = loop.now() - loop.step_end  # since the last step's end: the failed collective's wait, and the step
        trainer, came_back = loop.trainer, False
        while True:
            try:
                try:
                    view = self.membership.regroup()
                except Dropped:
                    came_back = True
                    view = self.membership.join()
                trainer.sync.regrouped()
                formed = self.clock()
                self._take_furthest_state(trainer, newcomer=came_back)
                break
            except Exception as error:  # the new set lost a member too: the next one
                if not self.lost(error):
                    raise
                logger.warning("the membership forming at step %d failed (%s): forming the next", trainer.step, error)
        state_taken = self.clock()
        self._restart_sync(loop)
        self.timed = TIMED_LOOKS
        event = {
            "event": "membership",
            "step": trainer.step,
            "epoch": view.epoch,
            "workers": list(view.members),
            "left": list(view.left),
            "entered": list(view.admitted),
            "waited_s": round(waited, 3),
            "deadline_s": self.membership.deadline,
            "seconds": round(self.clock() - begin, 3),
            # the change's parts: forming the membership, taking the state, the sync strategy anew
            "parts_s": [round(formed - begin, 3), round(state_taken - formed, 3), round(self.clock() - state_taken, 3)],
        }
        self.changes.append(event)
        if trainer.sync.rank == 0:
            moves = (("left", view.left), ("entered", view.admitted))
            why = "; ".join(f"{what}: {', '.join(names)}" for what, names in moves if names)
            if not why:
                why = "the same workers, after a collective failed"
            log = logger.warning if view.left or view.admitted else logger.info
            log("workers: %s at step %d (%s), %.1f s", ", ".join(view.members), trainer.step, why, event["seconds"])
        return [event] if trainer.sync.rank == 0 else []

    def _take_furthest_state(self, trainer: Any, newcomer: bool) -> None:
        """Every member takes the state of the one with the most steps done (collectives of the new group)."""
        sync = trainer.sync
        source, _ = self.membership.source(-1 if newcomer else trainer.step)
        blob = pickle.dumps(trainer_state.capture(trainer, gathered=False)) if sync.rank == source else None
        nbytes = sync.broadcast_object(len(blob) if blob is not None else None, src=source)
        gradient = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
        with self.membership.allowing(self.membership.deadline * sync.world_size * nbytes / max(gradient, 1)):
            blob = sync.broadcast_object(blob, src=source)
        # Each member's own pace (a newcomer has none yet): the shares that would keep them in step, as the peers'
        # balancer would have found them again after a few rounds.
        pace = trainer.pace
        trainer.shares = by_pace(trainer.global_batch, [row[0] for row in sync.gather_floats([pace or math.nan])])
        trainer.shard = shard(trainer.shares, sync.rank)
        trainer.cut.set(trainer.micro_batch, trainer.local_batch)
        if sync.rank == source:  # its own state: only the carry of its slots starts afresh, as everyone's does
            trainer.task.load_carry(None, trainer.device)
            return
        own = [trainer.micro_batch] * sync.world_size  # each member keeps its own cut
        state = pickle.loads(blob)  # a member's own state, from the run's group
        trainer_state.restore(trainer, {**state, "carry": None, "shares": trainer.shares, "micro_batches": own})

    def _restart_sync(self, loop: Any) -> None:
        """The sync strategy built anew over the new set (the mode chosen again in `auto`), the hooks told."""
        trainer = loop.trainer
        trainer.strategy.close()
        trainer.strategy = _strategy(trainer)
        trainer.strategy.start()
        loop.exchanging = trainer.strategy.exchanging
        for hook in loop.hooks:
            hook.on_regroup(loop)


def _strategy(trainer: Any) -> SyncStrategy:
    """The sync strategy over the trainer's sync as it is now, built as the Trainer builds its own."""
    return SyncStrategy(trainer, trainer.sync, trainer.config.training, overlaps=trainer.task.overlaps_sync)
