"""What `raytrm report` reads of a training run: metrics.jsonl and summary.json are checked line by line and field
by field, and a damaged one is one line naming the file, the line or field, the value and the fix; nothing written."""

from __future__ import annotations

import json

import pytest

from raytrm.cli import main
from raytrm.report import load_run


def step(n: int, **fields) -> dict:
    return {"step": n, "samples_per_sec": 100.0, "loss": 2.0, **fields}


@pytest.fixture
def run(tmp_path):
    """A run directory of default config.yaml (nothing read from it but its fields) and three good step lines."""
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / "config.yaml").write_text("{}\n")
    (directory / "metrics.jsonl").write_text("".join(json.dumps(step(n)) + "\n" for n in (1, 2, 3)))
    return directory


def refused(run, capsys) -> str:
    assert main(["report", str(run)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("raytrm: error: "), captured.err
    assert not (run / "report").exists()  # nothing written that looks like a report
    return err[0].removeprefix("raytrm: error: ")


@pytest.mark.parametrize(
    ("content", "piece"),
    [
        ("[1, 2]", "summary.json: (top level): got [1, 2], expected a JSON object of field: value; fix: delete it"),
        ("3", "summary.json: (top level): got 3, expected a JSON object"),
        ("null", "summary.json: (top level): got None, expected a JSON object"),
        ('{"steps": 3', "summary.json: not JSON at line 1, column 12 (Expecting ',' delimiter); delete it to report"),
        ('{"steps": "3"}', "summary.json: steps: got '3', expected an integer; fix: delete it to report from"),
        (
            '{"steps": 3, "steady_samples_per_sec": "fast"}',
            "summary.json: steady_samples_per_sec: got 'fast', expected a",
        ),
        ('{"steps": 3, "threads": 4}', "summary.json: threads: got 4, expected a mapping"),
        ('{"steps": 3, "threads": {"threads": "x"}}', "summary.json: threads.threads: got 'x', expected an integer"),
        ('{"steps": 3, "micro_batches": [8, "a"]}', "summary.json: micro_batches: got [8, 'a'], expected a list of"),
        ('{"steps": 3, "sync_share": {"run": "x"}}', "summary.json: sync_share.run: got 'x', expected a number"),
        ('{"steps": 3, "stop_reason": 7}', "summary.json: stop_reason: got 7, expected a string"),
        ('{"steps": 3, "membership": ["w01"]}', "summary.json: membership[0]: got 'w01', expected a mapping with a"),
        ('{"steps": 3, "membership": [{"step": 2, "left": "w01"}]}', "summary.json: membership[0].left: got 'w01', ex"),
        ('{"steps": 3, "membership": [{"step": 2, "entered": [1]}]}', "summary.json: membership[0].entered: got [1]"),
        ('{"steps": 3, "membership": [{"step": 2, "seconds": "2"}]}', "summary.json: membership[0].seconds: got '2'"),
    ],
)
def test_a_summary_that_is_not_what_a_run_writes_is_one_line(run, capsys, content, piece):
    (run / "summary.json").write_text(content)
    assert refused(run, capsys).startswith(f"{run}/{piece}")


def test_a_summary_in_binary_is_one_line(run, capsys):
    (run / "summary.json").write_bytes(b"\x80\x81\x00\xff")
    assert refused(run, capsys) == (
        f"{run}/summary.json: not a text file (invalid UTF-8 at byte 0); expected JSON; delete it to report from "
        "metrics.jsonl alone"
    )


@pytest.mark.parametrize(
    ("lines", "piece"),
    [
        (
            b'\xff\xfe{"step": 1}\n{"step": 2}\n',
            "line 1: not UTF-8 text; the file is damaged: delete or repair that line",
        ),
        (b'{"step": 1}\n\x00\x01\x02\x03\n{"step": 3}\n', "line 2: not JSON (Expecting value)"),
        (bytes(range(256)) * 4, "line 1: not JSON (Expecting value)"),
        (bytes(range(128, 256)) * 4, "line 1: not UTF-8 text"),  # a last line, but no line a run was writing
        (b'{"step": NaN}\n{"step": 2}\n', "line 1: expected a JSON object with a numeric step (>= 0)"),
        (b'{"step": -1}\n{"step": 2}\n', "line 1: expected a JSON object with a numeric step (>= 0)"),
        (b'{"step": true}\n{"step": 2}\n', "line 1: expected a JSON object with a numeric step (>= 0)"),
        (
            b'{"step": 1, "event": 5}\n{"step": 2}\n',
            "line 1: event: got 5, expected a string; fix: the file is damaged",
        ),
        (b'{"step": 1, "event": null}\n{"step": 2}\n', "line 1: event: got None, expected a string"),
        (b'{"step": 1, "thermal_state": "hot"}\n', "line 1: thermal_state: got 'hot', expected one of nominal, fair"),
        (b'{"step": 1, "workers": {"rank": 0}}\n', "line 1: workers: got {'rank': 0}, expected a list"),
        (b'{"step": 1, "workers": [1]}\n', "line 1: workers[0]: got 1, expected a mapping of a worker's figures"),
        (b'{"step": 1, "workers": [{"share": 4}]}\n', "line 1: workers[0].rank: got None, expected an integer"),
        (b'{"step": 1, "event": "membership", "workers": [0]}\n', "line 1: workers: got [0], expected a list of wor"),
        (b'{"step": 1, "event": "membership", "waited_s": "1"}\n', "line 1: waited_s: got '1', expected a number"),
        (b'{"step": 1, "workers": [{"rank": 0, "compute_s": "1"}]}\n', "line 1: workers[0].compute_s: got '1', exp"),
        (b'{"step": 1}\n{"step": 2, "event": "choose", "micro_batch_to": "8"}\n', "line 2: micro_batch_to: got '8'"),
        (b'{"step": 1}\n{"step": 2, "event": "sync-choice"}\n', "line 2: mode: got None, expected a string"),
        (b"[" * 100_000 + b"\n" + b'{"step": 2}\n', "line 1: not JSON"),
    ],
)
def test_a_metrics_file_that_is_not_what_a_run_writes_is_one_line(run, capsys, lines, piece):
    (run / "metrics.jsonl").write_bytes(lines)
    assert refused(run, capsys).startswith(f"{run}/metrics.jsonl{':' if piece.startswith('no') else ''} {piece}")


def test_a_torn_last_line_cut_mid_character_is_still_a_torn_line(run, capsys):
    with (run / "metrics.jsonl").open("ab") as f:
        f.write('{"step": 4, "thermal_state": "é'.encode()[:-1])
    record = load_run(run)
    assert [line["step"] for line in record.steps] == [1, 2, 3]
    assert record.notes[0] == "metrics.jsonl line 4 was cut short (the run stopped mid-write): skipped"


def test_a_number_where_the_report_plots_a_series_is_only_skipped(run, capsys):
    """Fields read through `series` (numbers only) stay tolerant: a string there is a gap in the plot, not an error."""
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(step(n, loss="n/a" if n == 2 else 1.0)) + "\n" for n in (1, 2, 3))
    )
    assert main(["report", str(run)]) == 0
    assert load_run(run).series("loss")[0].tolist() == [0, 2]


@pytest.mark.parametrize(("summary_step", "kept"), [(3, True), (12, True), (13, False), (2, False)])
def test_a_summary_is_the_runs_own_when_its_step_lies_within_a_log_interval_past_the_last_row(run, summary_step, kept):
    """A run stopped between two rows (its time budget ran out at step 12, rows every 10) keeps its summary; one of
    a step before the rows, or a whole interval past them, is another run's (a resumed run that did not finish)."""
    (run / "config.yaml").write_text("training: {log_interval: 10}\n")
    (run / "summary.json").write_text(json.dumps({"steps": summary_step}))
    record = load_run(run)
    assert (record.summary is not None) == kept
    assert any("did not finish" in note for note in record.notes) != kept
