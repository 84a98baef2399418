"""Memory-adaptive batching: scripted peaks, pressure and out-of-memory errors never change what is learned."""

from __future__ import annotations

import json

import pytest
import torch

from raytrm.errors import UserError
from raytrm.hardware.pressure import MemoryReading
from raytrm.train import checkpoint as ckpt
from raytrm.train.memory.fit import cut
from raytrm.train.memory.governor import GovernorSettings, MemoryGovernor
from raytrm.train.run.metrics import read_metrics
from raytrm.train.run.training import run_training

MiB = 2**20


def settle(gov: MemoryGovernor, line, step: int = 0) -> int:
    """Steps on the machine's memory curve `line` until the governor stops moving its cut; returns the last step."""
    moved = True
    while moved:
        step += 1
        before = gov.micro_batch
        gov.after_step(step, line(gov.micro_batch))
        moved = gov.micro_batch != before or step <= gov.settings.probe_steps
    return step


def test_governor_probes_then_approaches_its_choice_under_the_budget():
    gov = MemoryGovernor(budget_bytes=1000 * MiB, global_batch=256, max_micro_batch=256)
    line = lambda b: int((400 + 5 * b) * MiB)  # noqa: E731 - the machine's true memory curve
    seen = []
    for step in range(1, 7):
        seen.append(gov.micro_batch)
        gov.after_step(step, line(gov.micro_batch))
    # Increasing probe cuts, smallest first; then (0.9 x 1000 - 400) / 5 = 100 samples, at most doubling a step.
    assert seen == [4, 8, 16, 32, 64, 100]
    assert gov.target == 100 and gov.micro_batch == 100
    moves = [(e["event"], e["micro_batch_to"]) for e in gov.events]
    assert moves == [("choose", 32), ("approach", 64), ("approach", 100)]
    assert "micro-batch 100" in gov.events[0]["reason"]


def test_a_probe_past_the_budget_skips_the_larger_probes():
    """Probe cuts are fixed small ones; where one already peaks past the high-water mark, the larger would go further
    (a Hugging Face model's probes run at max length), so the governor fits on what it measured."""
    gov = MemoryGovernor(budget_bytes=1000 * MiB, global_batch=256, max_micro_batch=256)
    line = lambda b: int((400 + 80 * b) * MiB)  # noqa: E731 - 4 -> 720 MiB, 8 -> 1040 MiB (past 950), 16 -> 1680
    seen = []
    for step in range(1, 5):
        seen.append(gov.micro_batch)
        gov.after_step(step, line(gov.micro_batch))
    assert seen == [4, 8, 6, 6] and gov.target == 6  # (0.9 x 1000 - 400) / 80 = 6.25: the cut at 16 never ran
    held = MemoryGovernor(1000 * MiB, 64, 64, probe_cuts=(4, 8, 16), hold=True)
    for step, probed in enumerate((4, 8), start=1):
        held.after_step(step, line(probed))
    assert held.micro_batch == 64 and held.predicted_peak(64) == pytest.approx(line(64), rel=1e-6)  # a trial stops


def test_the_governor_measures_while_it_probes_and_approaches_and_not_once_settled():
    """The steps whose peaks go into the fit are the ones a task runs at its widest (raytrm.train.loop.Cut)."""
    gov = MemoryGovernor(budget_bytes=1000 * MiB, global_batch=256, max_micro_batch=256)
    line = lambda b: int((400 + 5 * b) * MiB)  # noqa: E731 - the machine's true memory curve
    measuring = []
    for step in range(1, 9):
        measuring.append(gov.measuring)
        gov.after_step(step, line(gov.micro_batch))
    # Probes at 4, 8, 16, the approach through 32 and 64 to 100; then settled at 100.
    assert measuring == [True] * 5 + [False] * 3 and gov.settled
    held = MemoryGovernor(1000 * MiB, 64, 64, probe_cuts=(16, 32), hold=True)
    assert held.measuring
    held.after_step(1, line(16)), held.after_step(2, line(32))
    assert not held.measuring and held.micro_batch == 64  # a trial's asked cut, measured as drawn


