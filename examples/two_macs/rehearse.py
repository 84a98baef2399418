"""Rehearse session.sh on one Linux machine: two hosts made of network namespaces (the rig in the
checkout's tests/support/hosts.py, which tests/cluster uses too).

    sudo .venv/bin/python examples/two_macs/rehearse.py      # root, Linux, `ip`, `unshare` and `nsenter`; minutes

Host a plays the Mac Studio (advertising tier mac-desktop-16gb), host b the MacBook (macbook-air-8gb). Each step of
session.sh runs on the host that README.md names, and its output is printed; the hosts and every process they started
are removed at the end, whatever happened.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the rig is test support in the checkout, not part of the installed package

from tests.support.hosts import Host, Pair, cannot_make_hosts  # noqa: E402

SESSION = str(ROOT / "examples" / "two_macs" / "session.sh")
STUDIO, MACBOOK = "mac-desktop-16gb", "macbook-air-8gb"


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
    root = Path(tempfile.mkdtemp(prefix="raytrm-two-macs-"))
    runs = str(root / "runs")  # one filesystem: the path every "Mac" reaches, as a shared folder would be
    with Pair(root) as pair:
        a, b = pair.a, pair.b
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


if __name__ == "__main__":
    main()
