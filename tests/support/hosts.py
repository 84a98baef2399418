"""Real hosts on one Linux machine, made of namespaces: the rig of the cluster tests, of the two-Mac rehearsal and
of `python -m benchmarks distributed --parts link`. Root and Linux only; `cannot_make_hosts` says why not elsewhere.

- Pair: hosts a and b joined by one link whose rate can be set (tc tbf at both ends), no CPU quota.
- Rig (tests.support.rig): N hosts with CPU quotas on a shared LAN, direct links between chosen pairs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import TracebackType

from tests.support import cpu_quota
from tests.support.host import Host
from tests.support.leftovers import remove_stale_rigs
from tests.support.links import UNSHAPED, rate_bits
from tests.support.rig import HostSpec, LinkSpec, Rig

__all__ = [
    "UNSHAPED",
    "Host",
    "HostSpec",
    "LinkSpec",
    "Pair",
    "Rig",
    "cannot_make_hosts",
    "rate_bits",
    "remove_stale_rigs",
]


def cannot_make_hosts(cpu: bool = False) -> str | None:
    """Why namespace hosts (with CPU quotas, if cpu) cannot be made here, or None."""
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
    return cpu_quota.cannot_limit_cpu() if cpu else None


class Pair:
    """Hosts a and b joined by one link, each with its own address, no CPU quota, made under root; a context manager
    that removes them and every process they started at its end, whatever happened.

    `set_rate` shapes the link in both directions (or unshapes it), and may be called between measurements;
    `transfer_mbit` measures what one TCP connection gets through it.
    """

    LINK = "link"

    def __init__(self, root: Path) -> None:
        self.rig = Rig(root, [HostSpec("a", lan=None), HostSpec("b", lan=None)], [LinkSpec(self.LINK, "a", "b")])
        self.a, self.b = self.rig["a"], self.rig["b"]
        self.hosts = [self.a, self.b]

    @property
    def rate(self) -> str:
        return self.rig.rates[(self.LINK, None)]

    def set_rate(self, rate: str) -> None:
        """Shape both directions of the link to rate (tc's notation, "20mbit"), or remove the shaping ("unshaped")."""
        self.rig.set_rate(self.LINK, rate)

    def qdiscs(self) -> list[str]:
        """Each end's root queueing discipline, as tc shows it."""
        return self.rig.qdiscs(self.LINK)

    def transfer_mbit(self, src: str = "a", seconds: float = 2.0) -> float:
        """Mbit/s one TCP connection carries from host src to the other for about `seconds`."""
        return self.rig.transfer_mbit(src, "b" if src == "a" else "a", self.LINK, seconds)

    def close(self) -> None:
        self.rig.close()

    def __enter__(self) -> Pair:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
