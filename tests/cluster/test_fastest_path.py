"""The fastest path on two real hosts joined by a slow LAN and a fast direct link (a Wi-Fi and a Thunderbolt bridge):
`raytrm cluster paths` measures both and picks the direct link every time, the LAN once the link is down, and says in
one line that it cannot reach the head once both are; `cluster head` + `cluster join` record the direct link for the
gradient sync, and the sync (`cluster status --link`, Ray Train's workers and raytrm's own actors) goes through it;
the MacBook's whole host stopped mid-run (a lid closed) costs the Studio a deadline, not a restart, and comes back into
the run; a Mac mini on the LAN alone joins, the three train over the LAN they all share, and the mini killed mid-run
and a fresh one joined in its place cost no restart; `cluster stop` leaves nothing running; a head without its path
service there, or an address nothing answers at, is one line."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections import Counter

import pytest
import yaml

from raytrm.sync.membership import SETTLE_S
from raytrm.train.run.metrics import read_metrics
from tests.support.elastic_training import steps_logged
from tests.support.hosts import HostSpec, LinkSpec, Rig, cannot_make_hosts

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LAN_RATE, TB_RATE = "20mbit", "1gbit"
HEAD_TIER, WORKER_TIER = "mac-desktop-16gb", "macbook-air-8gb"
SERVICE = (sys.executable, "-m", "raytrm.distributed.path_service", "--port", "6380")
# A table row: "  IFACE LOCAL -> REMOTE (IFACE)  RATE UNIT  LATENCY ms".
ROW = re.compile(r"^\s+(\S+) (\S+) -> (\S+) \((\S+)\)\s+([\d.]+) (Mbit|Gbit)/s\s+([\d.]+) ms")


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """Hosts studio and mba on a LAN at LAN_RATE, joined directly by "tb" at TB_RATE, and mini on the LAN alone, each
    with the cluster token."""
    reason = cannot_make_hosts()
    if reason:
        pytest.skip(f"namespace hosts cannot be made here: {reason}")
    hosts = [HostSpec("studio", lan=LAN_RATE), HostSpec("mba", lan=LAN_RATE), HostSpec("mini", lan=LAN_RATE)]
    with Rig(tmp_path_factory.mktemp("paths"), hosts, [LinkSpec("tb", "studio", "mba", rate=TB_RATE)]) as made:
        made.share_token()
        yield made


def rows(stdout: str) -> dict[str, float]:
    """Mbit/s measured by the head's address, from the printed table."""
    found = {}
    for line in stdout.splitlines():
        m = ROW.match(line)
        if m:
            found[m.group(3)] = float(m.group(5)) * (1e3 if m.group(6) == "Gbit" else 1)
    return found


def one_line(done) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stdout, done.stderr)
    return lines[0]


def test_the_direct_link_is_chosen_every_time_and_the_lan_once_it_is_down(rig):
    studio, mba = rig["studio"], rig["mba"]
    head_lan, head_tb, mba_tb = rig.address("studio"), rig.address("studio", "tb"), rig.address("mba", "tb")
    service = studio.popen(
        *SERVICE, "--token-file", str(studio.home / ".ray" / "auth_token"), log=studio.root / "p.log"
    )
    try:
        deadline = time.monotonic() + 60
        while (done := mba.raytrm("cluster", "paths", head_lan)).returncode != 0 and time.monotonic() < deadline:
            time.sleep(0.5)  # the service is starting
        trials = [done] + [mba.raytrm("cluster", "paths", head_lan, check=True) for _ in range(2)]
        for done in trials:
            print(done.stdout)
            assert f"the fastest: tb {mba_tb} (`raytrm cluster join` takes it" in done.stdout, done.stdout
            measured = rows(done.stdout)
            assert set(measured) == {head_lan, head_tb}, done.stdout
            assert measured[head_tb] > 2 * measured[head_lan] and measured[head_lan] < 25, measured

        rig.down("tb")
        try:
            down = mba.raytrm("cluster", "paths", head_lan, check=True)
            rig.down("lan", "mba")  # every path gone: the Mac is off every network the head is on
            try:
                gone = one_line(mba.raytrm("cluster", "paths", head_lan))
            finally:
                rig.up("lan", "mba")
        finally:
            rig.up("tb")
        print(down.stdout)
        assert f"the fastest: lan {rig.address('mba')} (" in down.stdout, down.stdout
        assert head_tb not in rows(down.stdout)  # unplugged: listed no more, or listed and not answering
        assert gone.startswith(f"raytrm: error: {head_lan}:6380: cannot reach the head there ("), gone

        nobody = one_line(mba.raytrm("cluster", "paths", "10.232.0.99"))
        assert nobody.startswith("raytrm: error: 10.232.0.99:6380: cannot reach the head there ("), nobody
    finally:
        for pid in services(studio):  # the service itself, inside the host: killing its nsenter leaves it running
            os.kill(pid, signal.SIGKILL)
        service.wait()


