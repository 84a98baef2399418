"""`raytrm export` on recorded runs (no Ray): the profile of each tier, with the verification where it re-ran the
pick, and one clear line where a run cannot give one."""

from __future__ import annotations

import json

import pytest

from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.tune import layout
from raytrm.tune.profiles import build_profile, export_run
from raytrm.tune.studies import ranked, rate_path, rates, staged_candidates

AIR, STUDIO = "macbook-air-8gb", "mac-desktop-16gb"  # the tiers of the conftest's runs


def test_a_plain_run_exports_its_best_trial_with_the_verification(plain_run):
    best, space, _ = ranked(plain_run, AIR)
    assert [t.number for t in best] == [3, 2, 1, 0] and space.name == "plain"
    paths = export_run(plain_run)
    assert paths == {AIR: plain_run / layout.PROFILES_DIR / f"{AIR}.yaml"}
    profile = cfg.load_profile(paths[AIR])
    assert profile == build_profile(plain_run, AIR)
    assert (profile.tier, profile.model.L_cycles, profile.training.micro_batch_size) == (AIR, 2, 8)
    # No horizon: the profile trains as long as a trial with its verification window.
    assert (profile.training.steps, profile.training.time_budget_s) == (None, 5.0 + 20.0)
    assert profile.limits.memory_budget_mb == 1000 and profile.measured.samples_per_sec == 103.0
    objective = profile.measured.objective
    assert objective["quality"] == pytest.approx(0.8) and objective["objective"] == "quality"
    assert (objective["verify_samples_per_sec"], objective["verify_quality"], objective["verify_status"]) == (
        99.0,
        0.75,
        "ok",
    )
    assert profile.measured.trial == 3 and profile.measured.study == f"plain-air @ {layout.storage_url(plain_run)}"


def test_a_verification_of_another_trial_is_left_out(plain_run):
    (plain_run / layout.VERIFY_DIR / f"{AIR}.json").write_text('{"trial": 2, "samples_per_sec": 1.0}')
    assert not any(k.startswith("verify_") for k in build_profile(plain_run, AIR).measured.objective)


def test_a_staged_run_exports_each_tier_its_best_config_at_the_horizon(staged_run):
    studio = build_profile(staged_run, STUDIO)
    assert studio.model.L_cycles == 2 and studio.training.micro_batch_size == 16
    assert (studio.training.steps, studio.training.time_budget_s) == (4, None)  # 64 samples of 16
    objective = studio.measured.objective
    assert objective["quality"] == pytest.approx(0.6) and objective["horizon"] == {"samples": 64}
    assert objective["trained_on"] == STUDIO and objective["speed_trial"] == 1 and not objective["extrapolated"]
    assert objective["verify_samples_per_sec"] == 190.0 and objective["verify_quality"] is None
    # On AIR the config runs with the speed setting it was timed with there, and the figures are that run's.
    air = build_profile(staged_run, AIR)
    assert air.model.L_cycles == 2 and air.training.micro_batch_size == 8
    assert air.measured.samples_per_sec == 60.0 and air.measured.peak_memory_mb == 700.0
    assert "verify_status" not in air.measured.objective
    assert rate_path(staged_run, AIR, 1).is_file() and set(rates(staged_run, AIR)) == {0, 1}
    assert rates(staged_run, STUDIO) == {}  # the configs trained there: their own trials' figures count
    choices, speed = staged_candidates(staged_run, AIR)
    assert [c.trial for c in choices] == [1, 0] and speed == {
        "params": {"training.micro_batch_size": 16},
        "samples_per_sec": 120.0,
        "trial": 1,
    }


def test_what_cannot_be_exported_is_one_line(plain_run, staged_run, tmp_path):
    with pytest.raises(UserError, match=r"--tier mac-mini-16gb: not tuned in .* \(tiers: macbook-air-8gb\)"):
        export_run(plain_run, tier="mac-mini-16gb")
    with pytest.raises(UserError, match=r"--out names one file but .* has tiers macbook-air-8gb, mac-desktop-16gb"):
        export_run(staged_run, out=str(tmp_path / "p.yaml"))
    with pytest.raises(UserError, match=r"empty: not a tuning run \(no tune.yaml\); tune first"):
        layout.read_state(tmp_path / "empty")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / layout.TUNE_FILE).write_text("raytrm_tune: 1\n")
    with pytest.raises(UserError, match="the run never reached its studies; resume it with `raytrm tune --resume"):
        export_run(tmp_path / "new")


def test_a_cluster_run_records_the_link_and_the_sync_mode_chosen_from_it(staged_run):
    # The speed stage measured the link between the machines (sync.json): the profiles train in that mode, and say
    # why; the profile reads back, and the record holds no field the schema refuses.
    from raytrm.distributed.cluster_link import choose_for_cluster
    from raytrm.sync.link import Link

    record = choose_for_cluster(Link(0.001, 20e6 / 8), 800_000, 16, {AIR: 60.0, STUDIO: 190.0}, {AIR: 1, STUDIO: 1})
    assert record["mode"] == "local" and record["every"] >= record["fewest_every"] >= 1
    (staged_run / layout.SYNC_FILE).write_text(json.dumps(record))
    profile = build_profile(staged_run, STUDIO)
    assert (profile.training.sync_mode, profile.training.sync_every) == ("local", record["every"])
    assert profile.training.sync_overlap == record["overlap"]
    assert profile.measured.sync["mbit_s"] == pytest.approx(20.0) and profile.measured.sync["reason"]
    path = export_run(staged_run)[STUDIO]
    assert cfg.load_profile(path) == profile
    # A fast link keeps exact sync, and no round length.
    fast = choose_for_cluster(Link(1e-4, 10e9 / 8), 800_000, 16, {AIR: 60.0, STUDIO: 190.0}, {AIR: 1, STUDIO: 1})
    (staged_run / layout.SYNC_FILE).write_text(json.dumps(fast))
    profile = build_profile(staged_run, AIR)
    training = profile.training
    assert (training.sync_mode, training.sync_every, training.sync_overlap) == ("exact", None, None)


def test_export_out_never_replaces_a_file_that_is_not_a_profile(plain_run, tmp_path, capsys):
    from raytrm.cli import main

    precious = tmp_path / "notes.yaml"
    precious.write_text("my: notes\n")
    for target in (precious, plain_run / layout.TUNE_FILE, plain_run / layout.STUDY_DB):
        before = target.read_bytes()
        assert main(["export", str(plain_run), "--tier", AIR, "--out", str(target)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"raytrm: error: --out {target}: an existing file that is not a raytrm profile; refusing to replace it; "
            "fix: give --out a new file name (or an earlier profile, to replace it)"
        ]
        assert target.read_bytes() == before
    assert main(["export", str(plain_run), "--tier", AIR, "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path}: a directory; expected the profile's file name" in capsys.readouterr().err
    profile = tmp_path / "p.yaml"
    assert main(["export", str(plain_run), "--tier", AIR, "--out", str(profile)]) == 0
    assert main(["export", str(plain_run), "--tier", AIR, "--out", str(profile)]) == 0  # an export again replaces it
    assert cfg.load_profile(profile).tier == AIR
