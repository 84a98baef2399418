"""The memory benchmark runs end to end at a tiny width and refuses checks that would be cut unevenly."""

from __future__ import annotations

import math

import pytest

from benchmarks.memory import bench_memory, format_rows


@pytest.mark.slow
def test_memory_bench_rows(tmp_path):
    rows, overhead = bench_memory([16], [16, 32], threads=1, work_dir=tmp_path)
    assert [r.micro_batch for r in rows] == [16, 32]
    assert all(r.measured_mb > 0 and math.isfinite(r.error) for r in rows)
    assert overhead[0].monitor_seconds > 0 and overhead[0].overhead < 1
    assert "overhead" in format_rows(rows, overhead)


@pytest.mark.slow
def test_checks_must_divide_the_global_batch(tmp_path):
    with pytest.raises(ValueError, match="does not divide the global batch"):
        bench_memory([16], [24, 32], threads=1, work_dir=tmp_path)
