"""Shares of a global batch: integer splits, fitted step times, the balanced split and the balancer over steps."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from raytrm.sync.shares import (
    LinearTime,
    Rebalance,
    ShareBalancer,
    balanced,
    by_pace,
    fit_time,
    offsets,
    shard,
    split,
)


@pytest.mark.parametrize(
    ("total", "weights", "expected"),
    [
        (100, [3, 1], [75, 25]),
        (90, [2.0, 1.0], [60, 30]),
        (7, [2, 1], [5, 2]),  # 4.67 / 2.33: the larger remainder takes the spare sample
        (10, [1, 1, 1], [4, 3, 3]),  # a tie of remainders goes to the lower index
        (5, [1, 1], [3, 2]),
        (10, [100, 1, 1], [8, 1, 1]),  # the floor of one sample each
        (3, [5, 1, 2], [1, 1, 1]),
    ],
)
def test_split_is_proportional_with_largest_remainders(total, weights, expected):
    assert split(total, weights) == expected


def test_shares_by_pace_follow_each_workers_speed_and_a_newcomer_counts_as_the_mean():
    # a Studio twice a MacBook's speed per sample
    assert by_pace(64, [0.1, 0.2, 0.2]) == [32, 16, 16]
    # a newcomer (not timed) counts as the timed ones' mean speed, 7.5 samples/s here
    assert by_pace(64, [0.1, math.nan, 0.2]) == split(64, [10.0, 7.5, 5.0])
    # none timed (the run's first membership): even
    assert by_pace(64, [math.nan, math.nan, math.nan]) == [22, 21, 21]


def test_split_sums_to_the_total_within_bounds():
    for total, weights in itertools.product(range(4, 40), [[1, 1, 1, 1], [0.3, 7, 2, 1], [1e-3, 1, 1, 50]]):
        shares = split(total, weights)
        assert sum(shares) == total and min(shares) >= 1, (total, weights, shares)


@pytest.mark.parametrize(
    ("total", "weights", "caps", "expected"),
    [
        (10, [1, 1, 1], [2, None, None], [2, 4, 4]),
        (10, [1, 1, 1], [1, 1, None], [1, 1, 8]),
        (12, [4, 1, 1], [2, 5, None], [2, 5, 5]),
        (12, [4, 1, 1], [2, 4, None], [2, 4, 6]),  # capping 0 pushes 1 past its cap: fill again
        (4, [100, 1, 1], [3, None, None], [2, 1, 1]),  # a cap and the floors at once
        (6, [1, 1], [3, 3], [3, 3]),
    ],
)
def test_split_water_fills_the_caps(total, weights, caps, expected):
    assert split(total, weights, caps) == expected


@pytest.mark.parametrize(
    ("total", "weights", "caps", "match"),
    [
        (2, [1, 1, 1], None, "cannot split 2 samples between 3 workers"),
        (10, [1, 0], None, r"finite and > 0, got \[1, 0\]"),
        (10, [1, -2], None, "finite and > 0"),
        (10, [1, math.nan], None, "finite and > 0"),
        (10, [1, math.inf], None, "finite and > 0"),
        (10, [1, 1], [4, 5], r"caps \[4, 5\] cannot hold 10 samples"),
        (10, [1, 1], [0, None], r"caps \[0, 10\] cannot hold"),
        (10, [1, 1], [4], "1 entries for 2 workers"),
    ],
)
def test_split_rejects_what_cannot_be_split(total, weights, caps, match):
    with pytest.raises(ValueError, match=match):
        split(total, weights, caps)


def test_offsets_and_shards_tile_the_batch():
    shares = [5, 1, 3]
    assert offsets(shares) == [0, 5, 6]
    assert [shard(shares, r) for r in range(3)] == [slice(0, 5), slice(5, 6), slice(6, 9)]
    assert ShareBalancer(9, 3, shares=shares).shard(2) == slice(6, 9)


def test_fit_time_recovers_a_line_from_noiseless_points():
    line = LinearTime(0.25, 0.0125)
    points = [(b, line.predict(b)) for b in (8, 8, 16, 24, 40)]
    fit = fit_time(points)
    assert fit.fixed_s == pytest.approx(0.25, abs=1e-12)
    assert fit.per_sample_s == pytest.approx(0.0125, abs=1e-12)


def test_fit_time_takes_the_median_of_each_share():
    fit = fit_time([(10, 1.0), (10, 1.1), (10, 9.0), (20, 2.0), (20, 2.0)])  # one step the OS interrupted
    assert fit.fixed_s == pytest.approx(0.2) and fit.per_sample_s == pytest.approx(0.09)


def test_fit_time_is_proportional_with_one_share_or_an_unphysical_line():
    assert fit_time([(30, 0.6), (30, 0.9), (30, 0.6)]) == LinearTime(0.0, pytest.approx(0.02))
    # Longer with fewer samples (a negative slope) and a negative fixed cost: the mean rate, through zero.
    assert fit_time([(10, 1.0), (20, 0.5)]) == LinearTime(0.0, pytest.approx(1.5 / 30))
    assert fit_time([(10, 0.05), (20, 0.25)]) == LinearTime(0.0, pytest.approx(0.3 / 30))
    assert fit_time([(10, 0.0)]).per_sample_s > 0
    with pytest.raises(ValueError, match="at least one"):
        fit_time([])


def test_balanced_equalises_the_predicted_times():
    models = [LinearTime(0.1, 0.01), LinearTime(0.1, 0.02)]
    shares = balanced(90, models)
    assert shares == [60, 30]
    assert models[0].predict(60) == pytest.approx(models[1].predict(30)) == pytest.approx(0.7)


def test_balanced_respects_caps_and_the_floor():
    models = [LinearTime(0.1, 0.01), LinearTime(0.1, 0.02)]
    assert balanced(90, models, caps=[50, None]) == [50, 40]
    assert balanced(90, models, caps=[None, 20]) == [70, 20]
    hopeless = [LinearTime(0.0, 0.01), LinearTime(100.0, 1.0), LinearTime(0.0, 0.02)]
    assert balanced(30, hopeless) == [20, 1, 9]  # the slow one still trains a sample; 0.2 s ties go to 0
    assert balanced(3, hopeless) == [1, 1, 1]
    with pytest.raises(ValueError, match="cannot split 2 samples between 3 workers"):
        balanced(2, hopeless)
    with pytest.raises(ValueError, match="per-sample times must be finite and > 0"):
        balanced(10, [LinearTime(0.0, 0.0), LinearTime(0.0, 1.0)])


def test_balanced_rounds_to_the_smallest_slowest_worker():
    """Against every integer split of small batches: none has a faster slowest worker."""
    models = [LinearTime(0.3, 0.02), LinearTime(0.0, 0.035), LinearTime(0.05, 0.01)]
    for total, caps in itertools.product(range(3, 16), [None, [4, None, 5], [None, 2, None]]):
        bounds = [total if c is None else c for c in caps or [None] * 3]
        if sum(bounds) < total:
            continue
        shares = balanced(total, models, caps)
        assert sum(shares) == total and all(1 <= b <= c for b, c in zip(shares, bounds, strict=True))
        best = min(
            max(m.predict(b) for m, b in zip(models, split_, strict=True))
            for split_ in itertools.product(*(range(1, c + 1) for c in bounds))
            if sum(split_) == total
        )
        assert max(m.predict(b) for m, b in zip(models, shares, strict=True)) == pytest.approx(best), (total, caps)


def run(balancer: ShareBalancer, lines, steps: range) -> list[Rebalance]:
    """Feed step times drawn from each worker's line (per step, lines(step) -> models); return the rebalances."""
    events = []
    for step in steps:
        balancer.observe(step, [m.predict(b) for m, b in zip(lines(step), balancer.shares, strict=True)])
        event = balancer.decide(step)
        assert sum(balancer.shares) == balancer.global_batch
        if event is not None:
            events.append(event)
    return events


