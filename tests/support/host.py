"""One host of the rig: a PID namespace whose init reaps orphans (so `ray stop` sees only the host's own processes,
and killing the init removes them all, whatever happened), a mount namespace with its own /tmp/ray, its own HOME
(its own ~/.ray/auth_token), in a network namespace the rig made, and optionally in a CPU quota's cgroup.

Every process the host runs starts in its cgroup (children inherit it), so the quota holds for all of them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.cpu_quota import CpuGroup

# PID 1 of a host: reaps whatever its processes orphan, or `ray stop` would wait on zombies for its grace period.
REAPER = """
import os, time
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.2)
"""
# Moves itself into the cgroup whose cgroup.procs is $0, then becomes the command: what it starts inherits the group.
INTO_CGROUP = 'echo $$ > "$0" && exec "$@"'
# The states of a process that will not run until continued (stopped, traced) or ever again (zombie, dead, gone).
STOPPED = ("T", "t", "Z", "X", None)


class Host:
    """One host: run commands in its namespaces with its HOME and this Python's environment on PATH.

    ip is the address the other hosts reach it at by default; addresses maps each path it is on (the rig's "lan",
    or a direct link's name) to its address there.
    """

    def __init__(
        self,
        name: str,
        netns: str,
        ip: str,
        root: Path,
        addresses: dict[str, str] | None = None,
        cgroup: CpuGroup | None = None,
    ) -> None:
        self.name, self.netns, self.ip, self.root = name, netns, ip, root
        self.addresses = addresses or {}
        self.cgroup = cgroup
        self.home = root / "home"
        self.home.mkdir(parents=True)
        (root / "ray").mkdir()
        namespaces = ["unshare", "--pid", "--mount", "--fork", "--mount-proc", "--propagation", "private"]
        argv = self._in_cgroup(["ip", "netns", "exec", netns, *namespaces, sys.executable, "-c", REAPER])
        with (root / "init.log").open("w") as log:  # unshare's complaints when its child is killed, among others
            self._init = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            self.pid = self._find_init()
            Path("/tmp/ray").mkdir(exist_ok=True)  # the mount point; this host's own directory is bound over it
            self.run("mount", "--bind", str(root / "ray"), "/tmp/ray", check=True)
        except BaseException:
            self._init.kill()
            self._init.wait(timeout=30)
            raise

    def _find_init(self) -> int:
        """The reaper's id: the first process whose PID namespace is not the one its parent made it from."""
        mine = os.readlink("/proc/self/ns/pid")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for pid in _descendants(self._init.pid):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/ns/pid") != mine:
                        return pid
            time.sleep(0.05)
        log = (self.root / "init.log").read_text().strip()
        raise RuntimeError(f"host {self.name}: its namespaces did not start: {log or 'no output'}")

    def _in_cgroup(self, argv: list[str]) -> list[str]:
        return argv if self.cgroup is None else ["sh", "-c", INTO_CGROUP, str(self.cgroup.procs), *argv]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTRM_CACHE"))}
        env["HOME"] = str(self.home)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.update(extra or {})
        return env

    def _argv(self, argv: tuple[str, ...]) -> list[str]:
        return self._in_cgroup(["nsenter", "-t", str(self.pid), "-n", "-p", "-m", "--", *argv])

    def run(
        self, *argv: str, env: dict[str, str] | None = None, timeout: float | None = 240, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self._argv(argv), env=self.env(env), capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done

    def popen(self, *argv: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A long-running command on this host, its stdout and stderr together in the file log."""
        with log.open("w") as out:  # a file, not a pipe: nobody reads while it runs, and a full pipe would block it
            return subprocess.Popen(self._argv(argv), env=self.env(env), stdout=out, stderr=subprocess.STDOUT)

    def raytrm(self, *args: str, **kw) -> subprocess.CompletedProcess[str]:
        return self.run(sys.executable, "-m", "raytrm.cli", *args, **kw)

    @property
    def alive(self) -> bool:
        return self._namespace() is not None

    def _namespace(self) -> str | None:
        """The host's PID namespace, None once its init is gone (its id may then be another process's)."""
        try:
            ns = os.readlink(f"/proc/{self.pid}/ns/pid")
        except OSError:
            return None
        mine = _ppid(self.pid) == self._init.pid and ns != os.readlink("/proc/self/ns/pid")
        return ns if mine and self._init.poll() is None else None

    def pids(self) -> list[int]:
        """The processes of the host's PID namespace, init included, by their ids on this machine."""
        ns = self._namespace()
        if ns is None:
            return []
        found = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry.name}/ns/pid") == ns:
                        found.append(int(entry.name))
        return found

    def _outside(self, pids: list[int]) -> list[int]:
        """The parents outside the namespace of its processes: unshare for init, an nsenter for each command run."""
        inside = set(pids)
        return sorted({p for p in map(_ppid, pids) if p and p not in inside and p != os.getpid()})

    def stop(self, timeout: float = 10.0) -> None:
        """SIGSTOP every process of the host (a Mac asleep, its network still up); returns once all are stopped,
        those started meanwhile included.

        The parents outside (nsenter) stop first and continue last: an nsenter that sees its child stop stops
        itself, and then nothing would continue it.
        """
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            outside = [p for p in self._outside(pids) if _state(p) not in STOPPED]
            inside = [p for p in pids if _state(p) not in STOPPED]
            if not outside and not inside:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {self.name}: processes {outside + inside} did not stop")
            _signal(outside or inside, signal.SIGSTOP)
            time.sleep(0.01)

    def cont(self, timeout: float = 10.0) -> None:
        """SIGCONT every process of the host (and the parents outside, once those inside run)."""
        pids = self.pids()
        _signal(pids, signal.SIGCONT)
        deadline = time.monotonic() + timeout
        while any(_state(p) in ("T", "t") for p in pids) and time.monotonic() < deadline:
            time.sleep(0.01)
        _signal(self._outside(pids), signal.SIGCONT)

    def stopped(self) -> bool:
        """Whether every process of the host is stopped."""
        return all(_state(pid) in STOPPED for pid in self.pids())

    def close(self) -> None:
        """Kill the host's init: the kernel then kills every process of its PID namespace (stopped ones too); the
        parents outside are continued, if stopped, to collect them."""
        if self._namespace() is not None:
            outside = self._outside(self.pids())
            _signal([self.pid], signal.SIGKILL)
            _signal(outside, signal.SIGCONT)
        self._init.wait(timeout=30)

    kill = close


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])


def _state(pid: int) -> str | None:
    """A process's state letter (R, S, T for stopped, Z...), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _descendants(pid: int) -> list[int]:
    found, todo = [], _children(pid)
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo.extend(_children(child))
    return found
