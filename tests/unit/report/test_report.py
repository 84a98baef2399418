"""`raytrm report`: plots and diagnosis of a real tiny run, each diagnosis rule on a hand-written record, the study
plots and table of a tuning run, and the one-line refusals of what is not a run."""

from __future__ import annotations

import json
import logging

import optuna
import pytest

from raytrm import config as cfg
from raytrm.cli import main
from raytrm.report import load_run, write_report
from raytrm.report.diagnosis import diagnose
from raytrm.train.run.training import run_training

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5000, path  # axes, curves and labels, not an empty canvas


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("raytrm: error: ")
    return err[0]


def line(step, **fields):
    """A step line as run.py writes it, at 100 samples/s with a busy single thread unless told otherwise."""
    return {
        "step": step,
        "samples_per_sec": 100.0,
        "loss": 2.0 - 0.01 * step,
        "lr": 1e-3,
        "rss_mb": 300.0,
        "peak_rss_mb": 300.0,
        "cpu_percent": 95.0,
        **fields,
    }


@pytest.fixture
def write_run(tiny, tmp_path):
    """Write a run directory from hand-written lines: config.yaml of the tiny TRM, metrics.jsonl, summary.json."""

    def write(lines, summary=None, name="run", **training):
        run = tmp_path / name
        run.mkdir()
        cfg.write_yaml(tiny(training={"memory_budget_mb": None, **training}), run / "config.yaml")
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        if summary is not None:
            (run / "summary.json").write_text(json.dumps(summary))
        return run

    return write


def findings(run):
    return {f.name: f for f in diagnose(load_run(run))}


