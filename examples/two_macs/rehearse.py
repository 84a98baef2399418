"""Rehearse session.sh on one Linux machine: two hosts made of network namespaces, as tests/cluster makes them.

    sudo .venv/bin/python examples/two_macs/rehearse.py      # root, Linux, `ip`, `unshare` and `nsenter`; minutes

Host a plays the Mac Studio (advertising tier mac-desktop-16gb), host b the MacBook (macbook-air-8gb). Each step of
session.sh runs on the host that README.md names, and its output is printed; the hosts and every process they started
are removed at the end, whatever happened.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
from conftest import SUBNET, Host, cannot_make_hosts, remove_stale_hosts  # noqa: E402

SESSION = str(ROOT / "examples" / "two_macs" / "session.sh")
STUDIO, MACBOOK = "mac-desktop-16gb", "macbook-air-8gb"


def make_hosts(root: Path) -> tuple[Host, Host, list[str]]:
    """Hosts a and b on one veth pair, each with its own address (the fixture of tests/cluster/conftest.py)."""
    tag, net = f"{os.getpid() % 100000}", os.getpid() % 200 + 20
    names = [f"rta{tag}", f"rtb{tag}"]
    for ns in names:
        subprocess.run(["ip", "netns", "add", ns], check=True)
    veths = [f"va{tag}", f"vb{tag}"]
    link = ["ip", "link", "add", veths[0], "netns", names[0], "type", "veth", "peer", "name", veths[1]]
    subprocess.run([*link, "netns", names[1]], check=True)
    for i, (ns, veth) in enumerate(zip(names, veths, strict=True), start=1):
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{SUBNET.format(net, i)}/24", "dev", veth], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", veth, "up"], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
    a = Host("a", names[0], SUBNET.format(net, 1), root / "a")
    b = Host("b", names[1], SUBNET.format(net, 2), root / "b")
    return a, b, names


def step(host: Host, *args: str, **env: str) -> None:
    print(f"\n[{'studio' if host.name == 'a' else 'macbook'} {host.ip}]$ bash session.sh {' '.join(args)}", flush=True)
    done = host.run("bash", SESSION, *args, env=env, timeout=900)
    print(done.stdout + done.stderr, end="", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"session.sh {args[0]} exited {done.returncode}")


def main() -> None:
    reason = cannot_make_hosts()
    if reason:
        raise SystemExit(f"two namespace hosts cannot be made here: {reason}")
    remove_stale_hosts()
    root = Path(tempfile.mkdtemp(prefix="raytrm-two-macs-"))
    runs = str(root / "runs")  # one filesystem: the path every "Mac" reaches, as a shared folder would be
    a = b = None
    names: list[str] = []
    try:
        a, b, names = make_hosts(root)
        step(a, "head", TIER=STUDIO)
        (b.home / ".ray").mkdir()
        (b.home / ".ray" / "auth_token").write_text((a.home / ".ray" / "auth_token").read_text())  # the scp
        (b.home / ".ray" / "auth_token").chmod(0o600)
        step(b, "join", a.ip, TIER=MACBOOK)
        step(a, "tune", RUNS=runs)
        step(a, "export", RUNS=runs)
        profiles = Path(runs) / "two-macs-tune" / "profiles"
        step(a, "train-here", str(profiles / f"{STUDIO}.yaml"), RUNS=runs)
        step(b, "train-here", str(profiles / f"{MACBOOK}.yaml"), RUNS=runs)
        step(a, "train-both", str(profiles / f"{STUDIO}.yaml"), str(profiles / f"{MACBOOK}.yaml"), RUNS=runs)
        step(b, "stop")
        step(a, "stop")
    finally:
        for host in (b, a):
            if host is not None:
                host.close()
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


if __name__ == "__main__":
    main()
