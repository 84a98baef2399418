"""`python -m benchmarks mix`: one row per way this device runs TRM-MLP's position mixing, timed in alternation."""

from __future__ import annotations

import json

import pytest

from benchmarks import mix
from benchmarks.cli import main
from raytrm.train.compile import CompilePlan


@pytest.fixture
def eager_only(monkeypatch):
    """A device that does not compile (inductor's CPU build would take most of the test)."""
    monkeypatch.setattr(mix, "plan_compile", lambda *a, **k: CompilePlan(None, None, "test: eager"))


def test_a_cpu_without_triton_times_the_plain_formulas_whole_and_in_column_blocks(eager_only, monkeypatch):
    monkeypatch.setattr(mix.triton, "INTERPRETED", False)
    rows = mix.bench_mix(batch=2, hidden=16, device="cpu", dtype="float32", repeats=3, positions=9)
    assert [r.impl for r in rows] == ["plain", "column blocks"]
    row = rows[0]
    assert (row.positions, row.columns, row.device, row.dtype, row.ratio) == (9, 32, "cpu", "float32", 1.0)
    inner = 256  # swiglu_width(9, 4.0)
    assert row.tflops == pytest.approx(2 * 32 * 3 * 9 * inner / (row.ms * 1e-3) / 1e12)


def test_the_kernel_rows_appear_where_it_runs(eager_only, monkeypatch):
    monkeypatch.setattr(mix.triton, "mix_why_not", lambda x, *weights: None)
    monkeypatch.setattr(mix.triton, "mix_positions_norm", lambda x, *weights: x + 0)
    rows = mix.bench_mix(batch=2, hidden=16, device="cpu", dtype="bfloat16", repeats=2, positions=9)
    assert [r.impl for r in rows] == ["plain", "column blocks", "kernel"]
    assert rows[2].ratio == pytest.approx(rows[0].ms / rows[2].ms)


def test_cli_writes_the_rows_as_json(eager_only, tmp_path, capsys):
    out = tmp_path / "mix.json"
    assert main(["mix", "--batch", "2", "--hidden", "8", "16", "--repeats", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "mix" and [r["columns"] for r in doc["results"]] == [16, 16, 32, 32]
    assert doc["command"] == f"python -m benchmarks mix --batch 2 --hidden 8 16 --repeats 2 --json {out}"
    assert "plain" in capsys.readouterr().out