@pytest.mark.slow
def test_a_real_tiny_run_gets_plots_and_a_diagnosis(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    run_training(tiny(training={"steps": 4, "eval_interval": 2, "memory_budget_mb": 8192}), run)
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    report = run / "report"
    for name in ("training.png", "throughput.png", "memory.png"):
        assert_png(report / name)
    assert (report / "diagnosis.txt").read_text() == out
    assert out.startswith(f"run {run}: 4 steps, 128 samples")
    # A tiny TRM peaks at a few hundred MiB: far under its 8 GiB budget, with the whole batch in one micro-batch.
    assert "- memory headroom unused: step peak" in out and "of the 8192 MiB budget, at micro-batch 32" in out
    assert "fix: the whole batch (32 samples) already runs as one micro-batch" in out
    assert "no thermal plot: no thermal reading recorded" in out  # no sensor on a Linux VM
    assert "not recorded, so not diagnosed: data loading time" in out
    # --out puts the same report elsewhere.
    assert main(["report", str(run), "--out", str(tmp_path / "elsewhere")]) == 0
    assert_png(tmp_path / "elsewhere" / "training.png")


def test_memory_headroom_names_the_fix_that_applies(write_run):
    lines = [line(s, peak_rss_mb=200.0) for s in range(1, 5)]
    whole = findings(write_run(lines, memory_budget_mb=1000))["memory headroom unused"]
    assert "peak RSS 200 MiB is 20% of the 1000 MiB budget, at micro-batch 32" in whole.measured
    assert "larger --global-batch" in whole.fix
    cut = write_run(lines, name="cut", memory_budget_mb=1000, micro_batch_size=8, grad_accum_steps=4)
    assert "raise --micro-batch towards 32" in findings(cut)["memory headroom unused"].fix
    busy = write_run([line(s, peak_rss_mb=800.0) for s in range(1, 5)], name="busy", memory_budget_mb=1000)
    assert "memory headroom unused" not in findings(busy)
    over = write_run([line(s, peak_rss_mb=1200.0) for s in range(1, 5)], name="over", memory_budget_mb=1000)
    assert "120% of the 1000 MiB budget" in findings(over)["over the memory budget"].measured


def test_a_finished_runs_step_peak_wins_over_the_process_peak_rss(write_run):
    # The process's peak RSS counts what it held before training (another run in the same process, a test suite);
    # the steps' own measured peak is the run's.
    lines = [line(s, peak_rss_mb=900.0) for s in range(1, 5)]
    summary = {"steps": 4, "peak_step_mb": 150.0, "peak_method": "linux-vmhwm"}
    found = findings(write_run(lines, summary=summary, memory_budget_mb=1000))
    assert "step peak (linux-vmhwm) 150 MiB is 15% of the 1000 MiB budget" in found["memory headroom unused"].measured


def test_memory_pressure_and_out_of_memory_events(write_run):
    events = [
        {"step": 2, "event": "shrink", "micro_batch_from": 32, "micro_batch_to": 16, "reason": "pressure warn"},
        {"step": 3, "event": "out-of-memory", "micro_batch_from": 16, "micro_batch_to": 8, "reason": "allocator"},
    ]
    found = findings(write_run([line(1), events[0], line(2), events[1], line(3)]))
    assert "shrank the micro-batch 1 time(s) (first at step 2)" in found["memory pressure"].measured
    assert "refused 1 step(s)" in found["out of memory"].measured


def test_serious_thermal_states_are_throttling_and_get_a_thermal_plot(write_run, capsys):
    states = ["nominal"] * 4 + ["serious"] * 3 + ["critical"]
    event = {"step": 6, "event": "thermal-lower-load", "thermal_state": "serious", "reason": "serious is above fair"}
    lines = [line(s, thermal_state=state) for s, state in enumerate(states, start=1)]
    run = write_run([*lines[:6], event, *lines[6:]], thermal_cap="fair")
    found = findings(run)["throttled"]
    assert "serious or hotter in 4 of 8 readings (hottest critical)" in found.measured
    assert "lowered the load 1 time(s)" in found.measured
    assert main(["report", str(run)]) == 0
    assert "- throttled:" in capsys.readouterr().out
    assert_png(run / "report" / "thermal.png")


def test_a_throughput_decline_without_a_sensor_reads_as_throttling(write_run):
    rates = [100.0] * 6 + [60.0] * 6
    found = findings(write_run([line(s, samples_per_sec=r) for s, r in enumerate(rates, start=1)]))["throttled"]
    assert "samples/s fell 40% over steps 2-12 at unchanged settings (no sensor answered" in found.measured
    steady = write_run([line(s) for s in range(1, 13)], name="steady")
    assert "throttled" not in findings(steady)


def rows(compute, sync):
    return [
        {
            "rank": r,
            "share": 16,
            "samples_per_sec": 16 / c,
            "compute_s": c,
            "sync_s": s,
            "sync_overlap": 0.1,
            "micro_batch": 16,
            "share_cap": None,
        }
        for r, (c, s) in enumerate(zip(compute, sync, strict=True))
    ]


def test_a_distributed_run_whose_sync_is_30_percent_of_the_step(write_run, capsys):
    run = write_run([line(s, workers=rows([0.7, 0.7], [0.3, 0.3])) for s in range(1, 6)])
    found = findings(run)
    assert "the all-reduce took 30% of each step on median" in found["gradient sync"].measured
    assert "larger --global-batch" in found["gradient sync"].fix
    assert "workers wait for the slowest" not in found
    assert main(["report", str(run)]) == 0
    assert ", 2 workers" in capsys.readouterr().out.splitlines()[0]
    assert_png(run / "report" / "throughput.png")


def test_the_sync_choices_and_the_share_of_waiting_over_time(write_run, capsys):
    # The run probed its link, chose local rounds at step 3, then found the share drifting and chose again.
    choice = {"event": "sync-choice", "overlap": 0, "reason": "link 20.0 Mbit/s ...", "rank": 0}
    lines = [line(s, workers=rows([0.9, 0.9], [0.05, 0.05]), sync_s=0.05, sync_share=0.05) for s in range(1, 9)]
    lines.insert(3, {**choice, "step": 3, "mode": "local", "every": 4})
    before = {"mbit_s": 940.0, "latency_ms": 0.2, "step": 3}
    again = {"measured_share": 0.14, "link": {"mbit_s": 18.5, "latency_ms": 3.0}, "link_before": before}
    lines.insert(7, {**choice, "step": 6, "mode": "local", "every": 12, **again, "interface": "bridge0"})
    summary = {"steps": 8, "sync_mode": "local", "sync_every": 12, "sync_share": {"run": 0.05, "workers": [0.04, 0.06]}}
    run = write_run(lines, summary)
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "sync: local H=12, 5.0% of step time waiting on sync (workers 4.0%, 6.0%); its choices:" in out
    assert "  step 3: local H=4: link 20.0 Mbit/s ..." in out
    assert (
        "  step 6: local H=12 (measured share 14.0%; the link through bridge0 18.5 Mbit/s, 940 at step 3): link" in out
    )
    assert_png(run / "report" / "throughput.png")


def test_an_elastic_runs_report_says_who_left_and_who_entered(write_run, capsys):
    left = {"event": "membership", "step": 25, "epoch": 1, "workers": ["w00", "w02"], "left": ["w01"], "entered": []}
    left |= {"waited_s": 0.441, "deadline_s": 2.0, "seconds": 3.21}
    entered = {"event": "membership", "step": 50, "epoch": 2, "workers": ["w00", "w02", "w03"], "left": []}
    entered |= {"entered": ["w03"], "waited_s": 0.0, "deadline_s": 2.0, "seconds": 2.4}
    lines = [line(s, workers=rows([0.9, 0.9], [0.05, 0.05])) for s in range(1, 60)]
    lines.insert(26, left)
    lines.insert(52, entered)
    expected = [
        "workers: 2 change(s) of who trains together, none restarting the run:",
        "  step 25: w01 left (the others waited 0.4 s against a deadline of 2.0 s); 2 training (w00, w02), the change"
        " 3.2 s",
        "  step 50: w03 entered with a live peer's state; 3 training (w00, w02, w03), the change 2.4 s",
    ]
    for summary in (None, {"steps": 59, "membership": [left, entered]}):  # a run still going, and one that ended
        run = write_run(lines, summary, name=f"run-{summary is None}")
        assert main(["report", str(run)]) == 0
        out = capsys.readouterr().out.splitlines()
        start = out.index(expected[0])
        assert out[start : start + 3] == expected
    plain = write_run([line(s) for s in range(1, 5)], name="plain")
    assert main(["report", str(plain)]) == 0
    assert "workers:" not in capsys.readouterr().out


def test_a_distributed_runs_report_names_its_log_files(write_run, capsys):
    run = write_run([line(s, workers=rows([0.9, 0.9], [0.05, 0.05])) for s in range(1, 5)])
    (run / "logs").mkdir()
    for name in ("worker-10.log", "driver.log", "worker-2.log", "worker-0.log"):
        (run / "logs" / name).write_text("22:38:24 INFO raytrm.hardware.device: device cpu\n")
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        f"logs in {run / 'logs'}: driver.log, worker-0.log, worker-2.log, worker-10.log (the driver's and Ray's "
        "lines, each worker's INFO lines)" in out
    )


