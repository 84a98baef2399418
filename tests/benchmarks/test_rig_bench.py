"""`python -m benchmarks rig` without the hosts: its rows against the solo sums, and its refusals. The hosts
themselves are exercised by the cluster tests."""

from __future__ import annotations

import math

import pytest

from benchmarks import rig
from benchmarks.rig import RigRun
from raytrm.errors import UserError


def _round(r, solos, runs):
    out = [RigRun(r, h.name, "-", "solo", samples_per_sec=s) for h, s in zip(rig.HOSTS, solos, strict=True)]
    return out + [RigRun(r, "all", rate, "auto", samples_per_sec=s, chosen=c) for rate, s, c in runs]


def test_a_row_is_the_median_of_each_rounds_ratio_to_its_own_solo_sum():
    runs = _round(0, [10.0, 5.0, 5.0], [("unshaped", 19.0, "exact"), ("20mbit", 16.0, "local H=5")])
    runs += _round(1, [8.0, 4.0, 4.0], [("20mbit", 12.0, "local H=10"), ("unshaped", 15.2, "exact")])
    rows = {row.rate: row for row in rig.rows_of(runs)}
    assert list(rows) == ["unshaped", "20mbit"]
    assert math.isclose(rows["unshaped"].ratio, 0.95) and rows["unshaped"].goal == 0.90
    assert math.isclose(rows["20mbit"].ratio, (0.8 + 0.75) / 2) and rows["20mbit"].goal == 0.80
    assert math.isclose(rows["20mbit"].solo_sum, 18.0)
    assert rows["20mbit"].chosen == ["local H=10", "local H=5"] and rows["20mbit"].failed == 0


def test_a_failed_run_or_a_round_whose_solo_failed_counts_as_failed():
    runs = _round(0, [10.0, None, 5.0], [("unshaped", 19.0, "exact")])
    runs += _round(1, [10.0, 5.0, 5.0], [("unshaped", 18.0, "exact")])
    runs.append(RigRun(1, "all", "unshaped", "auto", error="boom"))
    (row,) = rig.rows_of(runs)
    assert (row.runs, row.failed) == (3, 2)
    assert math.isclose(row.ratio, 0.9)
    assert "(2 of 3 failed)" in rig.format_rows([row], runs)


def test_bad_rates_and_modes_are_refused_before_any_host_is_made(tmp_path, monkeypatch):
    monkeypatch.setattr(rig, "cannot_make_hosts", lambda cpu: None)
    with pytest.raises(UserError, match="link rate 'fast'"):
        rig.run(["scaling"], ["unshaped", "fast"], ["auto"], 4, 2, 1, tmp_path)
    with pytest.raises(UserError, match="expected one of exact"):
        rig.run(["scaling"], ["unshaped"], ["ring"], 4, 2, 1, tmp_path)
    assert not (tmp_path / "hosts").exists()


def test_where_hosts_cannot_be_made_it_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(rig, "cannot_make_hosts", lambda cpu: "making network namespaces needs root")
    with pytest.raises(UserError, match="not possible here: making network namespaces needs root"):
        rig.run(["scaling"], ["unshaped"], ["auto"], 4, 2, 1, tmp_path)
