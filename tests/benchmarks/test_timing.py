import types

import pytest
import torch

from benchmarks import timing
from benchmarks.timing import compiled_as_run, count_flops, measure_side_by_side, onednn_columns
from raytrm.fastpaths import onednn


def test_flops_of_a_compiled_call_are_counted_eagerly_without_tracing_a_graph():
    a, b = torch.randn(32, 48), torch.randn(48, 16)
    traced = []

    def backend(graph, example_inputs):
        traced.append(graph)
        return graph.forward

    product = torch.compile(lambda: a @ b, backend=backend)
    assert count_flops(product) == 2 * 32 * 48 * 16
    assert traced == []  # no graph was compiled for the counter
    product()
    assert len(traced) == 1  # outside the counter the call compiles as usual


@pytest.mark.slow
def test_side_by_side_rows_carry_the_first_steps_ratio_to_the_second():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    first, second = measure_side_by_side([lambda: a @ b, lambda: (a @ b) @ b], torch.device("cpu"), torch.float32, 1, 8)
    assert first["gflop_per_step"] * 2 == second["gflop_per_step"] == 2 * 2 * 64**3 / 1e9
    assert first["ratio"] == pytest.approx(first["samples_per_sec"] / second["samples_per_sec"])
    assert second["ratio"] is None
    alone = measure_side_by_side([lambda: a @ b], torch.device("cpu"), torch.float32, 1, 8)
    assert [r["ratio"] for r in alone] == [None]


def test_the_ratio_pairs_each_round_so_a_slow_spell_does_not_fall_on_one_row(monkeypatch):
    """The machine slows 3x from the middle of round 2 on: the first step's median catches the spell, the second's
    does not (its medians' ratio would be 20 / 30 ms), while every round's two steps, timed back to back, keep 1:2.

    The steps advance a clock of the test's own: sleeps overshoot by the scheduler's delays on a loaded machine, and
    one such overshoot moves a median of three."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(timing, "matmul_flops_per_sec", lambda *args, **kwargs: 1e12)
    monkeypatch.setattr(timing, "onednn_flops_per_sec", lambda *args, **kwargs: 1e12)

    def taking(*seconds):
        durations = iter([0.0, 0.0, 0.0, *seconds])  # set-up, FLOP count and warm-up calls first

        def step():
            clock.now += next(durations)

        return step

    first, second = taking(0.010, 0.030, 0.030), taking(0.020, 0.020, 0.060)
    fast, slow = timing.measure_side_by_side([first, second], torch.device("cpu"), torch.float32, 3, 8)
    assert fast["step_seconds"] == pytest.approx(0.030)  # the medians: 30 ms against 20 ms
    assert slow["step_seconds"] == pytest.approx(0.020)
    assert fast["ratio"] == pytest.approx(2.0)


def test_a_bench_row_says_compiled_only_where_every_region_ran_compiled():
    def trainer(compiled, failed=None):
        region = types.SimpleNamespace(failed=failed)
        return types.SimpleNamespace(model=types.SimpleNamespace(_round=region), compiled=compiled)

    assert compiled_as_run(trainer(["_round"]), "cudagraphs") == "cudagraphs"
    assert compiled_as_run(trainer(["_round"], failed="BackendCompilerFailed: ..."), "on") == "off"
    assert compiled_as_run(trainer([]), "on") == "off"  # the plan stayed eager (a CPU without a C++ compiler)


@pytest.mark.slow
def test_on_a_cpu_with_onednn_rows_carry_its_ceiling_beside_torch_mms(monkeypatch):
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    [row] = measure_side_by_side([lambda: a @ b], torch.device("cpu"), torch.float32, 1, 8)
    if onednn.ENABLED:
        assert row["onednn_gflops"] > 0
        assert row["fraction_of_onednn"] == pytest.approx(row["gflops"] / row["onednn_gflops"])
        assert onednn_columns(types.SimpleNamespace(**row)).split() == [
            f"{row['onednn_gflops']:.1f}",
            f"{row['fraction_of_onednn']:.2f}",
        ]
    monkeypatch.setattr(onednn, "ENABLED", False)
    [row] = measure_side_by_side([lambda: a @ b], torch.device("cpu"), torch.float32, 1, 8)
    assert row["onednn_gflops"] is None and row["fraction_of_onednn"] is None
    assert onednn_columns(types.SimpleNamespace(**row)).strip() == ""
