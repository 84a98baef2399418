"""The automatic sync choice: the link fitted from timed sums, the mode and round length chosen from a faked link and
step time, and the run's hook choosing (and choosing again on drift) with two mirrored workers in one process."""

from __future__ import annotations

import math

import pytest
import torch

from raytrm.sync import strategy as sync_modes
from raytrm.sync.link import Lateness, Link, choose, fit_link, measure_link, step_share
from raytrm.sync.local import Local
from raytrm.train.loop import Hook, Loop
from raytrm.train.run.stop_rules import StepLimit
from raytrm.train.trainer import Trainer

MBIT = 1e6 / 8  # bytes per second in a Mbit/s


@pytest.mark.parametrize(
    ("mbit", "text"), [(3539, "3539 Mbit/s and 0.20 ms a sum"), (19.96, "20.0 Mbit/s and 0.20 ms a sum")]
)
def test_a_link_is_described_in_mbit_per_s_whatever_its_rate(mbit, text):
    assert Link(0.0002, mbit * MBIT).describe() == text


def test_fit_link_recovers_latency_and_rate():
    link = Link(0.002, 100 * MBIT)
    points = [(b, link.seconds(b)) for b in (4, 1 << 16, 1 << 18, 1 << 20)]
    fitted = fit_link(points)
    assert fitted.latency_s == pytest.approx(0.002, rel=1e-6)
    assert fitted.bytes_per_s == pytest.approx(100 * MBIT, rel=1e-6)
    # Noise that would make the fixed cost negative: the largest sum alone sets the rate.
    assert fit_link([(1000, 0.5), (2000, 0.1)]).latency_s == 0.0


def test_a_fast_link_keeps_exact_sync():
    choice = choose(Link(1e-4, 10_000 * MBIT), step_s=0.1, model_bytes=4_000_000)
    assert (choice.mode, choice.every) == ("exact", None)
    assert choice.share <= 0.05 and "exact keeps it" in choice.reason


def test_a_link_half_too_slow_compresses():
    # 4 MB at 1 Gbit/s: 32 ms, 6.0% of a 0.5 s step; half the bytes 3.1%.
    choice = choose(Link(1e-4, 1000 * MBIT), step_s=0.5, model_bytes=4_000_000)
    assert choice.mode == "compressed"
    assert step_share(Link(1e-4, 1000 * MBIT), 0.5, 4_000_000) > 0.05 >= choice.share


def test_a_slow_link_takes_the_fewest_local_steps_that_keep_the_share():
    link = Link(0.001, 20 * MBIT)  # 0.8 MB: 0.321 s a sum against a 2 s step
    waiting = choose(link, step_s=2.0, model_bytes=800_000, overlap_ok=False)
    assert (waiting.mode, waiting.overlap) == ("local", 0)
    h = waiting.every
    assert step_share(link, 2.0, 800_000, h) <= 0.05 < step_share(link, 2.0, 800_000, h - 1)
    assert h == 4 and f"H={h}" in waiting.reason
    # The exchange behind one step hides it, in rounds no shorter than OVERLAP_ROUND steps behind: here shorter than
    # without (13); and where waiting in the open asks for fewer steps (4), the round behind still wins: a step longer,
    # it waits a hundredth of what the open round does.
    behind = choose(Link(0.001, 5 * MBIT), step_s=2.0, model_bytes=800_000, overlap_ok=True)
    assert (behind.mode, behind.every, behind.overlap) == ("local", 5, 1)
    assert choose(Link(0.001, 5 * MBIT), step_s=2.0, model_bytes=800_000, overlap_ok=False).every == 13
    hidden = choose(link, step_s=2.0, model_bytes=800_000, overlap_ok=True)
    assert (hidden.every, hidden.overlap) == (5, 1)
    assert hidden.share == step_share(link, 2.0, 800_000, 5, 1) < step_share(link, 2.0, 800_000, 4) / 100
    # A round length given (a learning knob) is kept; the longest round caps what the link asks.
    assert choose(link, step_s=2.0, model_bytes=800_000, every=10, overlap_ok=False).every == 10
    capped = choose(Link(0.001, 1 * MBIT), step_s=0.01, model_bytes=10_000_000, max_every=50, overlap_ok=False)
    assert capped.every == 50 and capped.share > 0.05 and "the longest" in capped.reason
    # Local asked for (without H): never exact, even on a fast link.
    assert choose(Link(1e-4, 10_000 * MBIT), 0.1, 4_000_000, modes=("local",)).mode == "local"


