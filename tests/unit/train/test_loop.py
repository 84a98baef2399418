"""The training loop's rules: schedule, time budget, loader workers giving the same batches, the order in which
the loop asks its hooks, and evaluations taken off the run's clock."""

from __future__ import annotations

import pytest

from raytrm import config as cfg
from raytrm.train.loop import ORDER, Cut, Hook, Loop, Pause, Scale, Stop, Threads
from raytrm.train.optim import lr_at
from raytrm.train.run.evaluations import Evaluations
from raytrm.train.run.metrics import MetricsLog, Progress, read_metrics
from raytrm.train.run.recording import MetricsRows
from raytrm.train.run.stop_rules import SampleLimit, StepLimit
from raytrm.train.run.training import run_training
from raytrm.train.trainer import Trainer


def test_warmup_then_constant_or_cosine():
    t = cfg.from_dict(cfg.TrainConfig, {"lr": 1.0, "warmup_steps": 4})
    assert [lr_at(s, t, 100) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    c = cfg.from_dict(cfg.TrainConfig, {"lr": 1.0, "warmup_steps": 0, "schedule": "cosine", "min_lr_ratio": 0.1})
    assert lr_at(0, c, 10) == pytest.approx(1.0)
    assert lr_at(5, c, 10) == pytest.approx(0.55)
    assert lr_at(10, c, 10) == pytest.approx(0.1)


def test_time_budget_stops_the_run(tiny, tmp_path):
    summary = run_training(tiny(training={"time_budget_s": 1.0}), tmp_path)
    assert summary["steps"] >= 1
    assert summary["train_seconds"] < 1.0 + 5.0  # stops at the first step boundary past the budget


def test_loader_workers_give_the_same_batches(tiny):
    inline = Trainer(tiny(training={"dataloader_workers": 0}))
    workers = Trainer(tiny(training={"dataloader_workers": 1}))
    for _ in range(3):
        a, b = inline.batches.next(inline.step), workers.batches.next(workers.step)
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].equal(b[key]), key
    workers.close()


class Recorder(Hook):
    """Writes down each phase the loop asks it, with the step; halts the run after step `halt_at`."""

    def __init__(self, calls: list, halt_at: int | None = None) -> None:
        self.calls, self.halt_at = calls, halt_at

    def start(self, loop):
        self.calls.append(("start", loop.trainer.step))

    def before_step(self, loop):
        self.calls.append(("before", loop.trainer.step))

    def after_step(self, loop, step):
        self.calls.append(("after", step.result.step))
        decided = [Cut(16)]  # a decision: the loop re-cuts once, after every hook has decided
        if step.result.step == self.halt_at:
            decided.append(Stop("scripted halt"))
        return decided

    def on_recut(self, loop):
        self.calls.append(("recut", loop.trainer.micro_batch))

    def end_step(self, loop, step):
        self.calls.append(("end", step.result.step))

    def finish(self, loop):
        self.calls.append(("finish", loop.trainer.step))


def test_the_loop_asks_its_hooks_phase_by_phase_and_stops_at_the_first_reason(tiny):
    calls: list = []
    loop = Loop(Trainer(tiny()), [StepLimit(2), SampleLimit(64), Recorder(calls)], measure_peak=False)
    assert loop.run() == "steps reached" and loop.trainer.step == 2 and not loop.halted
    assert calls == [
        ("start", 0),
        ("before", 0),
        ("after", 1),
        ("recut", 16),  # once: the cut stays 16 at step 2
        ("end", 1),
        ("before", 1),
        ("after", 2),
        ("end", 2),
        ("finish", 2),
    ]


def test_a_halt_ends_the_run_after_its_step_and_skips_the_evaluations_left_for_the_end(tiny):
    taken: list = []
    trainer = Trainer(tiny())
    evaluations = Evaluations(
        [32, 1000], lambda loop: loop.trainer.samples_seen, lambda loop: {}, lambda loop, k, s: taken.append(k)
    )
    loop = Loop(trainer, [StepLimit(5), evaluations, Recorder([], halt_at=2)], measure_peak=False)
    assert loop.run() == "scripted halt" and loop.halted and trainer.step == 2
    assert taken == [0]  # the point at 32 samples, taken before step 2; the one left for the end is skipped


def test_evaluations_are_taken_off_the_runs_clock(tiny):
    clock = {"t": 0.0}
    real = Trainer.train_step

    def evaluate(loop):
        clock["t"] += 100.0  # a slow evaluation
        return {"quality": 1.0}

    seen: list = []
    trainer = Trainer(tiny())
    evaluations = Evaluations(
        [32, 64], lambda loop: loop.trainer.samples_seen, evaluate, lambda run, k, s: seen.append(run.now())
    )
    loop = Loop(trainer, [SampleLimit(64), evaluations], clock=lambda: clock["t"], measure_peak=False)

    def step(**kwargs):
        clock["t"] += 1.0  # a step takes a second
        return real(trainer, **kwargs)

    trainer.train_step = step
    loop.run()
    assert seen == [1.0, 2.0] and loop.now() == 2.0  # two steps of a second each; the evaluations' 200 s are off


