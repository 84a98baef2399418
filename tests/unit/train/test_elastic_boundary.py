"""The members' look at a boundary of an elastic run (raytrm.train.elastic.Elastic.boundary): the deadline a measured
step implies is set on the live groups with no new membership; a join request forms the next membership."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from raytrm.sync.membership import deadline_s
from raytrm.train.elastic import TIMED_LOOKS, Elastic


class Store:
    """The membership's side that rank 0 reads: join requests waiting, and the deadline it publishes."""

    def __init__(self, joins: int = 0) -> None:
        self.deadline, self.joins, self.published = 60.0, joins, []

    def pending_joins(self) -> int:
        return self.joins

    def publish_deadline(self, seconds: float) -> None:
        self.published.append(seconds)


class Sync:
    """A member's collectives: `others` is what the other members add to its sum (rank 0's news, on another rank)."""

    def __init__(self, rank: int = 0, others: tuple[float, float] = (0.0, 0.0)) -> None:
        self.rank, self.others, self.timeouts = rank, others, []

    def sum_floats(self, values):
        return [v + o for v, o in zip(values, self.others, strict=True)]

    def set_timeout(self, seconds: float) -> None:
        self.timeouts.append(seconds)


def _loop(sync: Sync, step: int = 10, compute_s: float = 2.0) -> SimpleNamespace:
    strategy = SimpleNamespace(link=None, model_bytes=0, overlap=0)
    result = SimpleNamespace(sync_seconds=0.5, compute_seconds=compute_s)
    return SimpleNamespace(
        trainer=SimpleNamespace(sync=sync, strategy=strategy, step=step), last_step=SimpleNamespace(result=result)
    )


def _elastic(store: Store) -> tuple[Elastic, list[int]]:
    elastic, recovered = Elastic(store), []
    elastic.recover = lambda loop: recovered.append(loop.trainer.step) or [{"event": "membership"}]
    return elastic, recovered


def test_a_measured_deadline_is_set_on_the_live_groups_with_no_new_membership():
    store, sync = Store(), Sync()
    elastic, recovered = _elastic(store)
    loop = _loop(sync)
    measured = deadline_s(0.5, 2.0)
    assert elastic.boundary(loop) == [{"event": "deadline", "step": 10, "deadline_s": measured, "from_s": 60.0}]
    assert sync.timeouts == [measured] and store.deadline == measured and store.published == [measured]
    assert recovered == []  # the same workers go on
    assert elastic.boundary(loop) == [] and sync.timeouts == [measured]  # the same step again: nothing far from it


def test_the_first_steps_loose_deadline_is_taken_then_a_steady_steps_then_no_other():
    store, sync = Store(), Sync()
    elastic, _ = _elastic(store)
    first, steady = deadline_s(0.5, 6.0), deadline_s(0.5, 2.0)  # the first step's one-time costs: 6 s of compute
    assert elastic.boundary(_loop(sync, step=1, compute_s=6.0)) == [
        {"event": "deadline", "step": 1, "deadline_s": first, "from_s": 60.0}
    ]
    assert elastic.boundary(_loop(sync, step=10)) == [
        {"event": "deadline", "step": 10, "deadline_s": steady, "from_s": first}
    ]
    # Two looks timed it: a later step, however far from it, leaves it (a slow moment would not shrink or grow it).
    assert elastic.boundary(_loop(sync, step=20, compute_s=20.0)) == []
    assert sync.timeouts == [first, steady] and store.published == [first, steady]


def test_after_a_membership_the_deadline_in_force_stays():
    store, sync = Store(), Sync()
    elastic, _ = _elastic(store)
    elastic.timed = TIMED_LOOKS  # as `recover` leaves it
    assert elastic.boundary(_loop(sync, step=1, compute_s=6.0)) == [] and sync.timeouts == []


def test_another_member_takes_rank_0s_deadline_and_logs_nothing():
    store, sync = Store(), Sync(rank=1, others=(0.0, 7.5))
    elastic, recovered = _elastic(store)
    assert elastic.boundary(_loop(sync)) == []
    assert sync.timeouts == [7.5] and store.deadline == 7.5 and store.published == [] and recovered == []


@pytest.mark.parametrize("rank", [0, 1])
def test_a_join_request_forms_the_next_membership_on_every_member(rank):
    store = Store(joins=1 if rank == 0 else 0)
    sync = Sync(rank=rank, others=(0.0, 0.0) if rank == 0 else (1.0, 0.0))
    elastic, recovered = _elastic(store)
    elastic.timed = TIMED_LOOKS  # the deadline was set already
    assert elastic.boundary(_loop(sync)) == [{"event": "membership"}]
    assert recovered == [10] and sync.timeouts == []