def test_the_new_health_findings_read_in_the_report_with_their_fix(write_run, capsys):
    frozen = {
        "step": 30,
        "event": "health-frozen",
        "reason": "the updates moved the weights by at most 2e-13",
        "fix": "raise training.lr (--lr)",
    }
    absurd = {"step": 2, "event": "health-absurd-loss", "reason": "loss is 367 at step 2", "fix": "lower training.lr"}
    run = write_run([line(1), absurd, line(2), line(3), frozen])
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "- absurd loss: loss is 367 at step 2 (step 2)\n  fix: lower training.lr" in out
    assert (
        "- weights frozen: the updates moved the weights by at most 2e-13 (step 30)\n  fix: raise training.lr (--lr)"
        in out
    )


def test_a_slow_worker_shows_as_waiting_not_as_sync(write_run):
    # Worker 1 finishes its share in half the time and waits in the all-reduce for worker 0.
    found = findings(write_run([line(s, workers=rows([1.0, 0.5], [0.05, 0.55])) for s in range(1, 6)]))
    assert "gradient sync" not in found
    assert "idled 24% of each step" in found["workers wait for the slowest"].measured


def test_idle_threads_and_time_outside_the_steps(write_run):
    summary = {"steps": 4, "wall_seconds": 10.0, "train_seconds": 6.0, "threads": {"threads": 4}}
    found = findings(write_run([line(s, cpu_percent=120.0) for s in range(1, 5)], summary=summary, threads=4))
    assert "4 torch thread(s) kept 1.2 cores busy on median" in found["CPU under-used"].measured
    outside = found["time outside training steps"].measured
    assert "40% of the 10.0 s wall time went to 1 evaluation(s) (at the end), checkpoints (at the end)" in outside


def test_a_clean_run_has_no_finding(write_run, capsys):
    run = write_run([line(s) for s in range(1, 5)])
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "no limit found in what was recorded" in out
    assert "note: no summary.json: the run did not finish" in out


