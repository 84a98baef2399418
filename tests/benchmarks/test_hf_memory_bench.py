"""The hf memory bench: its row is the steady steps' highest peak against the budget (under it, and at least 0.85 of
it), the steady steps are those after the governor's last adaptation at one cut, and a run end to end on a tiny
classifier gives a row the governor settled."""

from __future__ import annotations

import json

import pytest

from benchmarks import hf_memory
from benchmarks.cli import main
from benchmarks.hf_memory import StepPeak, budgets_for, judge, steady_tail
from raytrm.errors import UserError

MiB = 2**20


def test_the_goal_is_a_peak_under_the_budget_using_at_least_its_floor():
    assert judge([900 * MiB, 940 * MiB], 1000 * MiB) == (940 * MiB, 0.94, True)
    assert judge([850 * MiB], 1000 * MiB)[2]  # the floor itself holds
    assert not judge([849 * MiB], 1000 * MiB)[2]
    assert not judge([900 * MiB, 1000 * MiB], 1000 * MiB)[2]  # at the budget is not under it
    assert judge([800 * MiB], 1000 * MiB, floor=0.8)[2]
    with pytest.raises(ValueError, match="no steady steps"):
        judge([], 1000 * MiB)


def step(n, micro, widest=False, events=()):
    return StepPeak(n, micro, widest, 100 * n, list(events))


def test_the_steady_steps_follow_the_last_adaptation_at_one_cut():
    steps = [
        step(1, 4, widest=True),
        step(2, 8, widest=True, events=["choose"]),
        step(3, 3),
        step(4, 3, events=["shrink"]),  # peaked above the high-water mark: ran at 3, the next at 2
        step(5, 2),
        step(6, 2),
    ]
    assert [s.step for s in steady_tail(steps)] == [5, 6]
    assert steady_tail(steps[:4]) == []  # the last step adapted
    assert [s.step for s in steady_tail(steps[:3])] == [3]
    assert steady_tail(steps[:2]) == []  # probe steps run at their widest
    # A cut moved without an event of this step (the heat's share) also starts a new tail.
    assert [s.step for s in steady_tail([step(1, 3), step(2, 3), step(3, 2)])] == [3]


def test_one_budget_serves_every_length_or_one_each():
    assert budgets_for([256, 512], [2600]) == [2600, 2600]
    assert budgets_for([256, 512], [1800, 2600]) == [1800, 2600]
    with pytest.raises(UserError, match="one per --max-lengths value"):
        budgets_for([256, 512], [1, 2, 3])


def test_the_row_line_says_whether_each_goal_holds():
    row = hf_memory.GovernorRow(
        max_length=512,
        global_batch=64,
        threads=2,
        budget_mb=2600,
        micro_batch=1600,
        governor_micro_batch=1600,
        records_widest=3,
        records_most=9,
        steady_steps=8,
        peak_mb=2000,
        median_peak_mb=1950,
        min_peak_mb=1900,
        fraction=2000 / 2600,
        goal=False,
        widest_peak_mb=2400,
        widest_fraction=2400 / 2600,
        widest_goal=True,
        widest_steps=2,
        predicted_mb=2300,
        full_batch_predicted_mb=20000,
        fit=None,
        steps=12,
        settled_at=5,
        seconds=1.0,
    )
    line = hf_memory.format_rows([row]).splitlines()[1]
    assert line.split() == [
        "512",
        "64",
        "2600",
        "1600",
        "3/9",
        "8",
        "1900/1950/2000",
        "0.769",
        "2400",
        "0.923",
        "2300",
        "20000",
        "no/yes",
        "12",
    ]


@pytest.mark.slow
def test_a_row_trains_under_the_governor_until_it_holds_a_cut(tmp_path, monkeypatch, capsys):
    """A tiny classifier under a budget it cannot reach: the probe at its widest, then the whole batch, held."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from tests.support.hf_models import classifier_dir, text_records

    model = classifier_dir(tmp_path / "model")
    records = text_records(tmp_path / "records.csv", 200, longest=40)
    monkeypatch.setattr("benchmarks.hf_corpus.build_corpus", lambda directory, per_label: records)
    out = tmp_path / "governor.json"
    argv = ["memory", "--model", "hf", "--model-path", str(model), "--max-lengths", "32", "--global-batch", "16"]
    argv += [
        "--budget-mb",
        "100000",
        "--steady-steps",
        "2",
        "--max-steps",
        "12",
        "--widest-steps",
        "1",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())["results"]["governor"]
    # The whole batch in one micro-batch: 16 records at max length, in padded tokens.
    assert row["max_length"] == 32 and row["steady_steps"] == 2 and row["micro_batch"] == 16 * 32
    assert row["records_widest"] == row["records_most"] == 16
    assert row["trace"][0]["widest"] and not row["trace"][-1]["widest"]
    assert row["peak_mb"] == max(s["peak_mb"] for s in row["trace"][-2:])
    assert row["widest_steps"] == 1 and row["widest_peak_mb"] > 0
    assert "peak/budget" in capsys.readouterr().out