def test_points_of_an_earlier_run_start_the_governor_at_its_choice_without_a_probe():
    """A GPU compiles each new cut: a second run of the model starts where the first settled, and keeps adapting."""
    line = lambda b: int((400 + 5 * b) * MiB)  # noqa: E731 - the machine's true memory curve
    first = MemoryGovernor(budget_bytes=1000 * MiB, global_batch=256, max_micro_batch=256)
    assert not first.settled
    settle(first, line)
    assert first.settled and first.micro_batch == 100
    kept = first.measured_points()
    assert [cut for cut, _ in kept] == [8, 16, 32, 64, 100]  # the warm-up step's point left out, as the fit does

    second = MemoryGovernor(budget_bytes=1000 * MiB, global_batch=256, max_micro_batch=256, known_points=tuple(kept))
    assert (second.micro_batch, second.probing, second.settled) == (100, False, True)
    assert second.events[0]["event"] == "choose" and "earlier run" in second.events[0]["reason"]
    second.after_step(1, line(100))
    assert second.micro_batch == 100
    second.after_step(2, int(990 * MiB))  # above the high-water mark: it still shrinks
    assert second.micro_batch < 100
    # A smaller budget on the same machine: the kept fit chooses for it; a lone point fits nothing and is probed.
    small = MemoryGovernor(budget_bytes=600 * MiB, global_batch=256, max_micro_batch=256, known_points=tuple(kept))
    assert small.micro_batch == 28  # (0.9 x 600 - 400) / 5
    alone = MemoryGovernor(budget_bytes=1000 * MiB, global_batch=256, max_micro_batch=256, known_points=kept[:1])
    assert alone.probing and alone.micro_batch == 4


@pytest.mark.slow
def test_a_run_keeps_its_settled_points_for_the_next_run_of_the_model(tiny, tmp_path, monkeypatch):
    """Kept on GPUs only (there a cut compiles): here the store is handed in, and the second run starts at the cut
    the first settled on, with no probe steps."""
    from raytrm.fastpaths.tuned import TunedChoices
    from raytrm.train.run import memory_budget

    store = tmp_path / "memory-fit.json"
    monkeypatch.setattr(memory_budget, "_kept_fits", lambda trainer: (TunedChoices(store), "the-model"))
    config = tiny(training={"steps": 8, "memory_budget_mb": 20000, "global_batch_size": 32})
    first = run_training(config, tmp_path / "first")
    kept = json.loads(store.read_text())["the-model"]
    assert len(kept) >= 2
    second = run_training(config, tmp_path / "second")
    moves = second["memory"]["adaptations"]
    assert [(e["event"], e["step"]) for e in moves] == [("choose", 0)]
    assert moves[0]["micro_batch_to"] == first["memory"]["micro_batch"] == second["memory"]["micro_batch"]
    assert json.loads(store.read_text())["the-model"] == kept  # the started run leaves the probed points as they were


def test_a_holding_governor_probes_two_cuts_then_keeps_the_asked_one_and_predicts_it():
    """A trial's governor: it measures a quarter and a half of the asked micro-batch, fits, then holds the asked
    one whatever the fit says (the trial checks the prediction), and never re-cuts."""
    gov = MemoryGovernor(budget_bytes=500 * MiB, global_batch=64, max_micro_batch=64, probe_cuts=(16, 32), hold=True)
    line = lambda b: int((100 + 10 * b) * MiB)  # noqa: E731 - over the budget at 64: 740 MiB
    seen = []
    for step in range(1, 5):
        seen.append((gov.micro_batch, gov.probing))
        gov.after_step(step, line(gov.micro_batch), pressure="critical")
    assert seen == [(16, True), (32, True), (64, False), (64, False)]
    assert gov.predicted_peak(64) == pytest.approx(740 * MiB) and gov.events == []
    # Without a probe it holds the asked cut from the first step, and predicts nothing.
    plain = MemoryGovernor(budget_bytes=500 * MiB, global_batch=64, max_micro_batch=2, hold=True)
    assert (plain.micro_batch, plain.probing, plain.predicted_peak(2)) == (2, False, None)


def test_approach_refits_a_slope_the_probes_measured_low():
    """Probe peaks a few MiB off make the first fit's slope 20% low; the approach's refits land under the budget."""
    gov = MemoryGovernor(budget_bytes=1000 * MiB, global_batch=256, max_micro_batch=256)
    probes = {4: 420, 8: 446, 16: 478}  # the true line is 400 + 5 b: 420, 440, 480
    line = lambda b: int(probes.get(b, 400 + 5 * b) * MiB)  # noqa: E731
    last = settle(gov, line)
    assert gov.events[0]["event"] == "choose" and "micro-batch 121" in gov.events[0]["reason"]  # (900 - 414) / 4
    # Taken at once, 121 would peak at 1005 MiB, over the budget. Approached, each refit adds a larger cut measured
    # on the true line, which outweighs the probes, and the last move stops under 90% of the budget.
    assert gov.micro_batch == gov.target and line(gov.micro_batch) <= 0.9 * 1000 * MiB
    assert line(gov.micro_batch) >= 0.85 * 1000 * MiB
    assert all(e["event"] in ("choose", "approach") for e in gov.events), gov.events
    gov.after_step(last + 1, line(gov.micro_batch))  # settled: no more moves
    assert len(gov.events) == 3


