"""The table of a tuning run on recorded runs (no Ray): per tier, the pick and the runner-up with their figures,
the verification and the profile."""

from __future__ import annotations

from raytrm.tune.profiles import export_run
from raytrm.tune.tables import format_table
from raytrm.tune.verify import verification

AIR, STUDIO = "macbook-air-8gb", "mac-desktop-16gb"  # the tiers of the conftest's runs


def test_a_plain_runs_table(plain_run):
    export_run(plain_run)
    assert format_table(plain_run).splitlines() == [
        f"tier {AIR}  (4 feasible trials, objective quality)",
        "  best      #3: micro_batch_size=8 L_cycles=2",
        "            quality=0.8  samples/s 103.0  peak 500 / 1000 MiB  thermal unknown",
        "  runner-up #2: micro_batch_size=16 L_cycles=1",
        "            quality=0.7  samples/s 102.0  peak 500 / 1000 MiB  thermal unknown",
        "  verified : samples/s 99.0  peak 480 MiB  quality 0.75  (ok)",
        f"  profile  : {plain_run / 'profiles' / f'{AIR}.yaml'}",
    ]


def test_a_staged_runs_table(staged_run):
    assert verification(staged_run, STUDIO)["trial"] == 1 and verification(staged_run, AIR) is None
    lines = format_table(staged_run).splitlines()
    header = "(quality at the horizon, 64 samples on this tier; 2 speed trials here, 2 learning trials on all tiers, "
    assert lines[0] == f"tier {AIR}  {header}2 trained to the horizon)"
    assert lines[1] == "  speed    #1: micro_batch_size=16  samples/s 120.0 at the base config"
    assert lines[2] == "  best      #1: L_cycles=2  (with micro_batch_size=8: the tier's pick did not fit it)"
    assert lines[3].startswith("            quality=0.6 +-0.01 at 64 samples (on its curve; trained on mac-desktop")
    assert lines[3].endswith("samples/s 60.0  peak 700 / 1000 MiB  thermal unknown")
    assert lines[4] == "  runner-up #0: L_cycles=1"
    assert lines[6] == f"tier {STUDIO}  {header}2 trained to the horizon)"
    assert lines[-1] == "  verified : samples/s 190.0  peak 520 MiB  (ok)"
    assert len(lines) == 13  # no profile written yet


def test_a_lost_tier_says_so(plain_run):
    from raytrm import config as cfg
    from raytrm.tune import layout

    state = cfg.read_yaml(plain_run / layout.TUNE_FILE)
    state["lost_tiers"] = {AIR: {"died": [2], "not_run": 1}}
    cfg.write_yaml(state, plain_run / layout.TUNE_FILE)
    assert format_table(plain_run).splitlines()[1] == (
        "  LOST     : its last machine left the cluster; trial(s) [2] died with it (recorded failed, with what they "
        "measured), 1 never ran, nothing was verified"
    )


def test_a_trial_stopped_as_not_learning_is_counted_and_never_picked(plain_run):
    import optuna

    from raytrm.tune import layout
    from raytrm.tune.progress import trial_line
    from raytrm.tune.space import space_from_dict
    from tests.unit.tune.conftest import BASE, PARAMS, _result, _tell

    space = space_from_dict({"raytrm_space": 1, "name": "plain", "base": BASE, "params": PARAMS}, "<test>")
    study = optuna.load_study(study_name="plain-air", storage=layout.storage_url(plain_run))
    params = {"training.micro_batch_size": 16, "model.L_cycles": 2}
    reason = "loss has sat at ln(9)=2.197 for 40 steps"
    stuck = _result(space, params, status="not_learning", quality=0.9, health=[{"reason": reason}])
    _tell(study, space, params, stuck, "quality")  # its quality would lead: infeasible, it never does
    lines = format_table(plain_run).splitlines()
    assert lines[0] == f"tier {AIR}  (4 feasible trials, 1 stopped as not learning, objective quality)"
    assert lines[1] == "  best      #3: micro_batch_size=8 L_cycles=2"
    line = trial_line({**stuck, "tier": AIR, "trial_number": 4, "params": params}, "quality")
    assert line.startswith(f"[{AIR} #4] NOT LEARNING quality=0.9") and line.endswith(f"| {reason}")


def test_a_verification_that_measured_nothing_shows_n_a(plain_run):
    import json

    from raytrm.tune import layout

    verified = {"trial": 3, "status": "failed", "samples_per_sec": None, "quality": None}
    (plain_run / layout.VERIFY_DIR / f"{AIR}.json").write_text(json.dumps(verified))
    assert format_table(plain_run).splitlines()[-1] == "  verified : samples/s n/a  peak n/a MiB  quality n/a  (failed)"
