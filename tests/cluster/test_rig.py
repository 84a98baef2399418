"""The rig itself: three hosts with CPU quotas on a LAN, two of them also joined by a faster direct link. Each host
reaches the others over every path it shares with them and no other; a shaped path carries its rate, and its new
rate once degraded; a host's busy loop gets its quota of a core; a path taken down stops answering until brought
back; a stopped host answers nothing until continued; a killed host starts afresh with its addresses; and a rig
leaves nothing behind, whether its body raised, its maker was terminated, or its maker was killed outright."""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import cpu_quota
from tests.support.hosts import HostSpec, LinkSpec, Rig, cannot_make_hosts, rate_bits, remove_stale_rigs

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
NAMES = ["studio", "mba", "mbp"]  # the three_hosts fixture's, the Studio and the first MacBook joined by "tb" too

# Spins for SECONDS of wall time, then prints the share of one core it got meanwhile.
BUSY = """
import sys, time
start, cpu = time.perf_counter(), time.process_time()
while time.perf_counter() - start < float(sys.argv[1]):
    pass
print((time.process_time() - cpu) / (time.perf_counter() - start))
"""
# Says "awake" to every connection on PORT.
AWAKE = """
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
while True:
    conn, _ = server.accept()
    conn.sendall(b"awake")
    conn.close()
"""
# Prints what ADDRESS PORT says within SECONDS, or "nothing" (the kernel accepts a connection for a stopped process).
ASK = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as conn:
        print(conn.recv(16).decode() or "nothing")
except OSError:
    print("nothing")