def test_a_torn_last_line_is_skipped_with_a_warning(write_run, caplog, capsys):
    run = write_run([line(s) for s in range(1, 4)])
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "samples_per_s')
    with caplog.at_level(logging.WARNING):
        assert main(["report", str(run)]) == 0
    assert "metrics.jsonl line 4: cut short" in caplog.text
    assert "note: metrics.jsonl line 4 was cut short" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n', "metrics.jsonl line 2: not JSON"),
        ('{"step": 1}\n[1, 2]\n', "metrics.jsonl line 2: expected a JSON object with a numeric step"),
        ('{"step": 1, "event": "choose"}\n', "metrics.jsonl: no step line yet"),
    ],
)
def test_a_damaged_metrics_file_is_one_line_and_exit_2(write_run, capsys, content, message):
    run = write_run([])
    (run / "metrics.jsonl").write_text(content)
    assert main(["report", str(run)]) == 2
    assert message in one_error_line(capsys)
    assert not (run / "report").exists()  # nothing written that looks like a report


def test_what_is_not_a_run_is_one_line_and_exit_2(write_run, tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such directory" in one_error_line(capsys)
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    error = one_error_line(capsys)
    assert "neither a training run (no config.yaml or metrics.jsonl) nor a tuning run (no tune.yaml)" in error
    run = write_run([line(1)])
    (run / "metrics.jsonl").unlink()
    assert main(["report", str(run)]) == 2
    assert "no metrics.jsonl, so not a complete training run directory" in one_error_line(capsys)


def test_a_tuning_run_gets_the_study_plots_and_the_tier_table(tmp_path, capsys):
    from raytrm.tune import objectives
    from raytrm.tune.layout import TUNE_FILE, storage_url
    from raytrm.tune.search import record
    from raytrm.tune.space import load_space

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    tier, space = "macbook-air-8gb", load_space(None)
    study = optuna.create_study(storage=storage_url(tmp_path), study_name="quick-air", direction="maximize")
    for number in range(4):
        trial = study.ask()
        threads = trial.suggest_int("training.threads", 1, 2)
        result = {
            objectives.QUALITY: 0.2 + 0.1 * number + 0.05 * threads,
            objectives.THROUGHPUT: 100.0 + number,
            objectives.PEAK_MB: 500.0,
            objectives.BUDGET_MB: 1000.0,
            objectives.STATUS: "ok",
        }
        record(study, trial, result, space.objective)
    state = {
        "raytrm_tune": 1,
        "space": space.to_dict(),
        "tiers": [tier],
        "storage": storage_url(tmp_path),
        "studies": {tier: "quick-air"},
    }
    cfg.write_yaml(state, tmp_path / TUNE_FILE)
    report = write_report(tmp_path)
    assert f"tier {tier}  (4 feasible trials, objective quality" in report.text
    assert "best      #3" in report.text
    assert (tmp_path / "report" / "tuning.txt").read_text() == report.text + "\n"
    assert_png(tmp_path / "report" / f"{tier}-history.png")
    assert main(["report", str(tmp_path)]) == 0
    assert f"tier {tier}" in capsys.readouterr().out


def test_an_out_that_is_an_existing_file_is_refused_and_left_as_it_was(write_run, tmp_path, capsys):
    run = write_run([line(s) for s in range(1, 4)])
    for target in (run / "config.yaml", run / "metrics.jsonl"):
        before = target.read_bytes()
        assert main(["report", str(run), "--out", str(target)]) == 2
        assert one_error_line(capsys) == (
            f"raytrm: error: --out {target}: an existing file; expected a directory for the report's plots and text "
            "(default RUN_DIR/report); fix: give --out a new or an existing directory"
        )
        assert target.read_bytes() == before
    assert main(["report", str(run), "--out", str(run / "config.yaml" / "report")]) == 2
    assert f"--out {run}/config.yaml/report: under {run}/config.yaml, an existing file" in one_error_line(capsys)
    assert not (run / "report").exists()


def test_an_out_that_cannot_be_made_is_one_line(write_run, tmp_path, capsys, monkeypatch):
    import pathlib

    run, real = write_run([line(s) for s in range(1, 4)]), pathlib.Path.mkdir
    target = tmp_path / "locked" / "report"

    def mkdir(self, *args, **kwargs):  # as a directory the user may not write to answers, even to root
        if self == target:
            raise PermissionError(13, "Permission denied")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    assert main(["report", str(run), "--out", str(target)]) == 2
    assert one_error_line(capsys) == (
        f"raytrm: error: --out {target}: cannot make the report directory (Permission denied); fix: give --out a "
        "writable directory"
    )
