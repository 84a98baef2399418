"""The names in a tuning run directory, what each trial of a search is handed, and its files read back: a damaged
one is one line naming the file and the field, exit code 2, and nothing of the run is written."""

from __future__ import annotations

import json

import optuna
import pytest

from raytrm import __version__
from raytrm import config as cfg
from raytrm.cli import main
from raytrm.constants import RESOURCE_MACHINE, tier_resource
from raytrm.errors import UserError
from raytrm.tune import layout
from raytrm.tune.space import space_from_dict
from tests.unit.tune.conftest import AIR, copy_run, make_plain_run, make_staged_run

SPACE = {
    "raytrm_space": 1,
    "name": "s",
    "params": {"model.H_cycles": {"type": "int", "low": 1, "high": 2}},
    "budget": {"warmup_s": 1, "measure_s": 2, "evaluations": 2},
    "limits": {"memory_budget_mb": 2048, "tiers": {"macbook-air-8gb": {"thermal_cap": "serious"}}},
    "horizon": {"samples": 64},
}


def test_study_names_per_tier_and_stage():
    space = space_from_dict(SPACE, "<test>")
    assert layout.staged_study(space, "t", None) == layout.study_name(space, "t") == "s-t"
    assert layout.staged_study(space, "t", "speed") == layout.speed_study(space, "t") == "s-t-speed"
    assert layout.staged_study(space, "t", "learning") == layout.learning_study(space) == "s-learning"


def test_a_trial_holds_one_machine_unit_of_its_tier():
    assert layout.trial_resources("t") == {"CPU": 1, RESOURCE_MACHINE: 1, tier_resource("t"): 1}


def test_each_stage_hands_its_trials_the_measurement_it_needs(tmp_path):
    space = space_from_dict(SPACE, "<test>")
    learning = layout.stage_setup(space, tmp_path, ["macbook-air-8gb"], "learning")
    assert learning["measure"]["horizon"] == {"samples": 64} and learning["evaluations"] == 2
    assert learning["limits"] == {"macbook-air-8gb": {"memory_budget_mb": 2048, "thermal_cap": "serious"}}
    assert learning["run_dir"] == str(tmp_path.resolve()) and learning["stage"] == "learning"
    speed = layout.stage_setup(space, tmp_path, ["macbook-air-8gb"], "speed")
    assert speed["measure"]["horizon"] is None and speed["measure"]["evaluate_quality"] is False
    assert speed["evaluations"] == 1
    throughput = layout.stage_setup(space_from_dict({**SPACE, "objective": "throughput"}, "<t>"), tmp_path, [])
    assert throughput["measure"]["horizon"] is None and "evaluate_quality" not in throughput["measure"]


# -- a run directory's files, damaged: each is one line naming the file and the field, and nothing is written --------

DAMAGED = "fix: tune.yaml is written by `raytrm tune`: restore it, or tune again into a new directory (--out NEW_DIR)"


def _tune_yaml(run, edit) -> bytes:
    state = cfg.read_yaml(run / layout.TUNE_FILE)
    edit(state)
    cfg.write_yaml(state, run / layout.TUNE_FILE)
    return (run / layout.TUNE_FILE).read_bytes()


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """The plain and the staged run, recorded once for the module (recording their studies takes seconds)."""
    return make_plain_run(tmp_path_factory.mktemp("plain")), make_staged_run(tmp_path_factory.mktemp("staged"))


@pytest.fixture
def plain_run(templates, tmp_path):
    return copy_run(templates[0], tmp_path)


@pytest.fixture
def staged_run(templates, tmp_path):
    return copy_run(templates[1], tmp_path)


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """A resume that got past its checks would start Ray: here it fails the test instead."""
    from raytrm.tune import tuner

    def connect(address):
        raise AssertionError("the resume got past its checks and would connect to Ray")

    monkeypatch.setattr(tuner, "connect", connect)


def _refused_by_every_reader(run, capsys, resume: bool = True) -> str:
    """`raytrm export`, `raytrm tune --resume` (where it reads what is damaged) and `raytrm report` each refuse the run
    with one line, exit 2, and leave every file of the run as it was."""
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    lines = []
    readers = (["export", str(run)], ["tune", "--resume", str(run)], ["report", str(run)])
    for argv in readers if resume else readers[::2]:
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("raytrm: error: "), (argv, captured.err)
        lines.append(err[0].removeprefix("raytrm: error: "))
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert not (run / "report").exists() and not (run / layout.PROFILES_DIR).exists()
    return lines[0]


