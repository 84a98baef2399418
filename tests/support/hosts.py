"""Two real hosts on one Linux machine, joined by a link whose rate can be set: the rig of the cluster tests, of the
two-Mac rehearsal and of `python -m benchmarks distributed --parts link`.

Each host is a network namespace with its own address on one veth pair, a PID namespace whose init reaps orphans
(so `ray stop` sees only the host's own processes, and killing the init removes them all, whatever happened) and a
mount namespace with its own /tmp/ray, plus its own HOME (its own ~/.ray/auth_token). The link's rate is a token
bucket filter (tc tbf) on both ends of the pair, so each direction is shaped: netem is missing from some kernels,
tbf is not. Root and Linux only; `cannot_make_hosts` says why not elsewhere.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

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
#: Namespace names are PREFIX + the making process's id + "-" + a count: a stale pair names its dead maker.
PREFIXES = ("rta", "rtb")
#: The token bucket holds at least this many kbit, and at least BURST_S of the rate: a smaller bucket refills too
#: often for fast rates, where tbf then carries well below the rate.
BURST_KBIT, BURST_S = 256, 0.0025
LATENCY = "50ms"  # the longest a packet waits in the bucket's queue
UNSHAPED = "unshaped"
_RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", re.IGNORECASE)
_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_pairs = itertools.count()

# Counts the bytes of one TCP connection, from the first byte to the sender's close; prints them with the seconds.
RECEIVER = """
import json, socket, sys, time
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
conn, _ = server.accept()
total, first = 0, None
while True:
    data = conn.recv(1 << 20)
    if not data:
        break
    first = time.perf_counter() if first is None else first
    total += len(data)
print(json.dumps({"bytes": total, "seconds": time.perf_counter() - (first or 0)}))
"""
# Sends zeros to HOST PORT for SECONDS (connecting once the receiver listens).
SENDER = """
import socket, sys, time
deadline = time.monotonic() + 20
while True:
    try:
        conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
chunk, stop = bytes(1 << 16), time.monotonic() + float(sys.argv[3])
while time.monotonic() < stop:
    conn.sendall(chunk)
conn.close()
"""
TRANSFER_PORT = 45678


def cannot_make_hosts() -> str | None:
    """Why two namespace hosts cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    missing = [tool for tool in ("ip", "tc", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)}"
    probe = f"rtprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def rate_bits(rate: str) -> float | None:
    """A link rate in tc's notation ("20mbit", "1gbit") in bits per second; None for "unshaped"."""
    if rate == UNSHAPED:
        return None
    found = _RATE.fullmatch(rate)
    if found is None:
        raise ValueError(f"link rate {rate!r}: expected {UNSHAPED} or a number with bit, kbit, mbit or gbit (20mbit)")
    return float(found.group(1)) * _UNITS[found.group(2).lower()]


