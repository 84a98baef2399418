"""The hostile user's cases against raytrm's readers (all but checkpoints), one fixed example each (fast, not slow).

Each was a traceback with exit code 1 or a silent misread; each is now one line on stderr naming the file and the
field, what was found, what was expected and the fix, exit code 2, with every file it read left as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from mutations import check_cli_refusal, run_cli

from raytrm import __version__
from raytrm import config as cfg
from raytrm.cli import build_parser
from raytrm.constants import spaces_dir
from tests.unit.tune.conftest import AIR, copy_run, make_plain_run, make_staged_run


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """A `tune --resume` that got past its checks would start Ray: here it fails the test instead."""
    from raytrm.tune import tuner

    def connect(address):
        raise AssertionError("the resume got past its checks and would connect to Ray")

    monkeypatch.setattr(tuner, "connect", connect)


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """A plain and a staged tuning run, recorded without Ray, once for the module."""
    return make_plain_run(tmp_path_factory.mktemp("plain")), make_staged_run(tmp_path_factory.mktemp("staged"))


def files_of(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def refused(argv: list[str], *untouched: Path) -> str:
    """`raytrm ARGV` refuses in one line with exit code 2, and leaves every file under `untouched` as it was."""
    before = {root: files_of(root) if root.is_dir() else root.read_bytes() for root in untouched}
    code, _, err = run_cli(argv)
    line = check_cli_refusal(code, err)
    for root, was in before.items():
        assert (files_of(root) if root.is_dir() else root.read_bytes()) == was, root
    return line.removeprefix("raytrm: error: ")


# -- 1. a tuning run directory whose tune.yaml is malformed: export, tune --resume (and report) ----------------------


NO_STUDIES = "the run never reached its studies; resume it with `raytrm tune --resume"


@pytest.mark.parametrize(
    ("text", "piece", "export_piece"),
    [
        ("raytrm_tune: 1\ntiers: [\n", "malformed YAML at line 3, column 1", None),
        (
            "- raytrm_tune\n- 1\n",
            "raytrm_tune: got None, expected schema version 1; fix: tune.yaml is written by",
            None,
        ),
        ("raytrm_tune: 1\nspace: {}\ntiers: {a: 1}\n", "tiers: got {'a': 1}, expected a list; fix: tune.yaml is", None),
        ("raytrm_tune: 1\nspace: 3\n", "space: got 3, expected a mapping", None),
        ("raytrm_tune: 1\ntiers: [a]\n", "space: got None, expected the run's search space", "storage: got None"),
        ("raytrm_tune: 1\nspace: {}\nsurprise: 1\n", "surprise: unknown field; remove it (known: raytrm_tune,", None),
        ("raytrm_tune: 1\nspace: {}\n", "space: params: got {}, expected at least one parameter", NO_STUDIES),
    ],
    ids=["bad-yaml", "a-list", "tiers-a-mapping", "space-a-number", "no-space", "unknown-field", "no-params"],
)
@pytest.mark.parametrize("command", ["export", "tune --resume"])
def test_1_a_malformed_tune_yaml(tmp_path, text, piece, export_piece, command):
    """Export needs the studies first, a resume the space (it writes the studies itself)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "tune.yaml").write_text(text)
    expected = export_piece or piece if command == "export" else piece
    assert refused([*command.split(), str(run)], run).startswith(f"{run}/tune.yaml: {expected}")


def test_1_a_tune_yaml_whose_space_is_invalid_is_named_as_the_run_s(tmp_path, templates):
    run = copy_run(templates[0], tmp_path)
    state = cfg.read_yaml(run / "tune.yaml")
    state["space"]["params"] = {"training.micro_batch_size": {"type": "categorical", "choices": [8, 12]}}
    cfg.write_yaml(state, run / "tune.yaml")
    for argv in (["export", str(run)], ["tune", "--resume", str(run)], ["report", str(run)]):
        assert refused(argv, run).startswith(
            f"{run}/tune.yaml: space: params.training.micro_batch_size: got 12, expected values that build a valid"
        )


# -- 2. `raytrm report` on a metrics.jsonl that is not text, or a summary.json that is not a mapping ---------------


@pytest.fixture
def training_run(tmp_path):
    run = tmp_path / "train-run"
    run.mkdir()
    (run / "config.yaml").write_text("{}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": n, "samples_per_sec": 9.0}) + "\n" for n in (1, 2)))
    return run


