"""A CPU quota per rig host: a cgroup whose processes together get at most a set number of cores.

Chosen at run time from the mounts: cgroup v2 where a unified hierarchy offers the cpu controller (`cpu.max`, with
+cpu in the parent's cgroup.subtree_control), else cgroup v1's cpu hierarchy (`cpu.cfs_quota_us` over
`cpu.cfs_period_us`). Groups are made directly under the hierarchy's root: v2 lets only the root hold processes and
hand the cpu controller to its children, and the rig's processes start outside any group of their own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

PERIOD_US = 100_000
# A group with a quota is served before the rest of the machine, up to its quota, as a Mac's own cores serve only
# it; groups that contend share in proportion to their quotas (a weight of the most per core). The quotas are meant
# to sum under this machine's cores, so the rest of the machine keeps the remainder.
WEIGHT = {1: ("cpu.shares", 262144, 1024), 2: ("cpu.weight", 10000, 100)}  # the file, the most, the default
MOUNTS = Path("/proc/self/mounts")


@dataclass(frozen=True)
class Hierarchy:
    """A mounted cgroup hierarchy that has the cpu controller: its root and its version (1 or 2)."""

    root: Path
    version: int

    def group(self, name: str) -> CpuGroup:
        """A new group named name under the root, with no quota yet."""
        if self.version == 2:
            control = self.root / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                control.write_text("+cpu")
        path = self.root / name
        path.mkdir()
        return CpuGroup(path, self.version)

    def groups(self, prefix: str) -> list[Path]:
        """The groups under the root whose names start with prefix."""
        return sorted(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(prefix))


@dataclass(frozen=True)
class CpuGroup:
    path: Path
    version: int

    @property
    def procs(self) -> Path:
        """The file a process id is written to, to move that process (and the children it makes later) in."""
        return self.path / "cgroup.procs"

    def limit(self, cores: float | None) -> None:
        """At most `cores` cores (0.4: 40 ms of every 100 ms), or no limit (None)."""
        if cores is not None and cores <= 0:
            raise ValueError(f"cpu quota {cores}: expected a positive number of cores")
        quota = None if cores is None else max(1000, round(cores * PERIOD_US))
        if self.version == 2:
            (self.path / "cpu.max").write_text(f"{quota or 'max'} {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota or -1))
        weight, most, default = WEIGHT[self.version]
        (self.path / weight).write_text(str(default if cores is None else max(default, round(most * min(cores, 1)))))

    def cores(self) -> float | None:
        """The quota as set, in cores; None without one."""
        if self.version == 2:
            quota, period = (self.path / "cpu.max").read_text().split()
        else:
            quota = (self.path / "cpu.cfs_quota_us").read_text().strip()
            period = (self.path / "cpu.cfs_period_us").read_text().strip()
        return None if quota in ("max", "-1") else int(quota) / int(period)

    def pids(self) -> list[int]:
        return _pids(self.path)

    def add(self, pid: int) -> None:
        self.procs.write_text(str(pid))

    def remove(self, timeout: float = 10.0) -> None:
        """Delete the group, once its processes are gone; any still there after half the timeout are killed."""
        remove(self.path, timeout)


def remove(path: Path, timeout: float = 10.0) -> None:
    """Delete the group at path (see CpuGroup.remove); nothing if it is gone already."""
    start = time.monotonic()
    while path.exists():
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # busy: processes are still leaving
            if time.monotonic() - start > timeout:
                raise
            if time.monotonic() - start > timeout / 2:
                for pid in _pids(path):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)


def _pids(group: Path) -> list[int]:
    try:
        return [int(p) for p in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def find_hierarchy(mounts: str | None = None) -> Hierarchy | str:
    """The hierarchy to make quotas in, v2 first, or why there is none; mounts as /proc/self/mounts lists them."""
    mounts = MOUNTS.read_text() if mounts is None else mounts
    offered: list[str] = []
    v1: Path | None = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point, kind, options = Path(fields[1]), fields[2], fields[3].split(",")
        if kind == "cgroup2":
            try:
                controllers = (point / "cgroup.controllers").read_text().split()
            except OSError:
                controllers = []
            if "cpu" in controllers:
                return Hierarchy(point, 2)
            offered.append(f"{point} offers {' '.join(controllers) or 'no controller'}")
        elif kind == "cgroup" and "cpu" in options and v1 is None:
            v1 = point
    if v1 is not None:
        return Hierarchy(v1, 1)
    v2 = f"no cgroup v2 with the cpu controller ({'; '.join(offered)})" if offered else "no cgroup v2 mounted"
    return f"{v2} and no cgroup v1 cpu hierarchy"


def cannot_limit_cpu() -> str | None:
    """Why a CPU quota cannot be set here, or None (root only: it makes and removes a probe group)."""
    found = find_hierarchy()
    if isinstance(found, str):
        return found
    try:
        probe = found.group(f"rtprobe{os.getpid()}")
        try:
            probe.limit(0.5)
        finally:
            probe.remove()
    except OSError as e:
        return f"cannot make a cpu cgroup under {found.root}: {e}"
    return None
