"""The peers' exchange: every worker's times gathered, and the balancer's shares decided from them, in two threads."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from raytrm.sync.peers import Peers


class ThreadSync:
    """Two workers as threads of one process: a gather is a barrier where each leaves its values."""

    world_size = 2

    def __init__(self, rank: int, slots: list, barrier: threading.Barrier) -> None:
        self.rank, self.slots, self.barrier = rank, slots, barrier

    def _gather(self, value):
        self.slots[self.rank] = value
        self.barrier.wait(timeout=10)
        gathered = list(self.slots)
        self.barrier.wait(timeout=10)  # every worker read before the next gather writes
        return gathered

    def gather_floats(self, values):
        return [list(row) for row in self._gather(list(values))]

    def gather_objects(self, obj):
        return self._gather(obj)


@dataclass
class Worker:
    """What the peers read of a Trainer."""

    sync: ThreadSync
    shares: list
    global_batch: int = 90
    step: int = 0
    micro_batch: int = 45
    last_overlap: float = 0.0

    @property
    def cuts(self):
        return [self.micro_batch]

    def set_shares(self, shares):
        self.shares = list(shares)


@dataclass
class Timed:
    compute_seconds: float
    sync_seconds: float = 0.0

    @property
    def seconds(self):
        return self.compute_seconds + self.sync_seconds


def test_a_local_rounds_slow_first_step_does_not_move_the_shares_it_decides():
    # Worker 1 is twice as slow per sample; worker 0's first step pays a one-time cost (5 s, a compilation). At the
    # first round's end (5 steps) the balancer takes each worker's median step: 2:1, so 60/30. The rows keep the mean.
    barrier, slots = threading.Barrier(2), [None, None]
    workers = [Worker(ThreadSync(rank, slots, barrier), [45, 45], step=5) for rank in range(2)]
    rounds = [[5.0, 0.45, 0.45, 0.45, 0.45], [0.9] * 5]
    events: list = [None, None]
    rows: list = [None, None]

    def exchange(rank: int) -> None:
        peers = Peers(workers[rank])
        steps = [Timed(t) for t in rounds[rank]]
        events[rank] = peers.exchange(steps[-1], held=steps[:-1])
        rows[rank] = peers.rows

    threads = [threading.Thread(target=exchange, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert [w.shares for w in workers] == [[60, 30], [60, 30]]
    assert [[e["event"] for e in mine] for mine in events] == [["rebalance"], ["rebalance"]]
    assert events[0][0]["shares_from"] == [45, 45] and events[0][0]["step"] == 5
    assert rows[0][0]["compute_s"] == pytest.approx(sum(rounds[0]) / 5)  # what the metrics show: the round's mean
    assert rows[0] == rows[1]
