"""Fuzzing the files of run directories: a tuning run's tune.yaml (`raytrm export`, `raytrm tune --resume`, the table
`raytrm report` prints) and the results it keeps (verify/, rates/, sync.json), a training run's metrics.jsonl and
summary.json (`raytrm report`).

Property: each command either does its work or refuses with exit code 2 and one line on stderr, never a traceback;
a resume that accepts the file stops where it would start Ray. Every example runs the report's reading and
diagnosis; every PLOT_EVERY-th also draws its plots (the slowest part, by far).
"""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mutations import (
    FUZZ,
    FUZZ_EXAMPLES,
    Counter,
    check_cli_refusal,
    corrupted,
    load_or_refusal,
    mutated,
    run_cli,
    yaml_bytes,
    yaml_files,
)

from raytrm import config as cfg
from raytrm.report import load_run
from raytrm.report.build import format_diagnosis
from raytrm.report.diagnosis import diagnose
from raytrm.tune import layout
from raytrm.tune.tables import format_table
from tests.unit.tune.conftest import AIR, copy_run, make_staged_run

pytestmark = pytest.mark.slow

#: A tuning run's readers are slower (a study opened per example): fewer examples, as the 60 s budget allows.
RUN_EXAMPLES = max(1, FUZZ_EXAMPLES // 2)
PLOT_EVERY = 50


class Reached(Exception):
    """A resume got past its checks: where it would connect to Ray."""


@pytest.fixture
def staged(tmp_path, monkeypatch):
    """A staged run over two tiers (the richest tune.yaml: a learning study, rates, a verification), with a lost
    tier and a sync record; a resume stops before Ray."""
    from raytrm.tune import tuner

    def connect(address):
        raise Reached

    monkeypatch.setattr(tuner, "connect", connect)
    (tmp_path / "template").mkdir()
    run = copy_run(make_staged_run(tmp_path / "template"), tmp_path)
    state = cfg.read_yaml(run / layout.TUNE_FILE)
    state.update(space_file="tune_spaces/tiny.yaml", trials=2, lost_tiers={AIR: {"not_run": 1, "at": 5.0, "died": [3]}})
    cfg.write_yaml(state, run / layout.TUNE_FILE)
    (run / layout.SYNC_FILE).write_text(json.dumps({"mode": "local", "every": 4, "overlap": 1, "reason": "slow link"}))
    return run


def _cli(argv: list[str]) -> int:
    """Exit code 0, or 2 with one line; a resume that reaches Ray counts as accepted."""
    try:
        code, _, err = run_cli(argv)
    except Reached:
        return 0
    if code != 0:
        check_cli_refusal(code, err)
    return code


def test_tune_yaml(staged, tiers_read_once):
    counter = Counter("tune.yaml")
    path = staged / layout.TUNE_FILE
    seed = cfg.read_yaml(path)

    # Edits of the state around the space as well: the space is most of the file, so most edits land in it.
    state = {k: v for k, v in seed.items() if k != "space"}
    around = mutated(state).map(lambda d: yaml_bytes({**d, "space": seed["space"]} if isinstance(d, dict) else d))

    @settings(FUZZ, max_examples=RUN_EXAMPLES)
    @given(st.one_of(yaml_files(seed), around, around))
    def prop(content: bytes) -> None:
        path.write_bytes(content)
        _, error = load_or_refusal(format_table, staged)
        codes = [_cli(["export", str(staged)]), _cli(["tune", "--resume", str(staged)])]
        counter.add(error is not None or 2 in codes)

    prop()
    print(counter.report())
    assert counter.ran >= RUN_EXAMPLES


#: The files of a tuning run besides tune.yaml, with what the staged fixture holds there.
KEPT = ("verify/mac-desktop-16gb.json", f"rates/{AIR}-0.json", layout.SYNC_FILE)
KEPT_EXAMPLES = max(1, FUZZ_EXAMPLES // 4)


def test_kept_results(staged, tiers_read_once):
    """A verification, a rate run and the sync record, edited: the table and the export work or are one line."""
    counter = Counter("verify/, rates/, sync.json")
    seeds = {name: json.loads((staged / name).read_text()) for name in KEPT}

    @settings(FUZZ, max_examples=KEPT_EXAMPLES)
    @given(
        st.sampled_from(KEPT).flatmap(lambda n: st.tuples(st.just(n), mutated(seeds[n]).map(lambda d: json.dumps(d))))
    )
    def prop(case) -> None:
        name, text = case
        for kept, seed in seeds.items():
            (staged / kept).write_text(text if kept == name else json.dumps(seed))
        _, error = load_or_refusal(format_table, staged)
        code = _cli(["export", str(staged)])
        counter.add(error is not None or code == 2)

    prop()
    print(counter.report())
    assert counter.ran >= KEPT_EXAMPLES


STEPS = [
    {
        "step": n,
        "samples_per_sec": 100.0 - n,
        "loss": 2.0 - 0.1 * n,
        "accuracy": 0.1 * n,
        "lr": 1e-3,
        "grad_norm": 1.5,
        "rss_mb": 300.0,
        "peak_rss_mb": 310.0,
        "cpu_percent": 90.0,
        "thermal_state": "nominal" if n < 4 else "serious",
        "temperature_c": 60.0 + n,
        "sync_s": 0.01,
        "sync_share": 0.2,
        "workers": [
            {"rank": r, "share": 16, "micro_batch": 8, "samples_per_sec": 50.0, "compute_s": 0.1 + r, "sync_s": 0.02}
            for r in (0, 1)
        ],
        **({"eval_cell_acc": 0.5, "eval_copy_givens_acc": 0.4} if n % 3 == 0 else {}),
    }
    for n in range(1, 7)
]
EVENTS = [
    {"step": 2, "event": "choose", "micro_batch_to": 8, "reason": "fit"},
    {"step": 3, "event": "shrink", "micro_batch_to": 4, "reason": "memory pressure", "rank": 1},
    {"step": 3, "event": "out-of-memory", "reason": "allocator"},
    {"step": 4, "event": "thermal-lower-load", "thermal_state": "serious", "reason": "hot"},
    {
        "step": 4,
        "event": "sync-choice",
        "mode": "local",
        "every": 4,
        "overlap": 1,
        "measured_share": 0.1,
        "reason": "r",
    },
    {"step": 5, "event": "health-plateau", "reason": "flat", "fix": "raise lr"},
    {"step": 5, "event": "rebalance", "shares": [12, 20]},
]
METRICS = [*STEPS[:2], EVENTS[0], STEPS[2], *EVENTS[1:3], STEPS[3], *EVENTS[3:5], STEPS[4], *EVENTS[5:], STEPS[5]]
SUMMARY = {
    "steps": 6,
    "samples_per_sec": 95.0,
    "steady_samples_per_sec": 96.0,
    "setup_seconds": 1.0,
    "warmup_seconds": 0.5,
    "stop_reason": "steps reached",
    "device": "cpu",
    "dtype": "float32",
    "peak_step_mb": 305.0,
    "peak_method": "rss",
    "memory_budget_mb": 1000,
    "threads": {"threads": 2, "interop_threads": 1},
    "micro_batches": [8, 4],
    "wall_seconds": 10.0,
    "train_seconds": 6.0,
    "sync_share": {"run": 0.2, "workers": [0.2, 0.25]},
    "sync_mode": "local",
    "sync_every": 4,
}


def _jsonl(lines) -> bytes:
    lines = lines if isinstance(lines, list) else [lines]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


@pytest.fixture
def training_run(tmp_path):
    run = tmp_path / "train-run"
    run.mkdir()
    (run / "config.yaml").write_text("training: {global_batch_size: 32, memory_budget_mb: 1000, thermal_cap: fair}\n")
    return run


def _report(run, draw: bool) -> None:
    """What `raytrm report` does with a training run; the plots (and the CLI) only where `draw`."""
    record, error = load_or_refusal(load_run, run)
    if record is not None:
        format_diagnosis(record, diagnose(record), run / "report", [], [])
    if draw:
        code, _, err = run_cli(["report", str(run)])
        assert code == (0 if error is None else 2), err
        if code:
            check_cli_refusal(code, err)
    return error


def test_metrics_and_summary(training_run):
    counter = Counter("metrics.jsonl and summary.json")
    metrics = st.one_of(
        mutated(METRICS).map(_jsonl),
        mutated(METRICS).map(_jsonl).flatmap(corrupted),
        st.just(_jsonl(METRICS)),
    )
    summaries = st.one_of(
        st.none(),
        mutated(SUMMARY).map(lambda s: json.dumps(s).encode()),
        st.just(json.dumps(SUMMARY).encode()).flatmap(corrupted),
        st.just(json.dumps(SUMMARY).encode()),
    )
    examples = iter(range(10**9))

    @FUZZ
    @given(metrics, summaries)
    def prop(metrics_bytes: bytes, summary_bytes: bytes | None) -> None:
        (training_run / "metrics.jsonl").write_bytes(metrics_bytes)
        (training_run / "summary.json").unlink(missing_ok=True)
        if summary_bytes is not None:
            (training_run / "summary.json").write_bytes(summary_bytes)
        error = _report(training_run, draw=next(examples) % PLOT_EVERY == 0)
        counter.add(error is not None)

    prop()
    print(counter.report())
    assert counter.ran >= FUZZ_EXAMPLES


def test_the_seeds_are_read_whole(training_run):
    """The unmutated seeds load with every field the report reads, so mutations start from a complete run."""
    (training_run / "metrics.jsonl").write_bytes(_jsonl(copy.deepcopy(METRICS)))
    (training_run / "summary.json").write_text(json.dumps(SUMMARY))
    record = load_run(training_run)
    assert record.summary == SUMMARY and len(record.events) == len(EVENTS) and record.worker_rows
    names = {f.name for f in diagnose(record)}
    assert {"throttled", "memory pressure", "out of memory", "workers wait for the slowest"} <= names, names