class Host:
    """One host: run commands in its namespaces with its HOME and this Python's environment on PATH."""

    def __init__(self, name: str, netns: str, ip: str, root: Path) -> None:
        self.name, self.netns, self.ip, self.root = name, netns, ip, root
        self.home = root / "home"
        self.home.mkdir(parents=True)
        (root / "ray").mkdir()
        namespaces = ["unshare", "--pid", "--mount", "--fork", "--mount-proc", "--propagation", "private"]
        self._init = subprocess.Popen(["ip", "netns", "exec", netns, *namespaces, sys.executable, "-c", REAPER])
        try:
            self.pid = self._find_init()
            Path("/tmp/ray").mkdir(exist_ok=True)  # the mount point; this host's own directory is bound over it
            self.run("mount", "--bind", str(root / "ray"), "/tmp/ray", check=True)
        except BaseException:
            self._init.kill()
            self._init.wait(timeout=30)
            raise

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
    """Delete the empty namespaces of hosts whose maker is gone (a run killed before its teardown), so they neither
    pile up nor clash with a new run's names; returns their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    removed = []
    for ns in (line.split()[0] for line in listed.splitlines() if line.strip()):
        maker = ns[3:].partition("-")[0]
        if ns[:3] not in PREFIXES or not maker.isdigit() or Path(f"/proc/{maker}").exists():
            continue
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
        if not pids.strip():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            removed.append(ns)
    return removed


class Pair:
    """Hosts a and b joined by a veth pair, each with its own address, made under root; a context manager that
    removes them and every process they started at its end, whatever happened.

    `set_rate` shapes the link in both directions (or unshapes it), and may be called between measurements;
    `transfer_mbit` measures what one TCP connection gets through it.
    """

    def __init__(self, root: Path) -> None:
        remove_stale_hosts()
        count = next(_pairs)
        tag = f"{os.getpid()}-{count}"
        net = (os.getpid() + count) % 200 + 20
        self.netns = [f"{prefix}{tag}" for prefix in PREFIXES]
        self.veths = [f"va{tag}", f"vb{tag}"]
        self.rate = UNSHAPED
        self.hosts: list[Host] = []
        try:
            for ns in self.netns:
                subprocess.run(["ip", "netns", "add", ns], check=True)
            link = ["ip", "link", "add", self.veths[0], "netns", self.netns[0], "type", "veth"]
            subprocess.run([*link, "peer", "name", self.veths[1], "netns", self.netns[1]], check=True)
            for i, (ns, veth) in enumerate(zip(self.netns, self.veths, strict=True), start=1):
                subprocess.run(["ip", "-n", ns, "addr", "add", f"{SUBNET.format(net, i)}/24", "dev", veth], check=True)
                subprocess.run(["ip", "-n", ns, "link", "set", veth, "up"], check=True)
                subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
            for i, (name, ns) in enumerate(zip("ab", self.netns, strict=True), start=1):
                self.hosts.append(Host(name, ns, SUBNET.format(net, i), root / name))
        except BaseException:
            self.close()
            raise
        self.a, self.b = self.hosts

    def set_rate(self, rate: str) -> None:
        """Shape both directions of the link to rate (tc's notation, "20mbit"), or remove the shaping ("unshaped")."""
        bits = rate_bits(rate)
        for ns, veth in zip(self.netns, self.veths, strict=True):
            if bits is not None:
                burst = f"{max(BURST_KBIT, round(bits * BURST_S / 1e3))}kbit"
                shape = ["tbf", "rate", rate, "burst", burst, "latency", LATENCY]
                tc = ["tc", "-n", ns, "qdisc", "replace", "dev", veth, "root", *shape]
                subprocess.run(tc, capture_output=True, text=True, check=True)
            else:  # back to the device's default queue; there may be no shaping to remove
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", veth, "root"], capture_output=True, check=False)
        self.rate = rate

    def qdiscs(self) -> list[str]:
        """Each end's root queueing discipline, as tc shows it."""
        ends = zip(self.netns, self.veths, strict=True)
        show = [["tc", "-n", ns, "qdisc", "show", "dev", veth] for ns, veth in ends]
        return [subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip() for argv in show]

    def transfer_mbit(self, src: str = "a", seconds: float = 2.0) -> float:
        """Mbit/s one TCP connection carries from host src to the other for about `seconds`."""
        sender, receiver = (self.a, self.b) if src == "a" else (self.b, self.a)
        log = receiver.root / "transfer.log"
        listening = receiver.popen(sys.executable, "-c", RECEIVER, str(TRANSFER_PORT), log=log)
        try:
            args = (receiver.ip, str(TRANSFER_PORT), str(seconds))
            sender.run(sys.executable, "-c", SENDER, *args, timeout=seconds + 120, check=True)
            listening.wait(timeout=120)
        finally:
            if listening.poll() is None:
                listening.kill()
                listening.wait()
        got = json.loads(log.read_text().strip().splitlines()[-1])
        return got["bytes"] * 8 / max(got["seconds"], 1e-9) / 1e6

    def close(self) -> None:
        """Kill every host's processes, then delete the namespaces (and with them the veth pair)."""
        for host in self.hosts:
            host.close()
        for ns in self.netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    def __enter__(self) -> Pair:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