def test_a_governor_restored_mid_approach_cuts_as_the_uninterrupted_one():
    line = lambda b: int((400 + 5 * b) * MiB)  # noqa: E731
    straight = MemoryGovernor(budget_bytes=1000 * MiB, global_batch=256, max_micro_batch=256)
    for step in range(1, 5):
        straight.after_step(step, line(straight.micro_batch))
    assert straight.micro_batch == 64 and straight.state_dict()["approaching"]
    restored = MemoryGovernor(budget_bytes=1000 * MiB, global_batch=256, max_micro_batch=256)
    restored.load_state_dict(json.loads(json.dumps(straight.state_dict())))  # as a checkpoint carries it
    for step in range(5, 8):
        for gov in (straight, restored):
            gov.after_step(step, line(gov.micro_batch))
    assert restored.events == straight.events and restored.micro_batch == straight.micro_batch == 100
    # A checkpoint from before the approach existed has no "approaching": it loads as not approaching.
    old = {k: v for k, v in straight.state_dict().items() if k != "approaching"}
    restored.load_state_dict(old)
    assert restored.micro_batch == 100


def test_share_cap_is_the_share_whose_held_samples_fit_beside_a_micro_batch_of_one():
    gov = MemoryGovernor(budget_bytes=1000 * MiB, global_batch=256, max_micro_batch=256)
    assert gov.share_cap(200, MiB) is None  # nothing measured yet
    step = settle(gov, lambda b: int((400 + 5 * b) * MiB))
    assert gov.micro_batch == 100
    # The last peak, 900 MiB at micro-batch 100, holds 405 MiB at micro-batch 1: 495 MiB more fit under 900.
    assert gov.share_cap(200, MiB) == 695
    assert gov.share_cap(200, 10 * MiB) == 249
    assert gov.share_cap(200, 0) is None  # held samples that cost nothing cap nothing
    gov.after_step(step + 1, 940 * MiB)  # the process holds 40 MiB more at the same micro-batch: 40 samples fewer
    assert gov.micro_batch == 100 and gov.share_cap(200, MiB) == 655


def test_governor_shrinks_on_a_high_peak_or_pressure_and_grows_back():
    settings = GovernorSettings(grow_after=3)
    gov = MemoryGovernor(budget_bytes=1000 * MiB, global_batch=256, max_micro_batch=256, settings=settings)
    step = settle(gov, lambda b: int((400 + 5 * b) * MiB))
    assert gov.micro_batch == 100
    gov.after_step(step + 1, 500 * MiB, pressure="warn")  # the system is short of memory: shed load
    assert gov.micro_batch < 100 and gov.events[-1]["event"] == "shrink" and "pressure warn" in gov.events[-1]["reason"]
    for calm in range(step + 2, step + 5):  # calm again: back to the target
        gov.after_step(calm, 500 * MiB)
    assert gov.micro_batch == 100 and gov.events[-1]["event"] == "grow"
    gov.after_step(step + 5, 990 * MiB)  # a peak above the high-water mark: the fit was optimistic
    assert gov.micro_batch < 100 and gov.target == gov.micro_batch


def test_a_high_peak_during_the_approach_ends_it():
    gov = MemoryGovernor(budget_bytes=1000 * MiB, global_batch=256, max_micro_batch=256)
    for step in range(1, 4):
        gov.after_step(step, int((400 + 5 * gov.micro_batch) * MiB))
    assert gov.micro_batch == 32
    gov.after_step(4, 980 * MiB)  # 32 samples took far more than the line said
    assert gov.events[-1]["event"] == "shrink" and gov.micro_batch < 32
    moved = len(gov.events)
    gov.after_step(5, 600 * MiB)
    assert len(gov.events) == moved  # no approach after a shrink; calm steps grow back to the (lowered) target


def test_governor_halves_on_out_of_memory_and_refuses_an_impossible_budget():
    gov = MemoryGovernor(budget_bytes=1000 * MiB, global_batch=64, max_micro_batch=64)
    assert gov.on_out_of_memory(1) == 2  # from the first probe cut, 4
    tiny_budget = MemoryGovernor(budget_bytes=100 * MiB, global_batch=64, max_micro_batch=64)
    with pytest.raises(UserError, match="below what training needs before any sample"):
        for step in range(1, 4):
            tiny_budget.after_step(step, 300 * MiB)


