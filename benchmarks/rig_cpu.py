"""Where the rig hosts' cores go during a run: every process of each host sampled from /proc as the run passes two
steps, and the cores each used in between, the training worker's apart from everything else (Ray's daemons, Ray
Train's actors, the driver). On a host with a quota of 0.4 or 0.8 of a core, Ray's fixed processes are a large share
of it; on a Mac with 8 to 24 cores the same processes are a small one, so the bench says how much they took, and
can keep them out of the quotas (RayApart) to measure the training as such a Mac runs it."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.elastic_training import steps_logged
from tests.support.host import Host
from tests.support.rig import Rig

#: The training worker's process title under Ray Train and under `raytrm train --elastic`.
WORKERS = ("ray::RayTrainWorker", "ray::ElasticWorker")
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> tuple[float, str] | None:
    """A process's CPU seconds so far (user and system) and its command line, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS, command


@dataclass
class HostCores:
    """Cores a host's processes used between two steps of a run."""

    worker: float
    others: float


Sample = dict[str, dict[int, tuple[float, str] | None]]  # each host's processes: CPU seconds and command line


class CpuWatch:
    """Samples the hosts' processes when the run in run_dir logs step `first` and step `last` (a thread)."""

    def __init__(self, hosts: Sequence[Host], run_dir: Path, first: int, last: int) -> None:
        self.hosts, self.run_dir, self.first, self.last = list(hosts), run_dir, first, last
        self._marks: dict[int, tuple[float, Sample]] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> CpuWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._done.is_set() and self.last not in self._marks:
            logged = steps_logged(self.run_dir)
            for step in (self.first, self.last):
                if logged >= step and step not in self._marks:
                    now = time.monotonic()
                    self._marks[step] = (now, {h.name: {p: _cpu(p) for p in h.pids()} for h in self.hosts})
            time.sleep(0.5)

    def cores(self) -> dict[str, HostCores] | None:
        """Each host's cores used between the two steps (by name), None where the run did not pass both. A process
        that started or ended in between is left out."""
        if self.first not in self._marks or self.last not in self._marks:
            return None
        (t0, before), (t1, after) = self._marks[self.first], self._marks[self.last]
        found = {}
        for name, processes in after.items():
            used: list[tuple[str, float]] = []
            for pid, now in processes.items():
                then = before[name].get(pid)
                if now is not None and then is not None:
                    used.append((now[1], (now[0] - then[0]) / (t1 - t0)))
            worker = sum(c for command, c in used if command.startswith(WORKERS))
            found[name] = HostCores(worker, sum(c for _, c in used) - worker)
        return found


class RayApart:
    """While it runs (a thread), every process of the rig's hosts but their training workers (Ray's daemons and idle
    workers, the path service, the driver) runs in the host's spare cgroup, outside its quota, and the training
    workers in the quota: each quota's cores go to the training alone, as a Mac's do where Ray's daemons take a
    percent of its cores. A worker starts in the spare group (Ray's raylet forks it) and is moved into the quota
    within `every` seconds of taking its actor's title, long before the steady steps. At its end every process is
    back in its host's quota."""

    def __init__(self, rig: Rig, every: float = 0.25) -> None:
        self.rig, self.every = rig, every
        self.hosts = [h for h in rig.hosts.values() if h.cgroup is not None]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._move, daemon=True)

    def __enter__(self) -> RayApart:
        self._sort()  # the daemons already running leave the quotas before the run starts
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self._sort(apart=False)  # every process back in its quota, or the next run's workers would start outside it

    def _move(self) -> None:
        while not self._done.wait(self.every):
            self._sort()

    def _sort(self, apart: bool = True) -> None:
        for host in self.hosts:
            quota, spare = host.cgroup, self.rig.spare(host.name)
            assert quota is not None
            inside, outside = set(quota.pids()), set(spare.pids())
            for pid in host.pids():
                if pid == host.pid:
                    continue
                found = _cpu(pid)
                training = found is not None and found[1].startswith(WORKERS)
                group, members = (spare, outside) if apart and not training else (quota, inside)
                if pid not in members:
                    with contextlib.suppress(OSError):  # gone meanwhile
                        group.add(pid)