def test_balancer_moves_samples_off_a_slow_worker_once():
    lines = [LinearTime(0.0, 0.01), LinearTime(0.0, 0.02)]
    balancer = ShareBalancer(90, 2)
    assert balancer.shares == [45, 45]
    events = run(balancer, lambda step: lines, range(1, 20))
    assert len(events) == 1 and balancer.shares == [60, 30] and balancer.events == events
    # Step 1 is the warm-up; steps 2 and 3 give the two observations a fit needs.
    assert events[0].to_event() == {
        "step": 3,
        "event": "rebalance",
        "shares_from": [45, 45],
        "shares_to": [60, 30],
        "predicted_step_s_from": pytest.approx(0.9),
        "predicted_step_s_to": pytest.approx(0.6),
        "reason": "worker 1 is 2.00x slower per sample than worker 0; predicted step 0.900 s -> 0.600 s",
    }


def test_a_local_rounds_median_moves_the_shares_at_the_first_rounds_end():
    # A round of 5 steps holds the warm-up's one step: its median is a steady step's, so the first round is a point.
    balancer = ShareBalancer(90, 2)
    balancer.observe(5, [0.45, 0.9], steps=5)
    event = balancer.decide(5)
    assert event is not None and event.step == 5 and balancer.shares == [60, 30]