class ScriptedMemory:
    """Pressure by step, as a MemoryReader would report it."""

    def __init__(self, pressure_at: dict[int, str]) -> None:
        self.pressure_at, self.calls = pressure_at, 0

    def read(self, detailed: bool = False) -> MemoryReading:
        self.calls += 1
        return MemoryReading(pressure=self.pressure_at.get(self.calls))


@pytest.mark.slow
def test_scripted_pressure_and_out_of_memory_change_nothing_learned(tiny, tmp_path, fail_forward):
    lr = 3e-3
    plain = run_training(tiny(training={"steps": 8, "lr": lr}), tmp_path / "plain")

    # Out-of-memory errors raised by the allocator at the 9th and 20th micro-batch forwards (CUDA and MPS raise;
    # here a scripted one stands in), plus scripted pressure at steps 5 and 6.
    from raytrm.models.trm import TRM

    fail_forward(TRM, at=(9, 20), message="CUDA out of memory. Tried to allocate 2.00 GiB (scripted)")
    adapted = run_training(
        tiny(training={"steps": 8, "lr": lr, "memory_budget_mb": 20000}),
        tmp_path / "adapted",
        memory_reader=ScriptedMemory({5: "warn", 6: "critical"}),
        governor_settings=GovernorSettings(grow_after=1),
    )
    events = [r for r in read_metrics(tmp_path / "adapted" / "metrics.jsonl") if "event" in r]
    kinds = [e["event"] for e in events]
    assert kinds.count("out-of-memory") == 2 and "shrink" in kinds and "grow" in kinds, events
    assert adapted["samples_seen"] == plain["samples_seen"] == 8 * 32
    a = ckpt.latest_good_checkpoint(tmp_path / "plain" / "checkpoints")
    b = ckpt.latest_good_checkpoint(tmp_path / "adapted" / "checkpoints")
    for name, value in a["model"].items():  # Adam: rounding-level differences, on the scale of its step
        torch.testing.assert_close(b["model"][name], value, rtol=0, atol=1e-2 * lr, msg=lambda m, k=name: f"{k}: {m}")
    for name in ("inputs", "labels", "steps", "halted"):  # the same examples in the same slots
        assert torch.equal(a["carry"][name], b["carry"][name]), name