def test_lateness_is_the_slowest_workers_lead_over_the_mean_for_a_round():
    # The other worker alternates 0.2 s slower and faster than this one: each step's exchange waits on it (its lead
    # over the two's mean: 0.1 s), a round of two steps not at all.
    late = Lateness([[1.0, 1.0, 1.0, 1.0], [1.2, 0.8, 1.2, 0.8]])
    assert late.seconds(1) == pytest.approx(0.1)
    assert late.seconds(2) == pytest.approx(0.0)
    # Rounds longer than half the steps measured: the longest measured, grown as the root of the ratio.
    steady = Lateness([[1.0] * 4, [1.1] * 4])  # one worker 0.1 s slower every step (shares not yet balanced)
    assert steady.seconds(2) == pytest.approx(0.1) and steady.seconds(8) == pytest.approx(0.1 * 2)
    assert Lateness([[1.0, 2.0]]).seconds(1) == 0.0 and Lateness([[], []]).seconds(3) == 0.0


def test_a_fast_link_between_noisy_workers_takes_short_rounds():
    link, step_s, nbytes = Link(1e-4, 10_000 * MBIT), 0.5, 4_000_000  # 3.3 ms a sum: exact waits 0.7%
    assert choose(link, step_s, nbytes).mode == "exact"
    # Step times that jitter by 10% between workers: exact would wait for the slowest a tenth of every step.
    gen = torch.Generator().manual_seed(0)
    times = (step_s * (1 + 0.1 * torch.randn(2, 25, generator=gen))).tolist()
    late = Lateness(times)
    noisy = choose(link, step_s, nbytes, late=late)
    assert noisy.mode == "local" and noisy.share <= 0.05 < step_share(link, step_s, nbytes, late=late)
    assert f"the slowest worker {late.seconds(1) * 1e3:.0f} ms late a step" in noisy.reason
    assert late.seconds(noisy.every) < noisy.every * late.seconds(1)  # the noise of a round's steps partly cancels


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Pending:
    def __init__(self, clock: FakeClock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    def wait(self) -> float:
        self.clock.t += self.seconds
        return self.seconds


class MirroredSync:
    """Two workers in one process: the other is this one's mirror image (the same samples' share, the same updates),
    so every sum is twice this worker's and every gather holds it twice; sums take the fake link's time."""

    rank, world_size = 0, 2

    def __init__(self, link: Link, clock: FakeClock) -> None:
        self.link, self.clock = link, clock
        self.compressed = False

    def _seconds(self, tensors) -> float:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return self.link.seconds(nbytes / 2 if self.compressed else nbytes)

    def all_reduce_gradients(self, params):
        grads = [p.grad for p in params if p.grad is not None]
        for g in grads:
            g.mul_(2)
        return Pending(self.clock, self._seconds(grads)).wait()

    def overlapped(self, params):
        return None

    def gather_rows(self, ids, grads):
        return torch.cat([ids, ids]), torch.cat([grads, grads])

    def sum_floats(self, values):
        return [2 * v for v in values]

    def gather_floats(self, values):
        return [list(values), list(values)]

    def gather_objects(self, obj):
        return [obj, obj]

    def any(self, flag):
        return flag

    def broadcast_object(self, obj):
        return obj

    def sum_tensors(self, tensors):
        for t in tensors:
            t.mul_(2)
        return Pending(self.clock, self._seconds(tensors))

    def set_compression(self, on):
        self.compressed = on

    def compression_state(self):
        return None

    def load_compression_state(self, residual):
        pass


def test_measure_link_on_a_faked_link():
    clock = FakeClock()
    link, seconds = measure_link(MirroredSync(Link(0.003, 50 * MBIT), clock), torch.device("cpu"), 8 << 20, clock=clock)
    assert link.latency_s == pytest.approx(0.003, rel=1e-3)
    assert link.bytes_per_s == pytest.approx(50 * MBIT, rel=1e-3)
    assert seconds == pytest.approx(clock.t)


def scripted_steps(trainer, compute_s: float, clock) -> None:
    """Each step took `compute_s` without sync (the faked step time), plus what its sync took; the run's sync
    strategy reads the faked clock."""
    step = trainer.train_step

    def timed(*args, **kwargs):
        result = step(*args, **kwargs)
        result.seconds = compute_s + result.sync_seconds
        return result

    trainer.train_step = timed
    trainer.strategy.clock = clock


def _run(trainer, hooks, steps):
    events = []

    class Events(Hook):
        def end_step(self, loop, step):
            events.extend(step.events)

    loop = Loop(trainer, [StepLimit(steps), *hooks, Events()], measure_peak=False)
    loop.run()
    return [e for e in events if e["event"] == "sync-choice"]


def test_the_run_chooses_from_the_faked_link_and_step(tiny):
    # 0.5 s a step against a 20 Mbit/s link: exact would wait most of it, so the run takes local rounds.
    clock = FakeClock()
    link = Link(0.001, 20 * MBIT)
    config = tiny(training={"sync_mode": "auto", "sync_overlap": 0})
    trainer = Trainer(config, sync=MirroredSync(link, clock))
    modes = trainer.strategy
    scripted_steps(trainer, 0.5, clock)
    choices = _run(trainer, [], steps=sync_modes.PROBE_STEPS + 4)
    expected = choose(modes.link, 0.5, modes.model_bytes, overlap=0)
    assert modes.link.bytes_per_s == pytest.approx(link.bytes_per_s, rel=1e-3)
    assert expected.every > 1
    assert [(c["step"], c["mode"], c["every"]) for c in choices] == [(sync_modes.PROBE_STEPS, "local", expected.every)]
    assert choices[0]["step_s"] == pytest.approx(0.5)
    assert math.isclose(choices[0]["predicted_share"], expected.share)
    assert trainer.strategy.steps_alone and modes.summary()["sync_mode"] == "local"
    trainer.close()


def test_a_drifting_share_measures_again_and_chooses_again(tiny, monkeypatch, caplog):
    # A fast link (exact) that turns slow mid-run: the measured share leaves the prediction, the run re-measures
    # and moves to local rounds, and says what it measured, through which interface, against the link before.
    monkeypatch.setattr(sync_modes, "CHECK_EVERY", 4)
    clock = FakeClock()
    sync = MirroredSync(Link(1e-5, 100_000 * MBIT), clock)
    sync.interface = "bridge0"  # a Thunderbolt bridge, as a cluster's run binds it
    trainer = Trainer(tiny(training={"sync_mode": "auto", "sync_overlap": 0}), sync=sync)
    scripted_steps(trainer, 0.5, clock)

    class Slowdown(Hook):
        def before_step(self, loop):
            if trainer.step == 5:
                sync.link = Link(0.001, 5 * MBIT)

    choices = _run(trainer, [Slowdown()], steps=12)
    assert [c["mode"] for c in choices] == ["exact", "local"]
    assert choices[1]["measured_share"] > 0.05 and choices[1]["step"] >= 7
    assert "measured_share" not in choices[0] and "link_before" not in choices[0]
    assert choices[0]["interface"] == choices[1]["interface"] == "bridge0"
    assert choices[1]["link"]["mbit_s"] == pytest.approx(5, rel=1e-3)
    assert choices[1]["link_before"] == {**choices[0]["link"], "step": choices[0]["step"]}
    said = f"step {choices[1]['step']}: the sync's link through bridge0 measured again: 5.0 Mbit/s and 1.00 ms a sum"
    assert f"{said}, 100000 Mbit/s at step {choices[0]['step']}" in caplog.text
    trainer.close()


@pytest.mark.parametrize(("mode", "every", "measured"), [("local", 4, True), ("exact", None, False)])
def test_rounds_set_by_hand_measure_the_link_their_sum_crosses(tiny, mode, every, measured):
    # An inner step of a round set by hand sums nothing, so the run measures what the round's sum costs (the report
    # shows it; an elastic run's deadline is drawn from it). Exact sync's steps time their own sums.
    clock = FakeClock()
    link = Link(0.002, 30 * MBIT)
    trainer = Trainer(tiny(training={"sync_mode": mode, "sync_every": every}), sync=MirroredSync(link, clock))
    scripted_steps(trainer, 0.5, clock)
    choices = _run(trainer, [], steps=2)
    assert [(c["mode"], c["every"], c["reason"]) for c in choices] == [(mode, every, "set by training.sync_mode")]
    if measured:
        assert trainer.strategy.link.bytes_per_s == pytest.approx(link.bytes_per_s, rel=1e-3)
        assert choices[0]["link"]["mbit_s"] == pytest.approx(30, rel=1e-3)
    else:
        assert trainer.strategy.link is None and "link" not in choices[0]
    trainer.close()


class LateOther(MirroredSync):
    """The other worker is `late` s slower than this one on odd steps and as much faster on even ones: each exact sum
    of an odd step waits for it, and the gathered step times (CHECK_EVERY of them) show its."""

    def __init__(self, link: Link, clock: FakeClock, late: float) -> None:
        super().__init__(link, clock)
        self.late, self.sums = late, 0

    def all_reduce_gradients(self, params):
        self.sums += 1
        waited = self.late if self.sums % 2 else 0.0
        self.clock.t += waited
        return super().all_reduce_gradients(params) + waited

    def gather_floats(self, values):
        if len(values) != sync_modes.CHECK_EVERY:
            return super().gather_floats(values)
        return [list(values), [v + (self.late if i % 2 else -self.late) for i, v in enumerate(values)]]


def test_waiting_for_a_noisy_worker_moves_exact_sync_to_rounds(tiny, monkeypatch):
    # A fast link: exact at first; then every other step waits 0.1 s for the other worker, 9% of a 0.5 s step, which
    # the link does not explain: the run counts the lateness it measured and takes rounds, in which it cancels out.
    monkeypatch.setattr(sync_modes, "CHECK_EVERY", 4)
    clock = FakeClock()
    trainer = Trainer(tiny(training={"sync_mode": "auto"}), sync=LateOther(Link(1e-5, 100_000 * MBIT), clock, 0.1))
    scripted_steps(trainer, 0.5, clock)
    choices = _run(trainer, [], steps=12)
    assert [c["mode"] for c in choices] == ["exact", "local"], choices
    assert choices[1]["measured_share"] > 0.05 >= choices[1]["predicted_share"]
    assert "the slowest worker 50 ms late a step" in choices[1]["reason"]
    trainer.close()


def test_outer_step_is_sgd_with_nesterov_momentum(tiny):
    # The rounds' outer optimizer against torch's SGD (nesterov) on the same pseudo-gradients.
    trainer = Trainer(tiny())
    rounds = Local(trainer, trainer.sync, 2, outer_lr=0.7, outer_momentum=0.9)
    reference = [p.detach().clone().requires_grad_() for p in rounds.globals]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        deltas = [torch.randn(p.shape, generator=gen) for p in reference]
        for d, mine in zip(deltas, rounds.deltas, strict=True):
            mine.copy_(d)
        for d, p in zip(deltas, reference, strict=True):
            p.grad = d.clone()
        rounds._outer_step()
        sgd.step()
    for g, p in zip(rounds.globals, reference, strict=True):
        torch.testing.assert_close(g, p.detach(), rtol=1e-6, atol=1e-7)
    trainer.close()