"""
AWAKE_PORT = 45679


def within(got: float, rate: str) -> bool:
    """TCP over a shaped path gets most of its rate in a short transfer, never more."""
    set_mbit = rate_bits(rate) / 1e6
    return 0.6 * set_mbit < got < 1.05 * set_mbit


def test_each_host_reaches_the_others_on_the_lan_and_the_pair_over_both_paths(three_hosts):
    rig = three_hosts
    assert rig.paths("studio", "mba") == ["tb", "lan"] and rig.paths("mba", "mbp") == ["lan"]
    addresses = [rig.address(h, "lan") for h in NAMES] + [rig.address(h, "tb") for h in ("studio", "mba")]
    assert len(set(addresses)) == 5 and rig["studio"].ip == rig.address("studio", "lan")
    for src, dst in itertools.permutations(NAMES, 2):
        assert rig.reaches(src, dst), (src, dst)
    assert rig.reaches("studio", "mba", via="tb") and rig.reaches("mba", "studio", via="tb")
    assert not rig.reaches("mbp", "studio", via="tb")  # the direct link is the pair's alone
    for name in NAMES:  # no way out of the rig
        assert "default" not in rig[name].run("ip", "route", check=True).stdout


def test_each_shaped_path_carries_its_rate(three_hosts):
    rig = three_hosts
    lan_rate, tb_rate = rig.specs["mba"].lan, rig.links["tb"].rate
    assert lan_rate == "100mbit" and tb_rate == "1gbit"
    assert all("tbf" in q and "rate 100Mbit" in q for q in rig.qdiscs("lan")), rig.qdiscs("lan")
    assert all("tbf" in q and "rate 1Gbit" in q for q in rig.qdiscs("tb")), rig.qdiscs("tb")
    lan = [rig.transfer_mbit("studio", "mba", seconds=1), rig.transfer_mbit("mbp", "studio", seconds=1)]
    tb = rig.transfer_mbit("studio", "mba", via="tb", seconds=1)
    assert all(within(got, lan_rate) for got in lan), lan
    assert within(tb, tb_rate), tb


def test_each_host_gets_its_cpu_quota_of_a_core(three_hosts, tmp_path):
    rig = three_hosts
    busy = {h: rig[h].popen(sys.executable, "-c", BUSY, "2", log=tmp_path / f"{h}.log") for h in NAMES}
    for loop in busy.values():
        assert loop.wait(timeout=60) == 0
    got = {h: float((tmp_path / f"{h}.log").read_text()) for h in NAMES}
    quotas = {h: rig.specs[h].cpu for h in NAMES}
    assert quotas == {"studio": 0.8, "mba": 0.4, "mbp": 0.4}
    for h, quota in quotas.items():
        assert abs(got[h] / quota - 1) < 0.25, (got, quotas)
        assert rig.cgroups[h].cores() == quota
        assert set(rig[h].pids()) <= set(rig.cgroups[h].pids())


def test_a_degraded_path_carries_its_new_rate(three_hosts):
    rig = three_hosts
    rate = rig.links["tb"].rate
    rig.set_rate("tb", "50mbit")
    try:
        assert all("rate 50Mbit" in q for q in rig.qdiscs("tb")), rig.qdiscs("tb")
        got = rig.transfer_mbit("studio", "mba", via="tb", seconds=1)
        assert within(got, "50mbit"), got
        assert rig.rates[("tb", None)] == "50mbit" and rig.rates[("lan", "mba")] == "100mbit"
    finally:
        rig.set_rate("tb", rate)


def test_a_path_taken_down_stops_answering_and_comes_back(three_hosts):
    rig = three_hosts
    rig.down("tb")
    assert not rig.reaches("studio", "mba", via="tb") and not rig.reaches("mba", "studio", via="tb")
    assert rig.reaches("studio", "mba")  # the LAN still joins them
    rig.up("tb")
    assert rig.reaches("studio", "mba", via="tb")
    rig.down("lan", "mbp")
    assert not rig.reaches("studio", "mbp") and not rig.reaches("mbp", "mba") and rig.reaches("studio", "mba")
    rig.up("lan", "mbp")
    assert rig.reaches("studio", "mbp") and rig.reaches("mbp", "mba")


def ask(rig: Rig, src: str, dst: str, timeout: float) -> str:
    args = (rig.address(dst), str(AWAKE_PORT), str(timeout))
    return rig[src].run(sys.executable, "-c", ASK, *args, check=True).stdout.strip()


def test_a_stopped_host_answers_nothing_until_continued(three_hosts, tmp_path):
    rig = three_hosts
    server = rig["mba"].popen(sys.executable, "-c", AWAKE, str(AWAKE_PORT), log=tmp_path / "awake.log")
    try:
        deadline = time.monotonic() + 30
        while ask(rig, "studio", "mba", 1) != "awake":
            assert time.monotonic() < deadline, (tmp_path / "awake.log").read_text()
        rig["mba"].stop()
        assert rig["mba"].stopped() and len(rig["mba"].pids()) >= 2  # init and the server
        assert ask(rig, "studio", "mba", 1) == "nothing"
        rig["mba"].cont()
        assert not rig["mba"].stopped()
        assert ask(rig, "studio", "mba", 5) == "awake"
    finally:
        server.kill()
        server.wait()


def test_a_killed_host_starts_afresh_with_its_addresses(three_hosts, tmp_path):
    rig = three_hosts
    old = rig["mbp"]
    sleeper = old.popen("sleep", "600", log=tmp_path / "sleep.log")
    (old.home / "left-behind").write_text("")
    rig.kill("mbp")
    assert sleeper.wait(timeout=30) != 0 and not old.alive and old.pids() == []
    assert rig.reaches("studio", "mbp")  # its network stays: its kernel refuses connections
    fresh = rig.restart("mbp")
    assert fresh is rig["mbp"] and fresh.alive and fresh.root.name == "mbp.1"
    assert fresh.addresses == old.addresses and not (fresh.home / "left-behind").exists()
    assert fresh.pid in rig.cgroups["mbp"].pids()  # the same quota
    assert rig.reaches("mbp", "studio") and fresh.run("true").returncode == 0


# -- nothing left behind ---------------------------------------------------------------------------------------------


def leftovers(tag: str) -> list[str]:
    """The namespaces and cgroups of rig tag that still exist."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    found = cpu_quota.find_hierarchy()
    assert not isinstance(found, str), found
    groups = [g.name for g in found.groups(f"{tag}-")]
    return [n for n in names if n == tag or n.startswith(f"{tag}-")] + groups


def root_links() -> set[str]:
    shown = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip() for line in shown.splitlines()}


