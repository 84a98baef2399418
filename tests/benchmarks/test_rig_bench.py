"""`python -m benchmarks rig` without the hosts: its rows against the solo sums, and its refusals. The hosts
themselves are exercised by the cluster tests."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import rig, rig_paths
from benchmarks.link_models import LinkModel
from benchmarks.rig import RigRun
from benchmarks.rig_paths import PathRun
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


def test_a_row_also_reads_the_run_against_the_solo_runs_side_by_side():
    runs = _round(0, [10.0, 5.0, 5.0], [("unshaped", 18.0, "exact")])
    side = zip(rig.HOSTS, [9.0, 5.0, 6.0], strict=True)
    runs += [RigRun(0, h.name, "-", "together", samples_per_sec=s) for h, s in side]
    runs += _round(1, [10.0, 5.0, 5.0], [("unshaped", 16.0, "exact")])  # no side-by-side runs this round
    (row,) = rig.rows_of(runs)
    assert math.isclose(row.ratio, 0.85) and math.isclose(row.solo_sum, 20.0)
    assert math.isclose(row.together_ratio, 0.9) and math.isclose(row.together_sum, 20.0)
    text = rig.format_rows([row], runs)
    assert "solo rates (together, samples/s): studio 9.0, mba 5.0, mbp 6.0" in text, text


def test_a_failed_run_or_a_round_whose_solo_failed_counts_as_failed():
    runs = _round(0, [10.0, None, 5.0], [("unshaped", 19.0, "exact")])
    runs += _round(1, [10.0, 5.0, 5.0], [("unshaped", 18.0, "exact")])
    runs.append(RigRun(1, "all", "unshaped", "auto", error="boom"))
    (row,) = rig.rows_of(runs)
    assert (row.runs, row.failed) == (3, 2)
    assert math.isclose(row.ratio, 0.9)
    assert "(2 of 3 failed)" in rig.format_rows([row], runs)


def test_a_mode_ending_in_elastic_runs_through_raytrms_own_actors():
    assert rig.split_mode("auto/elastic") == ("auto", True, False)
    assert rig.split_mode("local:5") == ("local:5", False, False)
    assert rig.split_mode("auto/elastic/apart") == rig.split_mode("auto/apart/elastic") == ("auto", True, True)
    for bad in ("auto/elastic/elastic", "auto/fast"):
        with pytest.raises(UserError, match=f"bench mode '{bad}': expected a sync mode, then /elastic and /apart"):
            rig.split_mode(bad)
    experiment = rig.rig_experiment(LinkModel("trm", {"training": {"steps": 4}}, 2, ""), "local:5/elastic")
    assert experiment["training"] == {"steps": 4, "threads": 1, "sync_mode": "local", "sync_every": 5}


def test_bad_rates_and_modes_are_refused_before_any_host_is_made(tmp_path, monkeypatch):
    monkeypatch.setattr(rig, "cannot_make_hosts", lambda cpu: None)
    with pytest.raises(UserError, match="link rate 'fast'"):
        rig.run(["scaling"], ["unshaped", "fast"], ["auto"], 4, 2, 1, tmp_path)
    with pytest.raises(UserError, match="expected one of exact"):
        rig.run(["scaling"], ["unshaped"], ["ring"], 4, 2, 1, tmp_path)
    with pytest.raises(UserError, match="sync mode 'ring'"):
        rig.run(["scaling"], ["unshaped"], ["auto/elastic", "ring/elastic"], 4, 2, 1, tmp_path)
    assert not (tmp_path / "hosts").exists()


def test_where_hosts_cannot_be_made_it_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(rig, "cannot_make_hosts", lambda cpu: "making network namespaces needs root")
    with pytest.raises(UserError, match="not possible here: making network namespaces needs root"):
        rig.run(["scaling"], ["unshaped"], ["auto"], 4, 2, 1, tmp_path)


def _worker(rank, share, compute_s, sync_s):
    return {
        "rank": rank,
        "share": share,
        "samples_per_sec": share / compute_s,
        "compute_s": compute_s,
        "sync_s": sync_s,
    }


def test_the_fastest_workers_idle_share_is_the_slowests_compute_less_its_own_over_the_round(tmp_path):
    model = LinkModel("trm", {"training": {"global_batch_size": 64, "steps": 10}}, warmup=2, description="")
    rows = [
        {"step": 1, "workers": [_worker(0, 32, 1.0, 3.0), _worker(1, 16, 2.0, 0.1)]},  # warm-up: not counted
        {"step": 1, "event": "rebalance"},
        {"step": 5, "workers": [_worker(0, 32, 1.9, 0.2), _worker(1, 16, 2.0, 0.1), _worker(2, 16, 1.6, 0.4)]},
        {"step": 6, "workers": [_worker(0, 32, 2.0, 0.1), _worker(1, 16, 1.5, 0.6), _worker(2, 16, 1.9, 0.3)]},
        {"step": 7, "workers": [_worker(0, 32, 1.6, 0.5), _worker(1, 16, 2.1, 0.0), _worker(2, 16, 2.0, 0.1)]},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # steps 5, 6, 7: the fastest is rank 0 (32 samples); its idle 0.1/2.1, 0.0/2.1, 0.5/2.1
    assert math.isclose(rig.fastest_idle(tmp_path, model), 0.1 / 2.1)


def test_the_two_path_summary_counts_trials_choosing_the_direct_link_and_pairs_rates_by_trial():
    runs = [
        PathRun(0, "chosen", path="tb", samples_per_sec=20.0),
        PathRun(0, "lan", path="lan (--node-ip)", samples_per_sec=10.0),
        PathRun(1, "lan", path="lan (--node-ip)", samples_per_sec=14.0),
        PathRun(1, "chosen", path="tb", samples_per_sec=20.0),
        PathRun(2, "chosen", path="lan", samples_per_sec=9.0),
        PathRun(2, "lan", error="boom"),
    ]
    s = rig_paths.summary(runs)
    assert (s["trials"], s["direct_chosen"], s["chosen_runs"], s["failed"]) == (3, 2, 3, 1)
    assert s["ratios"] == [0.5, 0.7] and math.isclose(s["lan_over_chosen"], 0.6)
    text = rig_paths.format_runs(runs)
    assert "the direct link chosen in 2 of 3 trials; bound to the LAN / chosen: 0.600" in text, text
    assert "trial 2 lan: FAILED: boom" in text, text


def test_each_hosts_cores_between_two_steps_split_into_its_worker_and_the_rest(tmp_path, monkeypatch):
    from benchmarks import rig_cpu

    steps = iter([3, 5, 12])  # what the run has logged at each look
    looks = {  # each host's processes at the two looks: CPU seconds and command line
        "studio": iter(
            [
                {10: (100.0, "ray::RayTrainWorker"), 11: (50.0, "gcs_server --log_dir"), 12: (7.0, "ray::IDLE")},
                {10: (108.0, "ray::RayTrainWorker"), 11: (51.0, "gcs_server --log_dir"), 13: (1.0, "ray::IDLE")},
            ]
        ),
        "mba": iter(
            [
                {20: (30.0, "ray::ElasticWorker.run"), 21: (5.0, "raylet")},
                {20: (33.5, "ray::ElasticWorker.run"), 21: (5.5, "raylet")},
            ]
        ),
    }
    clock = iter([0.0, 10.0])
    now: dict[str, dict[int, tuple[float, str]]] = {}  # each host's processes at its latest look

    class Host:
        def __init__(self, name):
            self.name = name

        def pids(self):
            now[self.name] = next(looks[self.name])
            return list(now[self.name])

    monkeypatch.setattr(rig_cpu, "steps_logged", lambda run_dir: next(steps))
    monkeypatch.setattr(rig_cpu, "_cpu", lambda pid: {**now["studio"], **now.get("mba", {})}[pid])
    monkeypatch.setattr(rig_cpu.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(rig_cpu.time, "sleep", lambda s: None)
    with rig_cpu.CpuWatch([Host("studio"), Host("mba")], tmp_path, first=5, last=10) as watch:
        watch._thread.join(timeout=5)
    cores = watch.cores()
    # Between the two looks: the Studio's worker 8 s of CPU in 10 s, the GCS 1 s (a process gone or new is left
    # out); the MacBook's elastic worker 3.5 s, its raylet 0.5 s.
    assert set(cores) == {"studio", "mba"}
    assert math.isclose(cores["studio"].worker, 0.8) and math.isclose(cores["studio"].others, 0.1)
    assert math.isclose(cores["mba"].worker, 0.35) and math.isclose(cores["mba"].others, 0.05)