@pytest.mark.slow
def test_real_budget_is_used_and_respected(sudoku_dir, tmp_path):
    """An injected 1.5 GB budget: the run stays under it by measured peak RSS and uses it: the global batch is cut
    into the fewest micro-batches the measured fit allows.

    In a process of its own, as a user's run is: the resident memory of a process that ran the suite's other tests
    holds what their allocations left behind, which no fit of this run's steps sees."""
    import subprocess
    import sys

    import yaml

    budget_mb, global_batch = 1536, 256
    config = {
        "model": {"hidden_size": 128, "L_layers": 2, "H_cycles": 2, "L_cycles": 3, "halt_max_steps": 2},
        "data": {"path": str(sudoku_dir)},
        "training": {"global_batch_size": global_batch, "steps": 6, "memory_budget_mb": budget_mb, "threads": 2},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-m", "raytrm.cli", "train", "--config", str(tmp_path / "config.yaml")]
    subprocess.run([*argv, "--out", str(tmp_path / "run"), "--quiet"], check=True, capture_output=True, timeout=600)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    memory = summary["memory"]
    assert summary["peak_method"] == "linux-vmhwm"  # the kernel's own peak of resident memory
    assert any(e["event"] == "choose" for e in memory["adaptations"])
    assert summary["peak_step_mb"] <= budget_mb
    assert memory["predicted_peak_mb"] == pytest.approx(memory["measured_peak_mb"], rel=0.15)
    # Cuts are even, so the peak lands below the fit's target by up to one cut's rounding: one micro-batch fewer
    # would have been predicted past the margin, and the peak still reaches well into the budget.
    parts = len(cut(global_batch, memory["micro_batch"]))
    fewer = cut(global_batch, -(-global_batch // (parts - 1)))[0]
    fit = memory["fit"]
    assert fit["fixed_mb"] + fewer * fit["per_sample_mb"] > (1 - GovernorSettings().margin) * budget_mb, memory
    assert summary["peak_step_mb"] >= 0.7 * budget_mb, memory


# -- a cut in padded tokens (a Hugging Face classifier) ---------------------------------------------------------------


def widest_in_flight(cut: int, width: int = 100, records: int = 64) -> int:
    """The tokens a step at its widest has in flight under a token cut: whole records at max length."""
    return max(1, min(records, cut // width)) * width


def test_a_governor_in_tokens_probes_whole_records_and_fits_on_the_tokens_in_flight():
    """Records at max length 100: the probe's cuts are whole records, each step's point is the tokens it had in
    flight (whole records, under the cut), and the fit's line chooses a cut that need not be whole records."""
    gov = MemoryGovernor(1000 * MiB, global_batch=6400, max_micro_batch=6400, unit="tokens", widest_sample=100)
    line = lambda tokens: int((400 + 0.11 * tokens) * MiB)  # noqa: E731 - the machine's true memory curve
    seen = []
    for step in range(1, 7):
        seen.append(gov.micro_batch)
        size = widest_in_flight(gov.micro_batch)
        gov.after_step(step, line(size), size=size)
    # The warm-up at one record, probes of 4 and 8; then (0.9 x 1000 - 400) / 0.11 = 4545 tokens, at most doubling.
    assert seen == [100, 400, 800, 1600, 3200, 4545] and gov.target == 4545
    assert [cut for cut, _ in gov.measured_points()] == [400, 800, 1600, 3200, 4500]  # 4545 tokens: 45 records
    assert gov.predicted_peak(4500) == pytest.approx(line(4500), rel=1e-9)
    assert all(e["unit"] == "tokens" for e in gov.events)
    assert "MiB/token" in gov.events[0]["reason"] and "micro-batch 4545 tokens" in gov.events[0]["reason"]
    summary = gov.summary()
    assert summary["micro_batch_unit"] == "tokens" and summary["fit"]["per_token_mb"] == pytest.approx(0.11)


def test_a_governor_in_tokens_moves_by_whole_records_and_never_below_one():
    gov = MemoryGovernor(1000 * MiB, global_batch=6400, max_micro_batch=6400, unit="tokens", widest_sample=100)
    line = lambda tokens: int((400 + 0.11 * tokens) * MiB)  # noqa: E731
    for step in range(1, 6):
        size = widest_in_flight(gov.micro_batch)
        gov.after_step(step, line(size), size=size)
    assert gov.micro_batch == 4545
    # A peak above the high-water mark at 45 records: the refit, on 960 MiB at 4500 tokens, moves the cut down.
    gov.after_step(6, 960 * MiB, size=4500)
    assert gov.events[-1]["event"] == "shrink" and gov.micro_batch == 4177
    small = MemoryGovernor(1000 * MiB, global_batch=6400, max_micro_batch=6400, unit="tokens", widest_sample=100)
    small.load_state_dict(gov.state_dict())
    small.after_step(7, 960 * MiB, size=4100)  # a refit that would barely move: still one record at max length
    assert small.micro_batch <= 4177 - 100
    # Pressure keeps three quarters; out of memory halves, down to one record, and then there is nothing to cut.
    gov.after_step(7, 500 * MiB, pressure="warn", size=widest_in_flight(gov.micro_batch))
    assert gov.micro_batch == 4177 * 3 // 4
    assert [gov.on_out_of_memory(8 + i) for i in range(5)] == [1566, 783, 391, 195, 100]
    with pytest.raises(MemoryError, match="micro-batch 100 tokens"):
        gov.on_out_of_memory(20)
    # A fit that has no room for even one record at max length still cuts one record at a time.
    tight = MemoryGovernor(500 * MiB, global_batch=6400, max_micro_batch=6400, unit="tokens", widest_sample=100)
    for step in range(1, 3):
        size = widest_in_flight(tight.micro_batch)
        tight.after_step(step, int((440 + 0.11 * size) * MiB), size=size)
    assert (tight.micro_batch, tight.target) == (100, 100)  # (450 - 440) / 0.11 = 90 tokens: less than one record


def test_a_checkpoints_governor_in_samples_is_patched_to_tokens():
    """A run that checkpointed before a classifier's cut counted tokens: its cuts were records at max length."""
    line = lambda b: int((400 + 11 * b) * MiB)  # noqa: E731
    old = MemoryGovernor(budget_bytes=1000 * MiB, global_batch=64, max_micro_batch=64)
    for step in range(1, 5):
        old.after_step(step, line(old.micro_batch))
    state = {k: v for k, v in old.state_dict().items() if k != "unit"}  # as written before the unit was kept
    new = MemoryGovernor(1000 * MiB, global_batch=6400, max_micro_batch=6400, unit="tokens", widest_sample=100)
    new.load_state_dict(json.loads(json.dumps(state)))
    assert new.micro_batch == 100 * old.micro_batch and new.target == 100 * old.target
    assert [b for b, _ in new.measured_points()] == [100 * b for b, _ in old.measured_points()]
    assert new.predicted_peak(100 * old.micro_batch) == pytest.approx(old.predicted_peak(old.micro_batch))
