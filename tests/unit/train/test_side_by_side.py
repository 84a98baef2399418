"""Micro-batches side by side on a CPU, one share of the slots per thread: the same step as one after another."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

from raytrm.train import side_by_side as threaded
from raytrm.train.trainer import Trainer

needs_per_thread_counts = pytest.mark.skipif(
    not threaded.available(torch.device("cpu"), compiled=False), reason="needs OpenMP and MKL (per-thread counts)"
)


def test_the_plan_gives_each_thread_a_contiguous_share_cut_to_fit_one_micro_batch():
    assert threaded.plan(16, 16, 2) == [[slice(0, 8)], [slice(8, 16)]]
    # Micro-batches of 8 on 2 threads: 4 slots each at a time, so 8 in flight.
    assert threaded.plan(16, 8, 2) == [[slice(0, 4), slice(4, 8)], [slice(8, 12), slice(12, 16)]]
    # Uneven: shares differ by at most one slot, and every slot is run once, in order.
    flat = [part for group in threaded.plan(11, 12, 3) for part in group]
    assert [(p.start, p.stop) for p in flat] == [(0, 4), (4, 8), (8, 11)]
    # A micro-batch of 5 on 2 threads is dealt out as 3 + 2: thread 0 runs its 8 slots as 3 + 3 + 2, thread 1 as 2s.
    assert threaded.plan(16, 5, 2) == [
        [slice(0, 3), slice(3, 6), slice(6, 8)],
        [slice(8, 10), slice(10, 12), slice(12, 14), slice(14, 16)],
    ]
    # No more threads than slots, nor than the micro-batch's slots: a micro-batch of 1 runs one slot at a time.
    assert threaded.plan(2, 2, 4) == [[slice(0, 1)], [slice(1, 2)]]
    assert threaded.plan(8, 1, 2) == [[slice(i, i + 1) for i in range(8)]]
    assert threaded.plan(8, 3, 4) == [
        [slice(0, 1), slice(1, 2), slice(2, 3)],
        [slice(3, 4), slice(4, 5), slice(5, 6)],
        [slice(6, 7), slice(7, 8)],
    ]


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8])
def test_the_micro_batches_in_flight_add_up_to_the_micro_batch_and_never_more(threads):
    """What the memory model fits against the micro-batch is what runs at once: the threads' largest micro-batches,
    side by side, are the micro-batch itself, for every split of any batch."""
    for local in range(1, 25):
        for micro in range(1, local + 1):
            groups = threaded.plan(local, micro, threads)
            assert len(groups) == threaded.side_by_side(local, micro, threads) == min(threads, micro)
            assert [(p.start, p.stop) for g in groups for p in g] == list(
                itertools.pairwise([0, *itertools.accumulate(p.stop - p.start for g in groups for p in g)])
            )
            assert groups[-1][-1].stop == local
            assert sum(max(p.stop - p.start for p in g) for g in groups) == micro


def test_slots_of_unequal_cost_are_shared_by_their_padded_cost_where_one_micro_batch_holds_them():
    # Records sorted longest first: by count, thread 0 would run 4 x 100 while thread 1 ran 4 x 3.
    costs = [100, 60, 50, 40, 5, 4, 3, 3]
    assert threaded.plan(8, 8, 2, costs) == [[slice(0, 3)], [slice(3, 8)]]  # 3 x 100 and 5 x 40
    assert threaded.plan(8, 8, 2, [7] * 8) == threaded.plan(8, 8, 2) == [[slice(0, 4)], [slice(4, 8)]]
    assert threaded.plan(9, 9, 2, [7] * 9) == threaded.plan(9, 9, 2)  # equal costs: even counts, the larger first
    # Micro-batches smaller than the share (the memory governor's cut): by count, as the memory model fits them.
    assert threaded.plan(8, 4, 2, costs) == threaded.plan(8, 4, 2)
    assert threaded.plan(8, 8, 1, costs) == [[slice(0, 8)]]


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_the_balanced_shares_are_the_best_contiguous_cut(threads):
    """Against every cut of the slots into at most `threads` contiguous shares: none has a smaller largest share."""
    rng = np.random.default_rng(threads)
    for _ in range(40):
        n = int(rng.integers(1, 11))
        costs = sorted(rng.integers(1, 300, n).tolist(), reverse=bool(rng.integers(2)))
        shares = threaded.balanced_shares(costs, threads)
        assert shares[0].start == 0 and shares[-1].stop == n and len(shares) <= threads
        assert all(a.stop == b.start and a.start < a.stop for a, b in itertools.pairwise(shares))
        best = min(
            max(threaded.padded_cost(costs, slice(a, b)) for a, b in itertools.pairwise([0, *cuts, n]))
            for k in range(min(threads, n))
            for cuts in itertools.combinations(range(1, n), k)
        )
        assert max(threaded.padded_cost(costs, share) for share in shares) == best


def test_it_runs_only_where_a_threads_count_is_its_own():
    assert not threaded.available(torch.device("cpu"), compiled=True)
    assert not threaded.available(torch.device("meta"), compiled=False)


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    state.update({f"carry.{k}": v.clone() for k, v in trainer.carry.to_dict().items()})
    return state


@needs_per_thread_counts
def test_side_by_side_is_the_sequential_step_bit_for_bit(tiny):
    """Three threads with a share of 11 slots each against micro-batches of 11 one after another on one thread: the
    same micro-batches, the same kernels, the gradients summed in the same order ((a + b) + c), so the same bits."""
    side = Trainer(tiny(training={"global_batch_size": 33, "threads": 3}))
    assert side._threaded is not None
    plain = Trainer(tiny(training={"global_batch_size": 33, "threads": 1, "grad_accum_steps": 3}))
    assert [(p.start, p.stop) for p in plain.slices()] == [(0, 11), (11, 22), (22, 33)]
    try:
        for _ in range(3):  # refilled slots, the sparse embedding and the EMA included
            torch.set_num_threads(3)  # torch's count is the process's: each trainer's, as it set it
            a = side.train_step()
            torch.set_num_threads(1)
            b = plain.train_step()
            assert (a.loss, a.metrics) == (b.loss, b.metrics)
        assert side._threaded._pool is not None and plain._threaded._pool is None
        one, other = snapshot(side), snapshot(plain)
        assert one.keys() == other.keys()
        for key in one:
            assert torch.equal(one[key], other[key]), key
        assert all(p.grad is None for r in side._threaded._replicas for p in r.parameters())
    finally:
        side.close()
        plain.close()


@needs_per_thread_counts
def test_a_micro_batch_of_one_runs_on_all_threads_one_slot_at_a_time(tiny):
    """Where the memory governor allows one slot at a time, two threads side by side would hold two: the step runs
    its micro-batches one after another instead, each on both of torch's threads."""
    trainer = Trainer(tiny(training={"global_batch_size": 4, "threads": 2, "grad_accum_steps": 4}))
    try:
        torch.set_num_threads(2)
        trainer.train_step()
        assert trainer._threaded is not None and trainer._threaded._pool is None
        trainer.set_micro_batch(2)  # as the memory governor does when it grows back
        trainer.train_step()
        assert trainer._threaded._pool is not None and len(trainer._threaded._replicas) == 1
    finally:
        trainer.close()


