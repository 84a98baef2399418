"""`raytrm train --address auto --elastic` on two real hosts: the MacBook's whole host stopped mid-run (a lid
closed: every process of it, Ray's included) costs the Studio a deadline, not a restart; opened again within Ray's
health checks, it comes back into the run with the Studio's state."""

from __future__ import annotations

import json
import sys
import time

import pytest
import yaml

from raytrm.sync.membership import SETTLE_S
from tests.cluster.test_fastest_path import training_config
from tests.support.elastic_training import steps_logged
from tests.support.hosts import HostSpec, Rig, cannot_make_hosts

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

HEAD_TIER, WORKER_TIER = "mac-desktop-16gb", "macbook-air-8gb"
#: Long enough that the Studio, alone while the MacBook is stopped, cannot finish the run before it comes back.
STEPS = 600


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """Hosts studio and mba on one LAN, each with the cluster token."""
    reason = cannot_make_hosts()
    if reason:
        pytest.skip(f"namespace hosts cannot be made here: {reason}")
    with Rig(tmp_path_factory.mktemp("elastic"), [HostSpec("studio"), HostSpec("mba")], []) as made:
        made.share_token()
        yield made


def test_a_host_stopped_mid_run_costs_a_deadline_and_comes_back(rig, tmp_path):
    studio, mba = rig["studio"], rig["mba"]
    try:
        studio.raytrm("cluster", "head", "--tier", HEAD_TIER, check=True)
        mba.raytrm("cluster", "join", rig.address("studio"), "--tier", WORKER_TIER, check=True)
        config, run = tmp_path / "config.yaml", tmp_path / "run"
        doc = training_config(studio, tmp_path)
        doc["training"].update(steps=STEPS, log_interval=1)
        config.write_text(yaml.safe_dump(doc))
        argv = ("train", "--config", str(config), "--address", "auto", "--elastic", "--out", str(run), "--quiet")
        driver = studio.popen(sys.executable, "-m", "raytrm.cli", *argv, log=tmp_path / "driver.log")
        end = time.monotonic() + 400
        while steps_logged(run) < 25 and driver.poll() is None and time.monotonic() < end:
            time.sleep(0.5)  # past step 10, where the deadline is taken from the measured steps
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()
        mba.stop()
        time.sleep(10)  # under Ray's health checks: the node stays in the cluster, its worker stays alive
        mba.cont()
        assert driver.wait(timeout=600) == 0, (tmp_path / "driver.log").read_text()
        summary = json.loads((run / "summary.json").read_text())
        changes = summary["membership"]
        print(json.dumps(changes, indent=1))
        left = [c for c in changes if c["left"] == ["w01"]]
        entered = [c for c in changes if c["entered"] == ["w01"]]
        assert summary["steps"] == STEPS
        assert left and entered and left[0]["step"] <= entered[0]["step"]
        assert left[0]["waited_s"] < left[0]["deadline_s"] + 10  # the measured deadline, not the first 60 s
        # the next membership within its settling time and some seconds: here 2.0 s in some runs, 8.0 s in others,
        # 6 s of the latter not yet traced
        assert left[0]["seconds"] < SETTLE_S + 8
    finally:
        mba.cont()
        mba.raytrm("cluster", "stop")
        studio.raytrm("cluster", "stop")
