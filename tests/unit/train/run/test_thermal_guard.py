"""The thermal guard through lower-load, pause and recovery, from scripted states and from throughput alone."""

from __future__ import annotations

from pathlib import Path

from raytrm.hardware.thermal import parse_powermetrics_thermal
from raytrm.train.run.thermal_guard import GuardSettings, ThermalGuard

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "macos"


def drive(guard: ThermalGuard, states: list[str | None], rate: float = 100.0) -> list:
    return [guard.observe(step, state, rate) for step, state in enumerate(states, start=1)]


def test_scripted_states_go_through_lower_load_pause_and_recovery():
    guard = ThermalGuard(
        cap="fair", action="threads", threads=8, settings=GuardSettings(patience=2, recover_after=3, pause_s=30)
    )
    decisions = drive(guard, ["nominal", "fair", "serious", "serious", "serious", "critical", "fair", "fair", "fair"])
    kinds = [d.event["event"] if d.event else None for d in decisions]
    assert kinds == [None, None, "thermal-lower-load", None, "thermal-pause", None, None, None, "thermal-recover"]
    assert decisions[2].threads == 4  # half the threads first
    assert decisions[4].pause_s == 30  # still hot at lowered load: cool down
    assert decisions[8].threads == 8  # back to full load
    assert guard.hottest == "critical"


def test_micro_batch_action_halves_then_restores():
    guard = ThermalGuard(cap="serious", action="micro_batch", threads=4, settings=GuardSettings(recover_after=1))
    lowered, restored = drive(guard, ["critical", "nominal"])
    assert lowered.micro_batch_scale == 0.5 and restored.micro_batch_scale == 2.0


def test_recorded_powermetrics_state_feeds_the_guard():
    state = parse_powermetrics_thermal((FIXTURES / "powermetrics_thermal_m2_air.txt").read_text())
    guard = ThermalGuard(cap="nominal", action="threads", threads=4)
    decision = guard.observe(1, state, 10.0)
    assert (decision.event is not None) == (state != "nominal")


def test_throughput_decline_reads_as_throttling_without_a_sensor():
    settings = GuardSettings(warmup_steps=2, baseline_steps=4, window=5, decline=0.25, patience=100)
    guard = ThermalGuard(cap="fair", action="threads", threads=4, settings=settings)
    rates = [50, 60] + [100, 101, 99, 100] + [98, 102, 100, 97, 99] + [70] * 5
    events = [guard.observe(step, None, rate).event for step, rate in enumerate(rates, start=1)]
    fired = [e for e in events if e]
    assert len(fired) == 1 and fired[0]["event"] == "thermal-lower-load"
    assert "throughput decline" in fired[0]["reason"]
    # Only once most of the window is slow: the third slow step makes the window's median fall 30%.
    assert events.index(fired[0]) == len(rates) - 3


class ScriptedThermal:
    def __init__(self, states: list[str]) -> None:
        self.states = iter(states)

    def read(self) -> dict:
        return {"thermal_state": next(self.states, "nominal")}


def test_the_training_loop_applies_and_logs_the_guard(tiny, tmp_path):
    from raytrm.train.run.metrics import read_metrics
    from raytrm.train.run.training import run_training

    states = ["nominal", "critical", "critical", "nominal", "nominal", "nominal"]
    summary = run_training(
        tiny(training={"steps": 6, "thermal_cap": "fair", "thermal_action": "micro_batch", "grad_accum_steps": 1}),
        tmp_path,
        thermal_reader=ScriptedThermal(states),
    )
    events = [r["event"] for r in read_metrics(tmp_path / "metrics.jsonl") if "event" in r]
    assert events == ["thermal-lower-load"]
    assert summary["thermal_max"] == "critical" and summary["thermal_cap"] == "fair"
    assert summary["micro_batches"] == [16, 16]  # halved from one micro-batch of 32; the global batch is intact
    assert summary["samples_seen"] == 6 * 32
