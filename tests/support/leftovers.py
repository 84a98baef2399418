"""What a rig leaves, and how it is removed whatever happens: its namespaces and cgroups are named PREFIX + its
maker's pid, so those of a rig whose maker died before its teardown are found (and removed, with any process left in
them) when the next rig starts; a live rig is removed at its maker's exit, and on SIGTERM or SIGHUP where nobody
else handles them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
from pathlib import Path
from types import FrameType
from typing import Protocol

from tests.support import cpu_quota

#: Names are PREFIX + the making process's id + "-" + a count (+ "-" + a host's name): a stale one names its maker.
PREFIX = "rtn"


class Closable(Protocol):
    def close(self) -> None: ...


def stale(name: str) -> bool:
    """Whether name is a rig's whose maker is gone."""
    maker = name[len(PREFIX) :].partition("-")[0]
    return name.startswith(PREFIX) and maker.isdigit() and not Path(f"/proc/{maker}").exists()


def delete_netns(ns: str) -> None:
    """Kill whatever still runs in namespace ns (only a stale rig's host has any), then delete it."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
    for pid in (int(p) for p in pids.split()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def remove_stale_rigs() -> list[str]:
    """Delete the namespaces and cgroups of rigs whose maker is gone, with any process left in them, so they neither
    pile up nor clash with a new rig's names; returns their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    namespaces = [ns for ns in (line.split()[0] for line in listed.splitlines() if line.strip()) if stale(ns)]
    for ns in namespaces:
        delete_netns(ns)
    found = cpu_quota.find_hierarchy()
    groups = [] if isinstance(found, str) else [g for g in found.groups(PREFIX) if stale(g.name)]
    for group in groups:
        cpu_quota.remove(group)
    return namespaces + [g.name for g in groups]


_live: set[Closable] = set()
_watching = False


def watch(rig: Closable) -> None:
    """Close rig at exit or on SIGTERM or SIGHUP, unless forgotten first."""
    global _watching
    _live.add(rig)
    if _watching:
        return
    _watching = True
    atexit.register(_close_live)
    if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) == signal.SIG_DFL:
                signal.signal(signum, _close_and_resend)


def forget(rig: Closable) -> None:
    _live.discard(rig)


def _close_live() -> None:
    for rig in list(_live):
        rig.close()


def _close_and_resend(signum: int, frame: FrameType | None) -> None:
    """Close the live rigs, then die of the signal as if it had not been handled."""
    _close_live()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