def test_an_observation_mostly_of_warm_up_steps_is_left_out():
    balancer = ShareBalancer(90, 2, warmup_steps=2)
    balancer.observe(3, [5.0, 0.9], steps=3)  # two of its three steps are warm-up: the median may be one of them
    assert balancer.state_dict()["points"] == [[], []]
    balancer.observe(4, [0.45, 0.9])  # one steady step: no line yet
    assert balancer.decide(4) is None
    balancer.observe(5, [0.45, 0.9])
    assert balancer.decide(5) is not None and balancer.shares == [60, 30]
    with pytest.raises(ValueError, match="at least one step, got 0"):
        balancer.observe(6, [0.4, 0.8], steps=0)


def test_the_window_counts_steps_so_a_slow_step_leaves_the_fit_after_two_rounds():
    balancer = ShareBalancer(90, 2, window=8, min_gain=0.99)  # shares stay: only what the fit holds is watched
    balancer.observe(1, [0.45, 0.9])  # the warm-up step
    balancer.observe(2, [3.0, 0.9])  # a slow step of a passing cause (the mode's switch), at the first shares
    balancer.observe(7, [0.45, 0.9], steps=5)  # a round of 5: with it, 6 steps are covered
    assert balancer.state_dict()["points"][0] == [[45, 3.0], [45, 0.45]]
    balancer.observe(12, [0.45, 0.9], steps=5)  # 10 steps in the two latest rounds: the slow step is out
    assert balancer.state_dict()["points"] == [[[45, 0.45], [45, 0.45]], [[45, 0.9], [45, 0.9]]]
    balancer.observe(22, [0.5, 0.9], steps=10)  # a round longer than the window: it and the one before, for a line
    assert balancer.state_dict()["points"][0] == [[45, 0.45], [45, 0.5]]


def test_balancer_learns_fixed_costs_from_the_shares_it_tried():
    lines = [LinearTime(0.1, 0.01), LinearTime(0.1, 0.02)]
    balancer = ShareBalancer(90, 2, warmup_steps=2)
    events = run(balancer, lambda step: lines, range(30))
    # The first guess is proportional (one share seen); the second share shows the fixed cost.
    assert [e.shares_to for e in events] == [[58, 32], [60, 30]]
    assert events[0].step == 3 and balancer.shares == balanced(90, lines) == [60, 30]


def test_balancer_names_a_fixed_cost_when_the_rates_match():
    lines = [LinearTime(0.0, 0.01), LinearTime(0.3, 0.01)]
    events = run(ShareBalancer(90, 2, shares=[30, 60]), lambda step: lines, range(15))
    assert [e.reason for e in events] == [
        "worker 1 is 1.50x slower per sample than worker 0; predicted step 0.900 s -> 0.540 s",  # one share: no line
        "worker 1 finishes last with 36 samples and 0.300 s of fixed cost; predicted step 0.660 s -> 0.600 s",
    ]


def test_balancer_takes_a_small_gain_once_the_same_move_is_proposed_three_times_in_a_row():
    lines = [LinearTime(0.0, 0.010), LinearTime(0.0, 0.0104)]  # 2% apart: [51, 49] saves 1.9% of a step
    (event,) = run(ShareBalancer(100, 2), lambda step: lines, range(1, 20))
    # Step 1 is the warm-up, steps 2 and 3 the first line; proposed at steps 3, 4 and 5.
    assert event.step == 5 and event.shares_to == [51, 49]
    assert event.reason.endswith("predicted step 0.520 s -> 0.510 s, proposed at 3 decisions in a row")
    eager = ShareBalancer(100, 2, small_gain=0.0, min_gain=0.0)
    assert [(e.step, e.shares_to) for e in run(eager, lambda step: lines, range(1, 20))] == [(3, [51, 49])]
    below = ShareBalancer(100, 2, small_gain=0.02)  # 1.9% is under it: the shares stay
    assert run(below, lambda step: lines, range(1, 20)) == []


