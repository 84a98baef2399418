"""The run directory's study storage: opening it while another process creates it, and what a resumed driver does
with the trials its dead predecessor left behind (no Ray: the study and files only)."""

from __future__ import annotations

import json

import optuna
import pytest
import sqlalchemy.exc

from raytrm.errors import UserError
from raytrm.tune import objectives
from raytrm.tune.layout import STUDY_DB, TRIALS_DIR, open_storage, storage_url
from raytrm.tune.tuner import recover

TIER = "macbook-air-8gb"
STATE = optuna.trial.TrialState


def test_a_saved_result_is_recorded_a_lost_one_fails_and_a_queued_start_point_stays_queued(tmp_path):
    study = optuna.create_study(storage=storage_url(tmp_path), study_name="s", direction="maximize")
    saved, lost = study.ask(), study.ask()  # both RUNNING when the driver died
    study.enqueue_trial({"x": 1})  # a start point nobody asked for yet
    result = {
        objectives.QUALITY: 0.75,
        objectives.THROUGHPUT: 120.0,
        objectives.PEAK_MB: 1500.0,
        objectives.BUDGET_MB: 1000.0,
        objectives.STATUS: "ok",
    }
    (tmp_path / TRIALS_DIR).mkdir()
    (tmp_path / TRIALS_DIR / f"{TIER}-{saved.number}.json").write_text(json.dumps(result))

    recover(study, TIER, tmp_path, "quality")

    trials = {t.number: t for t in optuna.load_study(study_name="s", storage=storage_url(tmp_path)).trials}
    assert (tmp_path / STUDY_DB).is_file()
    assert trials[saved.number].state == STATE.COMPLETE and trials[saved.number].value == 0.75
    assert trials[saved.number].constraints["memory"] == 0.5  # 1500 MiB over a 1000 MiB budget: infeasible
    assert trials[lost.number].state == STATE.FAIL
    assert trials[2].state == STATE.WAITING
    assert study.ask().params == {} and study.trials[2].state == STATE.RUNNING  # the next ask takes the queued point


def schema_race(times):
    """RDBStorage as it behaves when another process wins the race to create the schema, `times` times."""
    calls = []

    class Racing(optuna.storages.RDBStorage):
        def __init__(self, url, *args, **kwargs):
            calls.append(url)
            if len(calls) <= times:
                lost = Exception("table studies already exists")
                raise sqlalchemy.exc.OperationalError("CREATE TABLE studies", {}, lost)
            super().__init__(url, *args, **kwargs)

    return Racing, calls


def test_opening_a_storage_that_another_process_is_creating_tries_again(tmp_path, monkeypatch):
    storage, calls = schema_race(times=2)
    monkeypatch.setattr(optuna.storages, "RDBStorage", storage)
    opened = open_storage(tmp_path)
    assert len(calls) == 3
    study = optuna.create_study(storage=opened, study_name="s")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert len(optuna.load_study(study_name="s", storage=storage_url(tmp_path)).trials) == 2


def test_a_storage_that_never_opens_is_one_line_naming_the_file(tmp_path, monkeypatch):
    storage, calls = schema_race(times=99)
    monkeypatch.setattr(optuna.storages, "RDBStorage", storage)
    with pytest.raises(UserError, match=rf"{STUDY_DB}: cannot open the study storage .*table studies already exists"):
        open_storage(tmp_path, attempts=3)
    assert len(calls) == 3
