"""Two real hosts on this machine, made of Linux namespaces, for the cluster commands' tests.

Each host is a network namespace with its own address on one veth pair, a PID namespace whose init reaps orphans
(so `ray stop` sees only the host's own processes, and killing the init removes them all, even after a failed test)
and a mount namespace with its own /tmp/ray, plus its own HOME (its own ~/.ray/auth_token). Root only: elsewhere
the tests are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

# PID 1 of a host: reaps whatever its processes orphan, or `ray stop` would wait on zombies for its grace period.
REAPER = """
import os, time
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.2)
"""
SUBNET = "10.231.{}.{}"


def cannot_make_hosts() -> str | None:
    """Why two namespace hosts cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)}"
    probe = f"rtprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


class Host:
    """One host: run commands in its namespaces with its HOME and the test's virtual environment on PATH."""

    def __init__(self, name: str, netns: str, ip: str, root: Path) -> None:
        self.name, self.netns, self.ip, self.root = name, netns, ip, root
        self.home = root / "home"
        self.home.mkdir(parents=True)
        (root / "ray").mkdir()
        namespaces = ["unshare", "--pid", "--mount", "--fork", "--mount-proc", "--propagation", "private"]
        self._init = subprocess.Popen(["ip", "netns", "exec", netns, *namespaces, sys.executable, "-c", REAPER])
        self.pid = self._find_init()
        Path("/tmp/ray").mkdir(exist_ok=True)  # the mount point; this host's own directory is bound over it
        self.run("mount", "--bind", str(root / "ray"), "/tmp/ray", check=True)

    def _find_init(self) -> int:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for pid in _children(self._init.pid):
                return pid
            time.sleep(0.05)
        raise RuntimeError(f"host {self.name}: its namespaces did not start")

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTRM_CACHE"))}
        env["HOME"] = str(self.home)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.update(extra or {})
        return env

    def _argv(self, argv: tuple[str, ...]) -> list[str]:
        return ["nsenter", "-t", str(self.pid), "-n", "-p", "-m", "--", *argv]

    def run(self, *argv: str, env: dict[str, str] | None = None, timeout: float = 240, check: bool = False):
        done = subprocess.run(
            self._argv(argv), env=self.env(env), capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{self.name}: {' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done

    def popen(self, *argv: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """A long-running command on this host, its stdout and stderr together in the file log."""
        with log.open("w") as out:  # a file, not a pipe: nobody reads while it runs, and a full pipe would block it
            return subprocess.Popen(self._argv(argv), env=self.env(env), stdout=out, stderr=subprocess.STDOUT)

    def raytrm(self, *args: str, **kw):
        return self.run(sys.executable, "-m", "raytrm.cli", *args, **kw)

    def close(self) -> None:
        """Kill the host's init: the kernel then kills every process of its PID namespace."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, 9)
        self._init.wait(timeout=30)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def remove_stale_hosts() -> list[str]:
    """Delete the empty namespaces of hosts whose test process is gone (a run killed before its teardown), so they
    neither pile up nor clash with a new run's names; returns their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    removed = []
    for ns in (line.split()[0] for line in listed.splitlines() if line.strip()):
        tag = ns[3:]
        if ns[:3] not in ("rta", "rtb") or not tag.isdigit() or Path(f"/proc/{tag}").exists():
            continue
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
        if not pids.strip():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            removed.append(ns)
    return removed


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Hosts a and b joined by a veth pair, each with its own address; removed at the end whatever happened."""
    reason = cannot_make_hosts()
    if reason:
        pytest.skip(f"two namespace hosts cannot be made here: {reason}")
    remove_stale_hosts()
    tag = f"{os.getpid() % 100000}"
    net = os.getpid() % 200 + 20
    names = {"a": f"rta{tag}", "b": f"rtb{tag}"}
    made: list[Host] = []
    try:
        for ns in names.values():
            subprocess.run(["ip", "netns", "add", ns], check=True)
        veth_a, veth_b = f"va{tag}", f"vb{tag}"
        subprocess.run(
            [
                "ip",
                "link",
                "add",
                veth_a,
                "netns",
                names["a"],
                "type",
                "veth",
                "peer",
                "name",
                veth_b,
                "netns",
                names["b"],
            ],
            check=True,
        )
        for i, (key, veth) in enumerate((("a", veth_a), ("b", veth_b)), start=1):
            ns = names[key]
            subprocess.run(["ip", "-n", ns, "addr", "add", f"{SUBNET.format(net, i)}/24", "dev", veth], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", veth, "up"], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        root = tmp_path_factory.mktemp("hosts")
        for i, key in enumerate(("a", "b"), start=1):
            made.append(Host(key, names[key], SUBNET.format(net, i), root / key))
        yield {h.name: h for h in made}
    finally:
        for host in made:
            host.close()
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
