"""The cut of a worker's share into micro-batches: in samples as ever, in padded tokens for records of varied length."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from raytrm.train.memory.fit import cut
from raytrm.train.micro_batches import MicroBatches, padded_tokens, token_parts


def spans(parts: list[slice]) -> list[tuple[int, int]]:
    return [(p.start, p.stop) for p in parts]


def test_a_token_budget_takes_records_while_their_padded_tokens_fit():
    lengths = [48, 40, 30, 20, 12, 10, 8, 5, 3, 3]  # sorted longest first, as a classifier's batch comes
    # 2 x 48 = 96 fits, 3 x 48 does not; 3 x 30 = 90 fits, 4 x 30 does not; the last five pad to 10: 50.
    assert spans(token_parts(lengths, 96)) == [(0, 2), (2, 5), (5, 10)]
    # The same records at a budget of two records at max length (48): each long record alone, the short ones packed.
    assert spans(token_parts(lengths, 96 // 2)) == [(0, 1), (1, 2), (2, 3), (3, 5), (5, 9), (9, 10)]
    # A record longer than the budget is alone in its micro-batch; a budget of 1 puts every record alone.
    assert spans(token_parts([30, 29], 20)) == [(0, 1), (1, 2)]
    assert spans(token_parts(lengths, 1)) == [(i, i + 1) for i in range(10)]
    # Records all at max length: the budget's whole records, the last micro-batch what is left.
    assert spans(token_parts([48] * 10, 4 * 48 + 47)) == [(0, 4), (4, 8), (8, 10)]


@pytest.mark.parametrize("seed", range(5))
def test_token_parts_cover_every_record_once_in_order_and_each_is_as_full_as_it_may_be(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        lengths = sorted(rng.integers(1, 257, int(rng.integers(1, 40))).tolist(), reverse=bool(rng.integers(4)))
        budget = int(rng.integers(1, 2000))
        parts = token_parts(lengths, budget)
        assert parts[0].start == 0 and parts[-1].stop == len(lengths)
        assert all(a.stop == b.start and a.start < a.stop for a, b in itertools.pairwise(parts))
        for part in parts:
            # Within the budget (or one record alone), and one more record would have padded it past the budget.
            assert padded_tokens(lengths, part) <= budget or part.stop - part.start == 1
            if part.stop < len(lengths):
                assert padded_tokens(lengths, slice(part.start, part.stop + 1)) > budget


def test_a_cut_in_samples_is_the_even_cut_as_before():
    samples = MicroBatches(local_batch=33, micro=10)
    assert (samples.unit, samples.counts, samples.largest) == ("samples", cut(33, 10), 9)
    assert spans(samples.parts()) == [(0, 9), (9, 17), (17, 25), (25, 33)]
    assert samples.set(64) == [33] and samples.largest == 33 and samples.units(5) == 5
    assert samples.set(4, local_batch=10) == [4, 3, 3] and samples.samples_at_widest() == 4


def test_a_cut_in_tokens_starts_at_the_configs_records_at_max_length_and_cuts_each_step_by_its_lengths():
    tokens = MicroBatches(local_batch=10, micro=2, width=48)  # the config's 2 records at max length
    assert (tokens.unit, tokens.largest, tokens.units(3)) == ("tokens", 96, 144)
    assert tokens.counts == [2, 2, 2, 2, 2] and tokens.in_flight == 96  # before any step: records at their widest
    assert tokens.samples_at_widest() == 2
    lengths = [48, 40, 30, 20, 12, 10, 8, 5, 3, 3]
    assert spans(tokens.parts(lengths)) == [(0, 2), (2, 5), (5, 10)]
    assert tokens.counts == [2, 3, 5] and tokens.in_flight == 96  # the widest micro-batch: 2 x 48
    assert spans(tokens.parts([20] * 10)) == [(0, 4), (4, 8), (8, 10)] and tokens.in_flight == 80
    tokens.set(1000)
    assert tokens.largest == 1000 and tokens.samples_at_widest() == 10  # no more than the share
    with pytest.raises(ValueError, match="needs the records' lengths"):
        tokens.parts()
    with pytest.raises(ValueError, match="a micro-batch of 0 tokens"):
        tokens.set(0)


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_side_by_side_a_token_cut_runs_a_micro_batch_at_a_time_split_within_its_budget(threads):
    """Each round is one micro-batch of the cut, split between the threads into contiguous shares, each padded to
    its own longest: the shares in flight together never hold more padded tokens than the budget."""
    rng = np.random.default_rng(threads)
    for _ in range(30):
        lengths = sorted(rng.integers(1, 129, int(rng.integers(2, 40))).tolist(), reverse=True)
        tokens = MicroBatches(len(lengths), 4, width=128)
        tokens.set(int(rng.integers(128, 1500)))
        parts, rounds = tokens.plan(lengths, threads)
        assert parts == token_parts(lengths, tokens.micro)
        if not rounds:  # every micro-batch a single record: nothing to run side by side
            assert all(p.stop - p.start == 1 for p in parts)
            continue
        assert len(rounds) == len(parts)
        for part, groups in zip(parts, rounds, strict=True):
            shares = [share for group in groups for share in group]
            assert all(len(group) == 1 for group in groups) and len(groups) <= threads
            assert (shares[0].start, shares[-1].stop) == (part.start, part.stop)
            assert all(a.stop == b.start for a, b in itertools.pairwise(shares))
            in_flight = sum(padded_tokens(lengths, s) for s in shares)
            assert in_flight <= padded_tokens(lengths, part) and (in_flight <= tokens.micro or len(shares) == 1)
        assert tokens.in_flight == max(sum(padded_tokens(lengths, g[0]) for g in groups) for groups in rounds)
    # On one thread there are no rounds: the micro-batches run one after another.
    assert MicroBatches(4, 1, width=10).plan([10, 9, 8, 1], 1)[1] == []


def test_side_by_side_a_sample_cut_is_the_threads_shares_as_before():
    from raytrm.train import side_by_side

    samples = MicroBatches(16, 8)
    parts, rounds = samples.plan(None, 2)
    assert spans(parts) == [(0, 8), (8, 16)] and rounds == [side_by_side.plan(16, 8, 2)]
    assert MicroBatches(16, 1).plan(None, 2)[1] == []  # a micro-batch of one sample runs on all threads, in turn