def training_config(host, tmp_path) -> dict:
    """A tiny TRM on Sudoku generated on host, two steps."""
    data = tmp_path / "sudoku"
    host.raytrm("data", "sudoku", "--out", str(data), "--count", "100", "--test-count", "8", check=True)
    model = {"hidden_size": 32, "L_layers": 1, "H_cycles": 2, "L_cycles": 1, "halt_max_steps": 3}
    training = {"global_batch_size": 16, "lr": 3e-3, "warmup_steps": 1, "threads": 1, "seed": 4, "steps": 2}
    return {"model": model, "data": {"path": str(data)}, "training": training}


@pytest.fixture(scope="module")
def cluster(rig):
    """The Studio's head and the MacBook joined to it by `raytrm cluster join` with the LAN address: (head, join)."""
    studio, mba = rig["studio"], rig["mba"]
    try:
        head = studio.raytrm("cluster", "head", "--tier", HEAD_TIER, check=True)
        yield head, mba.raytrm("cluster", "join", rig.address("studio"), "--tier", WORKER_TIER, check=True)
    finally:
        mba.cont()
        for host in (rig["mini"], mba, studio):
            host.raytrm("cluster", "stop")


def test_head_and_join_record_the_direct_link_and_the_sync_goes_through_it(rig, cluster, tmp_path):
    studio, mba_tb, head_lan = rig["studio"], rig.address("mba", "tb"), rig.address("studio")
    head, join = cluster
    assert "path service on port 6380, every interface" in head.stdout, head.stdout
    print(join.stdout)
    assert f"the gradient sync takes the fastest: tb {mba_tb}" in join.stdout, join.stdout
    # Ray's own address stays on the LAN, which every Mac of a cluster reaches.
    assert f"as a node of tier {WORKER_TIER} at {rig.address('mba')}" in join.stdout, join.stdout

    status = studio.raytrm("cluster", "status", "--link", check=True, timeout=300)
    print(status.stdout)
    assert f"(joined by the path of {mba_tb})" in status.stdout, status.stdout
    link = re.search(r"link between the 2 raytrm machines: ([\d.]+) Mbit/s .*\(gloo through (.*), as", status.stdout)
    assert link, status.stdout
    assert link.group(2) == f"{head_lan} tb, {rig.address('mba')} tb", link.group(2)
    assert float(link.group(1)) > 2 * 20, link.group(1)  # more than the LAN could carry

    # Training on both: each worker's gloo binds the direct link, chosen before the process group started.
    config, run = tmp_path / "config.yaml", tmp_path / "run"
    config.write_text(yaml.safe_dump(training_config(studio, tmp_path)))
    studio.raytrm("train", "--config", str(config), "--address", "auto", "--out", str(run), check=True, timeout=400)
    for rank in (0, 1):
        assert "the gradient sync goes through tb" in (run / "logs" / f"worker-{rank}.log").read_text(), rank


#: Long enough that the Studio, alone while the MacBook is stopped, cannot finish the run before it comes back.
ELASTIC_STEPS = 600


def test_a_host_stopped_mid_run_costs_a_deadline_and_comes_back(rig, cluster, tmp_path):
    """Through raytrm's own actors (`--elastic`), whose Macs may come and go, over the direct link."""
    studio, mba = rig["studio"], rig["mba"]
    config, run = tmp_path / "config.yaml", tmp_path / "run"
    doc = training_config(studio, tmp_path)
    doc["training"].update(steps=ELASTIC_STEPS, log_interval=1)
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
    for rank in (0, 1):
        log = (run / "logs" / f"worker-{rank}.log").read_text()
        assert f"worker w0{rank}: the gradient sync goes through tb" in log, log
    summary = json.loads((run / "summary.json").read_text())
    changes = summary["membership"]
    print(json.dumps(changes, indent=1))
    left = [c for c in changes if c["left"] == ["w01"]]
    entered = [c for c in changes if c["entered"] == ["w01"]]
    assert summary["steps"] == ELASTIC_STEPS
    assert left and entered and left[0]["step"] <= entered[0]["step"]
    assert left[0]["waited_s"] < left[0]["deadline_s"] + 10  # the measured deadline, not the first 60 s
    # the next membership within its settling time and some seconds: here 2.0 s in some runs, 8.0 s in others,
    # 6 s of the latter not yet traced
    assert left[0]["seconds"] < SETTLE_S + 8


#: The three's run ends on its time budget: long past the fresh mini's entry (its host made, its join, its worker
#: started, the next boundary: 20-30 s here), whatever a step takes on the machine of the day.
THREE_BUDGET_S = 70