@pytest.mark.parametrize(
    ("text", "piece"),
    [
        ("tiers: [\n", "malformed YAML at line 2, column 1"),
        ("- 1\n- 2\n", f"raytrm_tune: got None, expected schema version 1; {DAMAGED}"),
        ("\xff\xfe", "not a text file; expected UTF-8 YAML"),
        ("raytrm_tune: 2\n", f"raytrm_tune 2 is newer than this raytrm ({__version__}) reads (1); upgrade raytrm"),
        ("raytrm_tune: '1'\n", "raytrm_tune: got '1', expected a schema version, a whole number >= 1"),
    ],
    ids=["bad-yaml", "a-list", "binary", "newer", "version-a-string"],
)
def test_a_tune_yaml_that_is_no_run_state_is_one_line(plain_run, capsys, text, piece):
    (plain_run / layout.TUNE_FILE).write_bytes(text.encode("latin-1"))
    assert _refused_by_every_reader(plain_run, capsys).startswith(f"{plain_run}/tune.yaml: {piece}")


@pytest.mark.parametrize(
    ("edit", "piece"),
    [
        (lambda s: s.update(tiers={AIR: 1}), f"tiers: got {{'{AIR}': 1}}, expected a list; {DAMAGED}"),
        (lambda s: s.update(tiers=[AIR, AIR]), f"tiers[1]: got '{AIR}', expected a tier name, once; {DAMAGED}"),
        (lambda s: s.update(tiers=[["x"]]), "tiers[0]: got ['x'], expected a tier name, once"),
        (lambda s: s.update(studies=[AIR]), "studies: got ['macbook-air-8gb'], expected a mapping"),
        (lambda s: s.update(studies={AIR: 3}), f"studies.{AIR}: got 3, expected the name of the tier's study"),
        (lambda s: s.update(studies={}), f"studies: got {{}}, expected a study for each tier ({AIR} has none)"),
        (lambda s: s.pop("storage"), f"storage: got None, expected sqlite:///RUN_DIR/study.db; {DAMAGED}"),
        (lambda s: s.update(storage="postgresql://db.example/x"), "storage: got 'postgresql://db.example/x', exp"),
        (lambda s: s.update(space=[1]), "space: got [1], expected a mapping"),
        (lambda s: s.update(trials="many"), "trials: got 'many', expected an integer"),
        (lambda s: s.update(lost_tiers={AIR: 3}), f"lost_tiers.{AIR}: got 3, expected a mapping: not_run, at, died"),
        (lambda s: s.update(lost_tiers={AIR: {"died": ["a"]}}), f"lost_tiers.{AIR}.died: got ['a'], expected a list"),
        (lambda s: s.update(tiers_=[AIR]), "tiers_: unknown field; did you mean 'tiers'?"),
    ],
    ids=[
        "tiers-a-mapping",
        "tier-twice",
        "tier-a-list",
        "studies-a-list",
        "study-a-number",
        "no-study",
        "no-storage",
        "storage-a-server",
        "space-a-list",
        "trials-a-word",
        "lost-a-number",
        "died-words",
        "unknown-field",
    ],
)
def test_a_tune_yaml_field_of_the_wrong_shape_is_one_line(plain_run, capsys, request, edit, piece):
    _tune_yaml(plain_run, edit)
    # A resume writes its own tiers, storage and studies: it does not read them.
    resume = not request.node.callspec.id.startswith(("no-study", "no-storage"))
    assert _refused_by_every_reader(plain_run, capsys, resume).startswith(f"{plain_run}/tune.yaml: {piece}")


def test_a_tune_yaml_whose_space_is_not_valid_names_the_space(plain_run, capsys):
    _tune_yaml(plain_run, lambda s: s["space"]["params"].update({"model.H_cycles": {"type": "int", "low": 3}}))
    assert _refused_by_every_reader(plain_run, capsys).startswith(
        f"{plain_run}/tune.yaml: space: params.model.H_cycles: got {{'low': 3, 'type': 'int'}}, expected low and high"
    )


@pytest.mark.parametrize(
    ("content", "piece"),
    [
        (b"not a database at all, just text\n" * 4, "not an SQLite database, yet it is where the run keeps its"),
        (b"\x00" * 4096, "not an SQLite database"),
    ],
)
def test_a_study_db_that_is_not_sqlite_is_one_line(plain_run, capsys, content, piece):
    (plain_run / layout.STUDY_DB).write_bytes(content)
    assert _refused_by_every_reader(plain_run, capsys).startswith(f"{plain_run}/study.db: {piece}")


