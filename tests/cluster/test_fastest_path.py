"""The fastest path on two real hosts joined by a slow LAN and a fast direct link (a Wi-Fi and a Thunderbolt bridge):
`raytrm cluster paths` measures both and picks the direct link every time, the LAN once the link is down, and says in
one line that it cannot reach the head once both are; `cluster head` + `cluster join` record the direct link for the
gradient sync, and the sync (`cluster status --link`, Ray Train's workers and raytrm's own actors) goes through it, and
`cluster stop` leaves nothing running; a head without its path service there, or an address nothing answers at, is one
line."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest
import yaml

from tests.support.hosts import HostSpec, LinkSpec, Rig, cannot_make_hosts

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LAN_RATE, TB_RATE = "20mbit", "1gbit"
HEAD_TIER, WORKER_TIER = "mac-desktop-16gb", "macbook-air-8gb"
SERVICE = (sys.executable, "-m", "raytrm.distributed.path_service", "--port", "6380")
# A table row: "  IFACE LOCAL -> REMOTE (IFACE)  RATE UNIT  LATENCY ms".
ROW = re.compile(r"^\s+(\S+) (\S+) -> (\S+) \((\S+)\)\s+([\d.]+) (Mbit|Gbit)/s\s+([\d.]+) ms")


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """Hosts studio and mba on a LAN at LAN_RATE, joined directly by "tb" at TB_RATE, each with the cluster token."""
    reason = cannot_make_hosts()
    if reason:
        pytest.skip(f"namespace hosts cannot be made here: {reason}")
    hosts = [HostSpec("studio", lan=LAN_RATE), HostSpec("mba", lan=LAN_RATE)]
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


def test_head_and_join_record_the_direct_link_and_the_sync_goes_through_it(rig, tmp_path):
    studio, mba = rig["studio"], rig["mba"]
    head_lan, mba_tb = rig.address("studio"), rig.address("mba", "tb")
    try:
        head = studio.raytrm("cluster", "head", "--tier", HEAD_TIER, check=True)
        assert "path service on port 6380, every interface" in head.stdout, head.stdout
        join = mba.raytrm("cluster", "join", head_lan, "--tier", WORKER_TIER, check=True)
        print(join.stdout)
        assert f"the gradient sync takes the fastest: tb {mba_tb}" in join.stdout, join.stdout
        # Ray's own address stays on the LAN, which every Mac of a cluster reaches.
        assert f"as a node of tier {WORKER_TIER} at {rig.address('mba')}" in join.stdout, join.stdout

        status = studio.raytrm("cluster", "status", "--link", check=True, timeout=300)
        print(status.stdout)
        assert f"(joined by the path of {mba_tb})" in status.stdout, status.stdout
        link = re.search(
            r"link between the 2 raytrm machines: ([\d.]+) Mbit/s .*\(gloo through (.*), as", status.stdout
        )
        assert link, status.stdout
        assert link.group(2) == f"{head_lan} tb, {rig.address('mba')} tb", link.group(2)
        assert float(link.group(1)) > 2 * 20, link.group(1)  # more than the LAN could carry

        # Training on both: each worker's gloo binds the direct link, chosen before the process group started.
        config, run = tmp_path / "config.yaml", tmp_path / "run"
        config.write_text(yaml.safe_dump(training_config(studio, tmp_path)))
        studio.raytrm("train", "--config", str(config), "--address", "auto", "--out", str(run), check=True, timeout=400)
        for rank in (0, 1):
            assert "the gradient sync goes through tb" in (run / "logs" / f"worker-{rank}.log").read_text(), rank
        # The same through raytrm's own actors (`--elastic`), whose Macs may come and go.
        argv = ("train", "--config", str(config), "--address", "auto", "--elastic", "--out", str(run / "elastic"))
        studio.raytrm(*argv, check=True, timeout=400)
        for rank in (0, 1):
            log = (run / "elastic" / "logs" / f"worker-{rank}.log").read_text()
            assert f"worker w0{rank}: the gradient sync goes through tb" in log, log

        # A head without a path service on the port given (an older raytrm, a wrong port): one line, no node.
        mba.raytrm("cluster", "stop", check=True)
        older = one_line(mba.raytrm("cluster", "join", head_lan, "--tier", WORKER_TIER, "--paths-port", "6390"))
        assert older.startswith(f"raytrm: error: {head_lan}:6390: no path service listens there ("), older
        stopped = studio.raytrm("cluster", "stop", check=True)
        assert stopped.stdout.strip() == "stopped this Mac's Ray node and its path service", stopped.stdout
    finally:
        mba.raytrm("cluster", "stop")
        studio.raytrm("cluster", "stop")
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