def test_three_macs_train_on_the_lan_and_a_mini_killed_and_replaced_enters_without_a_restart(rig, cluster, tmp_path):
    """A Mac mini on the LAN alone joins the Studio and the MacBook: gloo binds the LAN, the one network all three are
    on. Mid-run the mini's host is killed (every process) and a fresh host takes its place (a new HOME and /tmp/ray,
    the same addresses) and joins: the others go on without restarting their group, the fresh mini's worker enters
    at a boundary with a live peer's state, and every step is trained once."""
    studio, mini = rig["studio"], rig["mini"]
    joined = mini.raytrm("cluster", "join", rig.address("studio"), "--tier", WORKER_TIER, check=True, timeout=300)
    assert f"the gradient sync takes the fastest: lan {rig.address('mini')}" in joined.stdout, joined.stdout
    config, run, log = tmp_path / "config.yaml", tmp_path / "run", tmp_path / "driver.log"
    doc = training_config(studio, tmp_path)
    # Exact sync, as the rig's bench runs it: every step a sum, so the step the mini missed is redone by the others
    # (in local rounds the round it missed is dropped, its end step with it).
    training = dict(steps=10**6, time_budget_s=THREE_BUDGET_S, log_interval=1, global_batch_size=24, sync_mode="exact")
    doc["training"].update(training)
    config.write_text(yaml.safe_dump(doc))
    argv = ("train", "--config", str(config), "--address", "auto", "--elastic", "--out", str(run))
    driver = studio.popen(sys.executable, "-m", "raytrm.cli", *argv, log=log)
    try:
        end = time.monotonic() + 400
        while steps_logged(run) < 25 and driver.poll() is None and time.monotonic() < end:
            time.sleep(0.5)  # past step 10, where the deadline is taken from the measured steps
        assert driver.poll() is None and steps_logged(run) >= 25, log.read_text()[-3000:]
        token = (studio.home / ".ray" / "auth_token").read_text()
        killed_at = steps_logged(run)
        rig.restart("mini")  # the old host killed, every process of it; a fresh one with the same addresses
        rig.share_token(token)
        rig["mini"].raytrm("cluster", "join", rig.address("studio"), "--tier", WORKER_TIER, check=True, timeout=300)
        assert driver.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    out = log.read_text()
    binds = re.search(r"the gradient sync binds (.*)", out)
    assert binds and binds.group(1).count(": lan ") == 3, out  # every node's LAN interface, the bridge's ends too
    summary = json.loads((run / "summary.json").read_text())
    changes = summary["membership"]
    print(json.dumps(changes, indent=1))
    (left,) = [c for c in changes if c.get("left")]
    (entered,) = [c for c in changes if c.get("entered")]
    assert left["left"][0] in ("w01", "w02") and len(left["left"]) == 1 and left["step"] >= killed_at, left
    # The fresh mini's worker, the first the driver started after the loss: none went to the old mini's node, which
    # Ray still lists until its health checks fail.
    (fresh,) = entered["entered"]
    assert fresh == "w03" and entered["step"] > left["step"], entered
    assert len(entered["workers"]) == 3 and left["left"][0] not in entered["workers"]
    for name in sorted({"w00", "w01", "w02", fresh} - set(left["left"])):
        worker = (run / "logs" / f"worker-{int(name[1:])}.log").read_text()
        assert f"worker {name}: the gradient sync goes through lan" in worker, (name, worker[-2000:])
    # No restart: one attempt, every step trained once, none missing, to the end the time budget set.
    assert summary["resumed_from_step"] is None and "restarting" not in out, out
    steps = Counter(r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r)
    assert steps and set(steps.values()) == {1} and sorted(steps) == list(range(1, summary["steps"] + 1))
    assert summary["steps"] > entered["step"]


def test_a_head_without_its_path_service_is_one_line_and_stop_leaves_nothing_running(rig, cluster):
    studio, mba, head_lan = rig["studio"], rig["mba"], rig.address("studio")
    # A head without a path service on the port given (an older raytrm, a wrong port): one line, no node.
    mba.raytrm("cluster", "stop", check=True)
    older = one_line(mba.raytrm("cluster", "join", head_lan, "--tier", WORKER_TIER, "--paths-port", "6390"))
    assert older.startswith(f"raytrm: error: {head_lan}:6390: no path service listens there ("), older
    stopped = studio.raytrm("cluster", "stop", check=True)
    assert stopped.stdout.strip() == "stopped this Mac's Ray node and its path service", stopped.stdout
    assert not services(studio) and not (studio.root / "ray" / "raytrm_paths.pid").exists()


def services(host) -> list[int]:
    """The host's path service processes (by their ids on this machine)."""
    found = []
    for pid in host.pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"raytrm.distributed.path_service" in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found