def test_the_loop_applies_a_steps_decisions_in_the_stated_order_whatever_the_hooks_order(tiny):
    # The heat's decisions come before the memory governor's in the hook list, and a stop before both: the loop
    # still applies the cut first, then threads, the share of the cut, the pause, and the stop last.
    import torch

    threads = torch.get_num_threads()

    class Decides(Hook):
        def __init__(self, *decisions):
            self.decisions = list(decisions)

        def after_step(self, loop, step):
            return self.decisions

    hooks = [Decides(Stop("scripted stop"), Pause(0.0)), Decides(Scale(0.5)), Decides(Threads(threads), Cut(8))]
    loop = Loop(Trainer(tiny()), [StepLimit(3), *hooks], measure_peak=False)
    assert loop.run() == "scripted stop" and loop.trainer.step == 1
    assert [type(d) for d in loop.applied] == [Cut, Threads, Scale, Pause, Stop] == list(ORDER)
    # The cut the governor chose, scaled by the heat's share: 8 x 0.5.
    assert loop.trainer.micro_batch == 4 and torch.get_num_threads() == threads


class LostOnce(Hook):
    """A peer lost in the collective after step `at`: the error gloo raises at a missed deadline."""

    def __init__(self, at: int) -> None:
        self.at, self.fired = at, False

    def end_step(self, loop, step):
        if step.result.step == self.at and not self.fired:
            self.fired = True
            raise RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete")


class ScriptedRegroup:
    """A membership that admits a worker at the first boundary it is asked and recovers from a lost peer."""

    def __init__(self) -> None:
        self.recovered: list[int] = []
        self.asked: list[int] = []

    def lost(self, error):
        return "Timed out" in str(error)

    def boundary(self, loop):
        self.asked.append(loop.trainer.step)
        return self.recover(loop) if len(self.asked) == 1 else []

    def recover(self, loop):
        self.recovered.append(loop.trainer.step)
        return [{"event": "membership", "step": loop.trainer.step}]


def test_a_lost_peer_sends_the_loop_to_the_next_membership_and_a_join_is_admitted_at_a_boundary(tiny):
    trainer = Trainer(tiny())
    regroup = ScriptedRegroup()
    rows = []

    class Events(Hook):
        def end_step(self, loop, step):
            rows.append((step.result.step, [e["event"] for e in step.events]))

    loop = Loop(trainer, [Events(), LostOnce(at=3), StepLimit(12)], measure_peak=False, regroup=regroup)
    assert loop.run() == "steps reached"
    assert trainer.step == 12
    # the members looked for joiners after step 1, then every ADMIT_EVERY steps; the failure after step 3 recovered
    assert regroup.asked == [1, 10]
    assert regroup.recovered == [1, 3]
    # each change is an event of the step after it
    assert "membership" in dict(rows)[2] and "membership" in dict(rows)[4]


def test_a_step_whose_rounds_sum_lost_a_peer_keeps_its_metrics_row(tiny, tmp_path):
    """A local round's sum at the end of step 3 misses its deadline: the step ran and stands after the next
    membership, so it gets its row (every step one row), without an evaluation due there."""
    trainer = Trainer(tiny())
    after_step, failed = trainer.strategy.after_step, []

    def losing_at_3(*args, **kwargs):
        if trainer.step == 3 and not failed:
            failed.append(3)
            raise RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete")
        return after_step(*args, **kwargs)

    trainer.strategy.after_step = losing_at_3

    class Regrouping(ScriptedRegroup):  # as raytrm.train.elastic does once the new members hold the state
        def boundary(self, loop):
            return []  # no worker asks to join

        def recover(self, loop):
            for hook in loop.hooks:
                hook.on_regroup(loop)
            return super().recover(loop)

    log = MetricsLog(tmp_path / "metrics.jsonl")
    rows = MetricsRows(trainer, log, Progress(None, None, enabled=False), lambda step: {"scored": step})
    loop = Loop(trainer, [rows, StepLimit(6)], measure_peak=False, logged=lambda step: True, regroup=Regrouping())
    assert loop.run() == "steps reached"
    log.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    steps = [r["step"] for r in records if "event" not in r]
    assert failed == [3] and steps == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if "scored" not in r] == [3, 3]  # the row, then the membership event
    assert records[3] == {"event": "membership", "step": 3}


def test_an_error_that_is_not_a_lost_peer_ends_the_run(tiny):
    trainer = Trainer(tiny())

    class Broken(Hook):
        def end_step(self, loop, step):
            raise RuntimeError("CUDA error: an illegal memory access")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        Loop(trainer, [Broken(), StepLimit(2)], measure_peak=False, regroup=ScriptedRegroup()).run()