def dead(pids: list[int], timeout: float = 10) -> bool:
    """Whether processes pids are gone, or zombies (this machine's init collects its orphans in its own time), within
    timeout: a killed process has left its cgroup before it has finished exiting."""

    def gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
        except OSError:
            return True

    deadline = time.monotonic() + timeout
    while not all(gone(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def small_rig(root: Path) -> Rig:
    """Two hosts, one with a quota, on a LAN and a link."""
    return Rig(root, [HostSpec("a", cpu=0.2, lan="10mbit"), HostSpec("b", lan="10mbit")], [LinkSpec("tb", "a", "b")])


# Makes a small rig with a process on a host, prints its tag, then waits for a signal or kills itself (argv[2]).
MAKER = """
import os, signal, sys, time
from pathlib import Path
from tests.cluster.test_rig import small_rig
rig = small_rig(Path(sys.argv[1]))
rig["a"].popen("sleep", "600", log=Path(sys.argv[1]) / "sleep.log")
print(rig.tag, flush=True)
if sys.argv[2] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(600)
"""


def make_elsewhere(root: Path, end: str) -> tuple[subprocess.Popen[str], str]:
    """A process that makes a small rig; its tag, once made."""
    root.mkdir()
    maker = subprocess.Popen([sys.executable, "-c", MAKER, str(root), end], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert maker.stdout is not None
    return maker, maker.stdout.readline().strip()


@pytest.fixture
def can_make():
    reason = cannot_make_hosts(cpu=True)
    if reason:
        pytest.skip(f"namespace hosts with CPU quotas cannot be made here: {reason}")


def test_a_rig_whose_body_raises_leaves_nothing_behind(tmp_path, can_make):
    before = root_links()
    with pytest.raises(RuntimeError, match="the body failed"), small_rig(tmp_path) as rig:
        rig["a"].popen("sleep", "600", log=tmp_path / "sleep.log")
        made = leftovers(rig.tag)
        raise RuntimeError("the body failed")
    assert sorted(made) == sorted([rig.tag, f"{rig.tag}-a", f"{rig.tag}-b", f"{rig.tag}-a"])  # LAN, a, b; a's cgroup
    assert leftovers(rig.tag) == [] and root_links() == before


def test_a_terminated_maker_removes_its_rig_and_a_killed_ones_is_removed_by_the_next(tmp_path, can_make):
    maker, tag = make_elsewhere(tmp_path / "terminated", "wait")
    assert len(leftovers(tag)) == 4
    maker.send_signal(signal.SIGTERM)
    assert maker.wait(timeout=60) == -signal.SIGTERM and leftovers(tag) == []

    maker, tag = make_elsewhere(tmp_path / "killed", "die")
    assert maker.wait(timeout=60) == -signal.SIGKILL
    hierarchy = cpu_quota.find_hierarchy()
    assert isinstance(hierarchy, cpu_quota.Hierarchy), hierarchy
    orphans = cpu_quota.CpuGroup(hierarchy.root / f"{tag}-a", hierarchy.version).pids()
    left = leftovers(tag)
    assert len(left) == 4 and orphans  # the host's processes outlive their maker
    assert set(left) <= set(remove_stale_rigs())
    assert leftovers(tag) == [] and dead(orphans)
    assert tag.startswith(f"rtn{maker.pid}-")


def _pid_of(host, title: str, timeout: float = 10) -> int:
    """The host's process whose command line starts with title (its id on this machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in host.pids():
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().decode().startswith(title):
                    return pid
            except OSError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"no process {title!r} on host {host.name}")


def test_ray_apart_keeps_the_training_worker_in_its_quota_and_the_rest_beside_it_without_one(tmp_path, can_make):
    from benchmarks.rig_cpu import RayApart

    with small_rig(tmp_path) as rig:
        host = rig["a"]
        host.popen("sleep", "600", log=tmp_path / "daemon.log")
        daemon = _pid_of(host, "sleep")
        with RayApart(rig, every=0.05):
            host.popen("bash", "-c", "exec -a ray::ElasticWorker sleep 600", log=tmp_path / "worker.log")
            worker = _pid_of(host, "ray::ElasticWorker")
            spin = host.popen(sys.executable, "-c", BUSY, "1", log=tmp_path / "busy.log")
            assert spin.wait(timeout=60) == 0
            time.sleep(0.2)
            quota, spare = rig.cgroups["a"], rig.spare("a")
            assert worker in quota.pids() and daemon in spare.pids() and daemon not in quota.pids()
        # The spinner left the quota of 0.2 of a core within a tick: it got several times that.
        assert float((tmp_path / "busy.log").read_text()) > 0.4
        assert spare.cores() is None and quota.cores() == 0.2
        assert daemon in quota.pids() and not spare.pids()  # back in the quota at the end
        assert f"{rig.tag}-a-spare" in leftovers(rig.tag)
    assert leftovers(rig.tag) == []