@pytest.mark.parametrize(
    ("content", "piece"),
    [
        (b'{"step": 1}\n\x89PNG\r\n\x1a\n\x00\x00\n{"step": 2}\n', "metrics.jsonl line 2: not UTF-8 text"),
        (
            '{"step": 1}\n{"step": 2, "thermal_state": "caf\u00e9"}\n'.encode("latin-1"),
            "metrics.jsonl line 2: not UTF-8 text",
        ),
        (bytes(range(256)), "metrics.jsonl line 1: not JSON"),
    ],
    ids=["binary", "latin-1", "bytes"],
)
def test_2_a_metrics_file_that_is_not_text(training_run, content, piece):
    (training_run / "metrics.jsonl").write_bytes(content)
    assert refused(["report", str(training_run)], training_run).startswith(f"{training_run}/{piece}")


@pytest.mark.parametrize(
    ("content", "piece"),
    [
        ("[2]", "(top level): got [2], expected a JSON object of field: value; fix: delete it to report from"),
        ("2", "(top level): got 2, expected a JSON object"),
        ('{"steps": 2,', "not JSON at line 1, column 13"),
        ('{"steps": 2, "train_seconds": "10 s"}', "train_seconds: got '10 s', expected a number"),
        ('{"steps": 2, "sync_share": [0.1]}', "sync_share: got [0.1], expected a mapping"),
    ],
    ids=["a-list", "a-number", "malformed", "a-string-for-a-number", "a-list-for-a-mapping"],
)
def test_2_a_summary_that_is_not_a_mapping_of_its_fields(training_run, content, piece):
    (training_run / "summary.json").write_text(content)
    assert refused(["report", str(training_run)], training_run).startswith(f"{training_run}/summary.json: {piece}")


# -- 3. --out naming an existing file ----------------------------------------------------------------------------


def test_3_report_out_an_existing_file(training_run):
    target = training_run / "metrics.jsonl"
    assert refused(["report", str(training_run), "--out", str(target)], training_run) == (
        f"--out {target}: an existing file; expected a directory for the report's plots and text (default "
        "RUN_DIR/report); fix: give --out a new or an existing directory"
    )


def test_3_export_out_an_existing_file_that_is_not_a_profile(tmp_path, templates):
    run = copy_run(templates[0], tmp_path)
    target = run / "tune.yaml"
    assert refused(["export", str(run), "--tier", AIR, "--out", str(target)], run).startswith(
        f"--out {target}: an existing file that is not a raytrm profile; refusing to replace it"
    )


def test_3_data_out_an_existing_file(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine\n")
    assert refused(["data", "sudoku", "--out", str(target), "--count", "2"], target) == (
        f"{target}: already exists; fix: pass a new --out, or --overwrite to replace it"
    )


# -- 4. classification records with missing or wrong fields -----------------------------------------------------


@pytest.fixture
def text_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYTRM_CACHE_DIR", str(tmp_path / "cache"))


def records_argv(path: Path, tmp_path: Path) -> list[str]:
    out = str(tmp_path / "run")
    data = ["--model", "transformer", "--task", "classify", "--data", str(path), "--seq-len", "8"]
    return ["train", *data, "--steps", "1", "--quiet", "--out", out]


GOOD = [{"text": f"document {i}", "label": ["spam", "ham"][i % 2]} for i in range(20)]


@pytest.mark.parametrize(
    ("bad", "piece"),
    [
        ({"text": "no label"}, "d.jsonl:3: no field 'label' (fields: text); fix: add it, or pass --label-field"),
        ({"text": None, "label": "ham"}, "d.jsonl:3: text: got None, expected the document's text, a non-empty"),
        ({"text": "a", "label": ""}, "d.jsonl:3: label: got '', expected the document's class, a non-empty string"),
        ({"text": "a", "label": {"name": "ham"}}, "d.jsonl:3: label: got {'name': 'ham'}, expected the document's"),
        ({"text": "a", "label": ["ham"]}, "d.jsonl:3: label: got ['ham'], expected the document's class"),
        ({"text": 42, "label": "ham"}, "d.jsonl:3: text: got 42, expected the document's text"),
    ],
    ids=["no-label", "null-text", "empty-label", "label-a-mapping", "label-a-list", "text-a-number"],
)
def test_4_a_jsonl_record_with_a_missing_or_wrong_field(tmp_path, text_cache, bad, piece):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*GOOD[:2], bad, *GOOD[2:]]))
    assert refused(records_argv(path, tmp_path), path).startswith(f"{tmp_path}/{piece}")
    assert not (tmp_path / "run").exists()