def test_a_small_gain_proposed_one_way_then_the_other_moves_nothing():
    # Step times that favour worker 1 at even steps and worker 0 at odd ones (a noisy machine): every decision
    # proposes a small move, never the same one twice in a row.
    lines = [LinearTime(0.0, 0.010), LinearTime(0.0, 0.0104)]
    flipped = lines[::-1]
    balancer = ShareBalancer(100, 2, window=2)
    assert run(balancer, lambda step: lines if (step // 2) % 2 else flipped, range(1, 30)) == []
    assert balancer.shares == [50, 50]


def test_a_small_gain_waiting_its_turn_is_saved_and_resumed():
    lines = [LinearTime(0.0, 0.010), LinearTime(0.0, 0.0104)]
    balancer = ShareBalancer(100, 2)
    assert run(balancer, lambda step: lines, range(1, 5)) == []  # proposed at steps 3 and 4
    state = json.loads(json.dumps(balancer.state_dict()))
    assert state["pending"] == [[51, 49], 2]
    resumed = ShareBalancer(100, 2)
    resumed.load_state_dict(state)
    # Its first step is a warm-up again, off the line; the saved line proposes the move a third time there.
    assert [(e.step, e.shares_to) for e in run(resumed, lambda step: lines, range(5, 10))] == [(5, [51, 49])]
    del state["pending"]  # a checkpoint written before small gains waited: the count starts again
    older = ShareBalancer(100, 2)
    older.load_state_dict(state)
    assert [e.step for e in run(older, lambda step: lines, range(5, 12))] == [7]


def test_times_that_jitter_by_a_fifth_move_the_shares_a_few_times_not_every_few_steps():
    # A Studio and two MacBooks on steps of tens of milliseconds, each step's time off its line by a fifth
    # (lognormal, seeded): the best shares stay [12, 6, 6] throughout.
    lines = [LinearTime(0.004, 0.0005), LinearTime(0.004, 0.001), LinearTime(0.004, 0.001)]
    jitter = random.Random(0)
    noisy = [[jitter.lognormvariate(0, 0.2) for _ in lines] for _ in range(300)]

    def moves(balancer: ShareBalancer) -> tuple[list[Rebalance], float]:
        """The rebalances, and the mean step the shares held would take without the jitter."""
        events, total = [], 0.0
        for step, factors in enumerate(noisy, start=1):
            total += max(m.predict(b) for m, b in zip(lines, balancer.shares, strict=True))
            times = [m.predict(b) * f for m, b, f in zip(lines, balancer.shares, factors, strict=True)]
            balancer.observe(step, times)
            events += [e for e in [balancer.decide(step)] if e is not None]
        return events, total / len(noisy)

    eager, eager_step = moves(ShareBalancer(24, 3, noise_z=0.0))  # a 5% gain moves at once, whatever the noise
    steady, steady_step = moves(ShareBalancer(24, 3))
    assert len(eager) > 50 and len(steady) < 30, (len(eager), len(steady))
    assert steady_step <= eager_step  # fewer moves, to shares no slower (the best: [12, 6, 6], 10 ms a step)
    assert any("decisions in a row (within the times' noise" in e.reason for e in steady)


def test_balancer_follows_a_worker_that_slows_down():
    fast, slow = [LinearTime(0.0, 0.01), LinearTime(0.0, 0.02)], [LinearTime(0.0, 0.01), LinearTime(0.0, 0.04)]
    balancer = ShareBalancer(90, 2)
    events = run(balancer, lambda step: fast if step < 10 else slow, range(1, 40))
    assert len(events) >= 2 and events[0].shares_to == [60, 30]
    assert events[1].step >= 10 and events[1].shares_to[1] < 30
    assert events[1].predicted_s_to < events[1].predicted_s_from
    assert balancer.shares == [72, 18]  # once the old times left the window: 0.72 s each


def test_balancer_interval_and_window():
    lines = [LinearTime(0.0, 0.01), LinearTime(0.0, 0.02)]
    balancer = ShareBalancer(90, 2, interval=4, window=3)
    assert [e.step for e in run(balancer, lambda step: lines, range(1, 12))] == [4]
    assert [len(p) for p in balancer.state_dict()["points"]] == [3, 3]


def test_a_worker_over_its_memory_cap_sheds_samples_before_any_step_time():
    balancer = ShareBalancer(90, 2)
    assert balancer.set_caps([None, 30]) is None
    event = balancer.decide(0)
    assert event is not None and balancer.shares == [60, 30]
    assert (event.predicted_s_from, event.predicted_s_to) == (None, None)
    assert event.reason == "worker 1 holds 45 samples, its memory allows 30: memory, not speed, moves these samples"


def test_memory_caps_bound_the_balanced_shares_even_at_a_loss():
    lines = [LinearTime(0.0, 0.01), LinearTime(0.0, 0.02)]  # worker 0 is twice as fast: 60/30 unbounded
    balancer = ShareBalancer(90, 2)
    balancer.set_caps([50, None])
    run(balancer, lambda step: lines, range(1, 10))
    assert balancer.shares == [50, 40]
    # Equal speeds leave no gain to chase; a cap that falls below a share moves samples anyway.
    equal = ShareBalancer(90, 2)
    run(equal, lambda step: [LinearTime(0.0, 0.01)] * 2, range(1, 5))
    assert equal.shares == [45, 45]
    equal.set_caps([40, None])
    event = equal.decide(5)
    assert event is not None and event.shares_to == [40, 50] and event.predicted_s_to > event.predicted_s_from
    assert "worker 0 holds 45 samples, its memory allows 40" in event.reason


def test_caps_that_cannot_hold_the_global_batch_are_dropped():
    balancer = ShareBalancer(90, 2)
    assert "cannot hold 90 samples" in balancer.set_caps([40, 40])
    assert balancer.caps is None
    assert balancer.set_caps([None, None]) is None and balancer.caps is None


def test_balancer_rejects_bad_settings():
    with pytest.raises(ValueError, match=r"shares \[40, 40\] must be 2 numbers >= 1 summing to 90"):
        ShareBalancer(90, 2, shares=[40, 40])
    with pytest.raises(ValueError, match="must be 3 numbers"):
        ShareBalancer(90, 3, shares=[45, 45])
    with pytest.raises(ValueError, match="window=1"):
        ShareBalancer(90, 2, window=1)
    with pytest.raises(ValueError, match=r"noise_z=-1.0 \(>= 0\)"):
        ShareBalancer(90, 2, noise_z=-1.0)
    with pytest.raises(ValueError, match="2 step times for 3 workers"):
        ShareBalancer(90, 3).observe(0, [1.0, 1.0])


def test_state_dict_round_trips():
    lines = [LinearTime(0.1, 0.01), LinearTime(0.1, 0.02)]
    balancer = ShareBalancer(90, 2)
    run(balancer, lambda step: lines, range(8))
    state = balancer.state_dict()
    assert state["shares"] == [60, 30] and state["events"]
    assert json.loads(json.dumps(state)) == state  # plain types only
    restored = ShareBalancer(90, 2)
    run(restored, lambda step: [LinearTime(0.0, 0.01)] * 2, range(3))  # a life of its own, then the saved one's
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    assert restored.shares == [60, 30] and restored.events == balancer.events
    assert restored.shard(1) == slice(60, 90)
    # A resumed process pays its one-time costs again: its first step is warm-up, not a point on the line.
    restored.observe(8, [9.0, 9.0])
    assert restored.state_dict() == state
    restored.observe(9, [0.7, 0.7])
    assert restored.state_dict()["points"][0][-1] == [60, 0.7]


def test_load_state_dict_on_another_world_size_starts_afresh():
    lines = [LinearTime(0.0, 0.01), LinearTime(0.0, 0.02)]
    balancer = ShareBalancer(90, 2)
    run(balancer, lambda step: lines, range(8))
    grown = ShareBalancer(90, 3)
    run(grown, lambda step: [LinearTime(0.0, 0.01)] * 3, range(3))  # observed, equal: nothing to move
    grown.load_state_dict(balancer.state_dict())
    assert grown.shares == [30, 30, 30] and grown.events == []
    assert grown.state_dict()["points"] == [[], [], []]
    assert grown.decide(8) is None
    other_batch = ShareBalancer(60, 2)
    other_batch.load_state_dict(balancer.state_dict())
    assert other_batch.shares == [30, 30] and other_batch.events == []