def test_a_study_db_without_the_study_or_gone_is_one_line(plain_run, capsys):
    _tune_yaml(plain_run, lambda s: s["studies"].update({AIR: "another"}))
    assert main(["export", str(plain_run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"raytrm: error: {plain_run}/study.db: no study 'another', which tune.yaml names; restore the run's study.db, "
        "or tune again into a new directory (--out NEW_DIR)"
    )
    (plain_run / layout.STUDY_DB).unlink()
    assert main(["report", str(plain_run)]) == 2
    assert f"{plain_run}/study.db: no such file, yet tune.yaml keeps the run's studies there" in capsys.readouterr().err
    assert not (plain_run / layout.STUDY_DB).exists()  # not created empty by the reader


@pytest.mark.parametrize(
    ("content", "piece"),
    [
        (b"\x89PNG\r\n", "not a text file (invalid UTF-8 at byte 0); expected JSON; a trial's result is written by"),
        (b"[1]", "(top level): got [1], expected a JSON object of field: value; fix: a trial's result is written by"),
        (b'{"trial": 3, "samples_per_sec": "fast"}', "samples_per_sec: got 'fast', expected a number"),
        (b'{"trial": "3"}', "trial: got '3', expected an integer"),
        (b'{"trial": 3, "status": 1}', "status: got 1, expected a string"),
    ],
)
def test_a_damaged_verification_is_one_line(plain_run, capsys, content, piece):
    (plain_run / layout.VERIFY_DIR / f"{AIR}.json").write_bytes(content)
    assert _refused_by_every_reader(plain_run, capsys).startswith(f"{plain_run}/verify/{AIR}.json: {piece}")


@pytest.mark.parametrize(
    ("content", "piece"),
    [
        (b"{", "not JSON at line 1, column 2"),
        (b'{"status": "ok", "curve": [1]}', "curve[0]: got 1, expected a mapping: samples, quality, stderr, seconds"),
        (b'{"status": "ok", "curve": [{"samples": "x"}]}', "curve[0].samples: got 'x', expected a number"),
        (b'{"status": "ok", "speed_params": [8]}', "speed_params: got [8], expected a mapping"),
    ],
)
def test_a_damaged_rate_run_is_one_line(staged_run, capsys, content, piece):
    (staged_run / layout.RATES_DIR / f"{AIR}-0.json").write_bytes(content)
    assert _refused_by_every_reader(staged_run, capsys).startswith(f"{staged_run}/rates/{AIR}-0.json: {piece}")


@pytest.mark.parametrize(
    ("record", "piece"),
    [
        ("[]", "(top level): got [], expected a JSON object"),
        ('{"every": 4}', "mode: got None, expected a string; fix: it is written by `raytrm tune` on a cluster"),
        ('{"mode": "fast"}', "mode: got 'fast', expected one of exact, compressed, local"),
        ('{"mode": "local", "overlap": 0}', "every: got None, expected an integer"),
        ('{"mode": "local", "every": "4", "overlap": 0}', "every: got '4', expected an integer"),
        ('{"mode": "local", "every": 0, "overlap": 0}', "every: got 'every=0, overlap=0', expected a local round"),
    ],
)
def test_a_damaged_sync_record_is_one_line(staged_run, capsys, record, piece):
    (staged_run / layout.SYNC_FILE).write_text(record)
    assert main(["export", str(staged_run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"raytrm: error: {staged_run}/sync.json: {piece}"), err
    assert not (staged_run / layout.PROFILES_DIR).exists()


def test_a_damaged_trial_result_is_one_line_when_a_resume_records_it(plain_run):
    """A resumed driver records a trial whose result reached trials/ but not the study: a damaged one is one line."""
    from raytrm.tune.trial import result_name
    from raytrm.tune.tuner import recover

    study = optuna.load_study(study_name="plain-air", storage=layout.storage_url(plain_run))
    running = study.ask()
    saved = plain_run / layout.TRIALS_DIR / result_name(None, AIR, running.number)
    saved.parent.mkdir()
    saved.write_text(json.dumps({"status": "ok", "quality": "high"}))
    with pytest.raises(UserError) as refused:
        recover(study, AIR, plain_run, "quality")
    assert str(refused.value).startswith(f"{saved}: quality: got 'high', expected a number; fix: a trial's result is")