def test_4_a_csv_row_missing_the_label_column(tmp_path, text_cache):
    path = tmp_path / "d.csv"
    path.write_text("text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in GOOD[:2]) + "no label here\n")
    assert refused(records_argv(path, tmp_path), path) == (
        f"{path}:4: 1 cells, the header has 2: no 'label'; fix: fill in the row's missing cells, or drop the row"
    )


# -- 5. a search space with invalid points -----------------------------------------------------------------------


def test_5_a_space_whose_points_break_a_rule_across_fields(tmp_path):
    space = yaml.safe_load((spaces_dir() / "quick.yaml").read_text())
    space["base"]["training"].update(sync_mode="local", global_batch_size=32)
    space["params"] = {
        "training.sync_every": {"type": "categorical", "choices": [2, 8]},
        "training.sync_overlap": {"type": "int", "low": 0, "high": 4},
    }
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    assert refused(["validate", str(path)], path).startswith(
        f"{path}: params: got {{'training.sync_every': 2, 'training.sync_overlap': 2}}, expected values that build a "
        "valid experiment (training.sync_overlap: expected fewer than sync_every (2) steps"
    )
    space["params"] = {"training.micro_batch_size": {"type": "categorical", "choices": [16, 24]}}
    path.write_text(yaml.safe_dump(space))
    assert refused(["validate", str(path)], path).startswith(
        f"{path}: params.training.micro_batch_size: got 24, expected values that build a valid experiment "
        "(training.micro_batch_size: expected micro_batch_size x grad_accum_steps (1) = global_batch_size (32))"
    )


# -- 6. a newer schema version, or one that is not a whole number from 1 -----------------------------------------

NEWER = f"is newer than this raytrm ({__version__}) reads (1); upgrade raytrm (`pip install -U raytrm`), or"


@pytest.mark.parametrize(
    ("text", "argv", "piece"),
    [
        ("raytrm_profile: 2\n", ["validate"], f"raytrm_profile 2 {NEWER} export the profile again"),
        ("raytrm_space: 2\n", ["validate"], f"raytrm_space 2 {NEWER} write the space for this version"),
        ("raytrm_tiers: 2\ntiers: []\n", ["validate"], f"raytrm_tiers 2 {NEWER} write the table for this version"),
        ("raytrm_tiers: 2\ntiers: []\n", ["probe", "--tiers"], f"raytrm_tiers 2 {NEWER}"),
        ("raytrm_profile: v1\n", ["validate"], "raytrm_profile: got 'v1', expected a schema version, a whole number"),
        ("raytrm_space: 0\n", ["validate"], "raytrm_space: got 0, expected a schema version, a whole number >= 1"),
        ("raytrm_tiers: 1.5\n", ["validate"], "raytrm_tiers: got 1.5, expected a schema version"),
    ],
    ids=["profile", "space", "tiers", "tiers-probe", "profile-a-word", "space-0", "tiers-a-float"],
)
def test_6_a_version_this_raytrm_does_not_read(tmp_path, text, argv, piece):
    path = tmp_path / "file.yaml"
    path.write_text(text)
    assert refused([*argv, str(path)], path).startswith(f"{path}: {piece}")


def test_6_a_tune_yaml_of_a_newer_version(tmp_path, templates):
    run = copy_run(templates[0], tmp_path)
    state = cfg.read_yaml(run / "tune.yaml")
    cfg.write_yaml({**state, "raytrm_tune": 2}, run / "tune.yaml")
    for argv in (["export", str(run)], ["tune", "--resume", str(run)], ["report", str(run)]):
        assert refused(argv, run) == (
            f"{run}/tune.yaml: raytrm_tune 2 {NEWER} tune again with this version into a new directory (--out NEW_DIR)"
        )


# -- 7. argparse: one line for one bad argument, for every subcommand ---------------------------------------------

#: A subcommand line that parses (positional arguments filled in), for each subcommand.
VALID = {
    "probe": [],
    "validate": ["f.yaml"],
    "data": ["sudoku", "--out", "d"],
    "train": [],
    "tune": [],
    "export": ["r"],
    "report": ["r"],
    "import-checkpoint": ["c.pt", "--out", "r"],
    "export-checkpoint": ["r", "--out", "c.pt"],
    "predict": ["r", "records.csv"],
    "evaluate": ["r", "records.csv"],
    "cluster": ["status"],
}


def test_7_every_subcommand_is_listed():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(commands) == set(VALID)


@pytest.mark.parametrize("command", sorted(VALID))
def test_7_an_unknown_flag_to_any_subcommand(command):
    prog = f"raytrm {command}" + (" status" if command == "cluster" else "")
    line = refused([command, *VALID[command], "--no-such-flag"])
    assert line == f"{prog}: unknown option --no-such-flag (see `{prog} --help`)"


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["train", "--steps", "abc"], "--steps: 'abc' is not an integer; give an integer (optimizer steps to run)"),
        (["train", "--lr", "x"], "--lr: 'x' is not a number; give a number (peak learning rate)"),
        (["train", "--step", "3", "--lrr", "1"], "raytrm train: unknown option --lrr; did you mean --lr?"),
        (["export"], "raytrm export: missing run_dir (see `raytrm export --help`)"),
        (["data", "sudoku", "--out"], "raytrm data: --out: expected a value after it (see `raytrm data --help`)"),
        (["data", "maez", "--out", "d"], "raytrm data: kind: 'maez' is not one of sudoku, maze; did you mean maze?"),
    ],
)
def test_7_a_bad_value_or_missing_argument(argv, line):
    assert refused(argv).startswith(line)