@needs_per_thread_counts
def test_a_flop_counter_sees_the_whole_step(tiny):
    """Dispatch modes are per thread: under one, the micro-batches run on the calling thread, one after another."""
    from torch.utils.flop_counter import FlopCounterMode

    side = Trainer(tiny(training={"global_batch_size": 8, "threads": 2}))
    plain = Trainer(tiny(training={"global_batch_size": 8, "threads": 1, "grad_accum_steps": 2}))
    try:
        counts = []
        for trainer, threads in ((side, 2), (plain, 1)):
            torch.set_num_threads(threads)
            with FlopCounterMode(display=False) as counter:
                trainer.train_step()
            counts.append(counter.get_total_flops())
        assert counts[0] == counts[1] > 0
    finally:
        side.close()
        plain.close()


class _Doubler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def test_replicas_share_the_weights_and_follow_them_to_new_storage():
    model = _Doubler()
    runner = threaded.ThreadedMicroBatches(model)
    try:
        _, replica = runner.models(2)
        assert replica.w is not model.w and replica.w.data_ptr() == model.w.data_ptr()
        with torch.no_grad():
            model.w.mul_(2)  # an optimizer step, in place
        assert torch.equal(replica.w, torch.full((3,), 2.0))
        model.w.data = torch.zeros(3)  # new storage: the replica is made again
        _, again = runner.models(2)
        assert again is not replica and again.w.data_ptr() == model.w.data_ptr()
    finally:
        runner.close()


def test_gradients_add_up_in_thread_order_and_an_error_stops_the_step():
    model = _Doubler()
    runner = threaded.ThreadedMicroBatches(model)
    inputs = torch.arange(12.0).view(4, 3)

    def micro_step(m: nn.Module, part: slice) -> float:
        loss = m(inputs[part])
        loss.backward()
        return float(loss.detach())

    try:
        losses = runner.run(threaded.plan(4, 4, 2), micro_step)
        assert losses == [float(inputs[0:2].sum()), float(inputs[2:4].sum())]
        assert torch.equal(model.w.grad, inputs.sum(0))

        def failing(m: nn.Module, part: slice) -> float:
            if part.start >= 2:
                raise ValueError("no such slot")
            return micro_step(m, part)

        model.w.grad = None
        with pytest.raises(ValueError, match="no such slot"):
            runner.run(threaded.plan(4, 4, 2), failing)
        # The thread that succeeded left its gradient on the model; the replicas hold none.
        assert torch.equal(model.w.grad, inputs[0:2].sum(0))
        assert all(p.grad is None for r in runner._replicas for p in r.parameters())
    finally:
        runner.close()