# -- 8. every other reader ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "piece"),
    [
        ("raytrm_tiers: 1\ntiers: {a: 1}\n", "tiers: got {'a': 1}, expected a list"),
        ("raytrm_tiers: 1\ntiers:\n  - {name: a, memory_budget_mb: x}\n", "tiers[0].memory_budget_mb: got 'x'"),
        ("\x00\x01", "malformed YAML"),
    ],
)
def test_8_a_bad_tier_table_for_probe(tmp_path, text, piece):
    path = tmp_path / "tiers.yaml"
    path.write_text(text)
    assert refused(["probe", "--tiers", str(path)], path).startswith(f"{path}: {piece}")


@pytest.mark.parametrize(
    ("text", "piece"),
    [
        ("model: {hiden_size: 8}\n", "model.hiden_size: unknown field; did you mean 'hidden_size'?"),
        ("raytrm_profile: 1\ntier: [x]\n", "tier: got ['x'], expected a string"),
        ("raytrm_space: 1\nparams: []\n", "params: got [], expected a mapping"),
        ("raytrm_tiers: 1\ntiers: [1]\n", "tiers[0]: got 1, expected a mapping of field: value"),
    ],
    ids=["training-config", "profile", "space", "tier-table"],
)
def test_8_validate_each_kind(tmp_path, text, piece):
    path = tmp_path / "file.yaml"
    path.write_text(text)
    assert refused(["validate", str(path)], path).startswith(f"{path}: {piece}")


@pytest.mark.parametrize(
    ("where", "content", "piece"),
    [
        ("study.db", b"SQLite format 2\x00" + b"\x00" * 100, "study.db: not an SQLite database"),
        ("trials/macbook-air-8gb-9.json", b'{"status": ["ok"]}', "trials/macbook-air-8gb-9.json: status: got ['ok']"),
        ("verify/macbook-air-8gb.json", b"\xff", "verify/macbook-air-8gb.json: not a text file"),
        ("sync.json", b'{"mode": "local", "every": 4}', "sync.json: overlap: got None, expected an integer"),
    ],
)
def test_8_a_damaged_file_of_a_tuning_run(tmp_path, templates, where, content, piece):
    run = copy_run(templates[0], tmp_path)
    (run / where).parent.mkdir(exist_ok=True)
    (run / where).write_bytes(content)
    readers = [["tune", "--resume", str(run)]]
    if not where.startswith("trials"):  # a trial's result is read by the resume that records it
        readers.append(["export", str(run)])
    for argv in readers:
        assert refused(argv, run).startswith(f"{run}/{piece}"), argv


def test_8_a_damaged_rate_run_of_a_staged_run(tmp_path, templates):
    run = copy_run(templates[1], tmp_path)
    (run / "rates" / f"{AIR}-0.json").write_text('{"samples_per_sec": "60"}')
    for argv in (["export", str(run)], ["report", str(run)], ["tune", "--resume", str(run)]):
        assert refused(argv, run).startswith(f"{run}/rates/{AIR}-0.json: samples_per_sec: got '60', expected a num")


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_3_data_overwrite_replaces_a_dataset_only(tmp_path, kind):
    target = tmp_path / "mine"
    if kind == "file":
        target.write_text("mine\n")
    else:
        (target / "photos").mkdir(parents=True)
        (target / "photos" / "a.jpg").write_bytes(b"\xff\xd8")
    assert refused(["data", "sudoku", "--out", str(target), "--count", "2", "--overwrite"], tmp_path) == (
        f"{target}: not a dataset (no train/dataset.json), so --overwrite will not replace it; fix: pass a new --out"
    )
