"""A rig of N real hosts on one Linux machine, a few Macs' worth: each host (tests.support.host) with its own network,
PID and mount namespaces, HOME and /tmp/ray, and optionally a CPU quota (tests.support.cpu_quota) that every process
it runs shares; joined by
- a shared LAN, the Wi-Fi or Ethernet every Mac is on: a bridge in a namespace of the rig's own, each host joined to
  it by a veth shaped at both ends at that host's LAN rate (so a -> b carries the slower of a's and b's rates);
- direct links between chosen pairs, the Thunderbolt bridge: a veth pair of its own subnet, shaped at both ends;
  so a pair can be joined by two paths of different rates, each with its own addresses, as on real Macs.
Rates can change and paths go down and up while it runs; a host can be stopped, continued, killed and started
afresh with the same name and addresses. There is no default route anywhere: traffic stays between the rig's hosts.
Nothing is left behind, whatever happens (tests.support.leftovers).

    with Rig(root, [HostSpec("studio", cpu=0.8, lan="100mbit"), HostSpec("mba", cpu=0.4, lan="100mbit")],
             [LinkSpec("tb", "studio", "mba", rate="1gbit")]) as rig:
        rig["mba"].raytrm("cluster", "join", rig.address("studio", "tb"), check=True)
        rig.set_rate("tb", "50mbit"); rig.down("lan", "mba"); rig["mba"].stop(); rig["mba"].cont()
        rig.restart("mba")
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from tests.support import cpu_quota, leftovers
from tests.support.host import Host
from tests.support.leftovers import PREFIX
from tests.support.links import (
    ANSWERS,
    CLOSED_PORT,
    RECEIVER,
    SENDER,
    TRANSFER_PORT,
    UNSHAPED,
    qdisc,
    rate_bits,
    set_up,
    shape,
)

__all__ = ["HostSpec", "LinkSpec", "Rig"]

logger = logging.getLogger(__name__)

LAN = "lan"  # the LAN's path name, and each host's interface on it
BRIDGE = "br0"
# The rig's addresses live only in its own namespaces, so rigs made side by side never see each other's.
LAN_ADDRESS = "10.232.0.{}"
LINK_ADDRESS = "10.232.{}.{}"
_NAME = re.compile(r"[a-z][a-z0-9]{0,7}")  # short enough for the interface names made of it
_rigs = itertools.count()


@dataclass(frozen=True)
class HostSpec:
    name: str
    cpu: float | None = None  # the cores its processes share at most (0.4: 40% of one); None: no quota
    lan: str | None = UNSHAPED  # the rate of its attachment to the LAN, both ways; None: not on the LAN


@dataclass(frozen=True)
class LinkSpec:
    name: str  # the path's name ("tb"), unique in the rig; also each end's interface name
    a: str
    b: str
    rate: str = UNSHAPED


class Rig:
    """Hosts and their paths, made under root (a host's files in root/NAME); a context manager that removes
    everything it made, and every process its hosts started, at its end."""

    def __init__(self, root: Path, hosts: Sequence[HostSpec], links: Sequence[LinkSpec] = ()) -> None:
        _check(hosts, links)
        leftovers.remove_stale_rigs()
        self.root, self.maker = root, os.getpid()
        self.tag = f"{PREFIX}{self.maker}-{next(_rigs)}"
        self.specs = {h.name: h for h in hosts}
        self.links = {link.name: link for link in links}
        self.lan_netns = self.tag if any(h.lan is not None for h in hosts) else None
        self.netns = {h.name: f"{self.tag}-{h.name}" for h in hosts}
        self.addresses: dict[str, dict[str, str]] = {h.name: {} for h in hosts}
        self.rates: dict[tuple[str, str | None], str] = {}
        self.hosts: dict[str, Host] = {}
        self.cgroups: dict[str, cpu_quota.CpuGroup] = {}
        self.spares: dict[str, cpu_quota.CpuGroup] = {}  # see spare
        self._made: list[str] = []  # namespaces, in the order made
        self._generations = dict.fromkeys(self.specs, 0)
        leftovers.watch(self)
        try:
            self._build()
            for name in self.specs:
                self.hosts[name] = self._start(name, root / name)
        except BaseException:
            self.close()
            raise

    # -- building ----------------------------------------------------------------------------------------------------

    def _add_netns(self, name: str) -> None:
        subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, check=True)
        self._made.append(name)
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)

    def _build(self) -> None:
        if self.lan_netns is not None:
            self._add_netns(self.lan_netns)
            subprocess.run(["ip", "-n", self.lan_netns, "link", "add", BRIDGE, "type", "bridge"], check=True)
            subprocess.run(["ip", "-n", self.lan_netns, "link", "set", BRIDGE, "up"], check=True)
        for name in self.specs:
            self._add_netns(self.netns[name])
        for i, spec in enumerate(self.specs.values(), start=1):
            if spec.lan is not None:
                port = f"h-{spec.name}"
                self._veth(self.netns[spec.name], LAN, str(self.lan_netns), port)
                subprocess.run(["ip", "-n", self.lan_netns, "link", "set", "dev", port, "master", BRIDGE], check=True)
                self._address(spec.name, LAN, LAN_ADDRESS.format(i))
                self.set_rate(LAN, spec.lan, spec.name)
        for k, link in enumerate(self.links.values(), start=1):
            self._veth(self.netns[link.a], link.name, self.netns[link.b], link.name)
            self._address(link.a, link.name, LINK_ADDRESS.format(k, 1))
            self._address(link.b, link.name, LINK_ADDRESS.format(k, 2))
            self.set_rate(link.name, link.rate)
        hierarchy = None
        for spec in self.specs.values():
            if spec.cpu is not None:
                hierarchy = hierarchy or _hierarchy()
                self.cgroups[spec.name] = hierarchy.group(self.netns[spec.name])
                self.cgroups[spec.name].limit(spec.cpu)

    def spare(self, name: str) -> cpu_quota.CpuGroup:
        """A second cgroup of host name's, beside its quota's and without one: a process moved into it runs on what
        the quotas leave of this machine, as a Mac's background processes run on the cores its training leaves
        (made at the first call; removed with the rig)."""
        if name not in self.cgroups:
            raise ValueError(f"host {name!r} has no CPU quota to keep a process out of")
        if name not in self.spares:
            self.spares[name] = _hierarchy().group(f"{self.netns[name]}-spare")
            self.spares[name].limit(None)
        return self.spares[name]

    def _veth(self, netns: str, dev: str, peer_netns: str, peer: str) -> None:
        """A veth pair made straight into its two namespaces: it never appears in this machine's own."""
        link = ["ip", "-n", netns, "link", "add", "name", dev, "type", "veth"]
        subprocess.run([*link, "peer", "name", peer, "netns", peer_netns], check=True)
        set_up(netns, dev, True)
        set_up(peer_netns, peer, True)

    def _address(self, host: str, path: str, address: str) -> None:
        subprocess.run(["ip", "-n", self.netns[host], "addr", "add", f"{address}/24", "dev", path], check=True)
        self.addresses[host][path] = address

    def _start(self, name: str, root: Path) -> Host:
        addresses = self.addresses[name]
        ip = addresses.get(LAN) or next(iter(addresses.values()))
        return Host(name, self.netns[name], ip, root, addresses=dict(addresses), cgroup=self.cgroups.get(name))

    # -- paths -------------------------------------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def address(self, host: str, path: str = LAN) -> str:
        """Host's address on path: what the other hosts on that path dial to reach it over that path."""
        on = self.addresses.get(host, {})
        if path not in on:
            raise ValueError(f"host {host!r} is not on path {path!r} (its paths: {sorted(on)})")
        return on[path]

    def paths(self, a: str, b: str) -> list[str]:
        """The paths that join hosts a and b: their direct links, then the LAN."""
        direct = [link.name for link in self.links.values() if {link.a, link.b} == {a, b}]
        both_on_lan = LAN in self.addresses[a] and LAN in self.addresses[b]
        return direct + ([LAN] if both_on_lan else [])

    def _on_lan(self) -> list[str]:
        return [h for h in self.specs if LAN in self.addresses[h]]

    def _ends(self, path: str, host: str | None) -> list[tuple[str, str]]:
        """(namespace, interface) of both ends of a path: a link's, or host's attachment to the LAN (every host's if
        host is None)."""
        if path == LAN:
            if host is not None and LAN not in self.addresses.get(host, {}):
                raise ValueError(f"host {host!r} is not on the LAN")
            hosts = self._on_lan() if host is None else [host]
            return [end for h in hosts for end in ((self.netns[h], LAN), (str(self.lan_netns), f"h-{h}"))]
        if path not in self.links:
            raise ValueError(f"no path {path!r}: the rig's paths are {[LAN, *self.links]}")
        link = self.links[path]
        return [(self.netns[link.a], path), (self.netns[link.b], path)]

    def set_rate(self, path: str, rate: str, host: str | None = None) -> None:
        """Shape a path both ways to rate (tc's notation, "20mbit"), or unshape it ("unshaped"); for the LAN, host's
        attachment, or every host's if host is None."""
        rate_bits(rate)
        for netns, dev in self._ends(path, host):
            shape(netns, dev, rate)
        if path != LAN:
            self.rates[(path, None)] = rate
        for h in ([host] if host else self._on_lan()) if path == LAN else []:
            self.rates[(LAN, h)] = rate

    def qdiscs(self, path: str, host: str | None = None) -> list[str]:
        """Each end's root queueing discipline, as tc shows it."""
        return [qdisc(netns, dev) for netns, dev in self._ends(path, host)]

    def down(self, path: str, host: str | None = None) -> None:
        """Take a path down at both ends, a cable pulled (for the LAN: host's attachment, or every host's)."""
        for netns, dev in self._ends(path, host):
            set_up(netns, dev, False)

    def up(self, path: str, host: str | None = None) -> None:
        """Bring a path back up; its addresses and rate are as they were."""
        for netns, dev in self._ends(path, host):
            set_up(netns, dev, True)

    def reaches(self, src: str, dst: str, via: str = LAN, timeout: float = 1.0) -> bool:
        """Whether dst's address on path via answers src (a TCP connection, refused or accepted) within timeout."""
        args = (self.address(dst, via), str(CLOSED_PORT), str(timeout))
        done = self[src].run(sys.executable, "-c", ANSWERS, *args, timeout=timeout + 60, check=True)
        return done.stdout.strip() == "yes"

    def transfer_mbit(self, src: str, dst: str, via: str = LAN, seconds: float = 2.0) -> float:
        """Mbit/s one TCP connection carries from host src to host dst over path via, for about `seconds`."""
        if via not in self.paths(src, dst):
            raise ValueError(f"no path {via!r} between {src!r} and {dst!r} (theirs: {self.paths(src, dst)})")
        sender, receiver = self[src], self[dst]
        log = receiver.root / "transfer.log"
        listening = receiver.popen(sys.executable, "-c", RECEIVER, str(TRANSFER_PORT), log=log)
        try:
            args = (self.address(dst, via), str(TRANSFER_PORT), str(seconds))
            sender.run(sys.executable, "-c", SENDER, *args, timeout=seconds + 120, check=True)
            listening.wait(timeout=120)
        finally:
            if listening.poll() is None:
                listening.kill()
                listening.wait()
        got = json.loads(log.read_text().strip().splitlines()[-1])
        return got["bytes"] * 8 / max(got["seconds"], 1e-9) / 1e6

    # -- hosts -------------------------------------------------------------------------------------------------------

    def share_token(self, token: str | None = None) -> str:
        """One cluster token (mode 0600) in every host's ~/.ray/auth_token, as `raytrm cluster` expects; returns it.
        A new one, or `token`: the cluster's, for a host restarted in its place."""
        token = token or secrets.token_hex(32)
        for host in self.hosts.values():
            (host.home / ".ray").mkdir(exist_ok=True)
            (host.home / ".ray" / "auth_token").write_text(token)
            (host.home / ".ray" / "auth_token").chmod(0o600)
        return token

    def kill(self, name: str) -> None:
        """Kill every process of a host; its paths stay up (its kernel still answers, refusing connections)."""
        self[name].kill()

    def restart(self, name: str) -> Host:
        """A fresh host in place of name, killed first if alive: the same addresses, paths and quota, a new HOME and
        /tmp/ray (under root/NAME.N, the old host's files left for reading)."""
        self[name].kill()
        self._generations[name] += 1
        self.hosts[name] = self._start(name, self.root / f"{name}.{self._generations[name]}")
        return self.hosts[name]

    # -- teardown ----------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every host's processes, then delete the cgroups and namespaces (and with them veths and bridge)."""
        if os.getpid() != self.maker:  # a forked child's copy: the rig is its parent's
            return
        for host in self.hosts.values():
            try:
                host.kill()
            except (OSError, subprocess.SubprocessError) as e:
                logger.warning("rig %s: host %s: %s", self.tag, host.name, e)
        for group in [*self.spares.values(), *self.cgroups.values()]:
            try:
                group.remove()
            except OSError as e:
                logger.warning("rig %s: cgroup %s: %s", self.tag, group.path, e)
        for ns in reversed(self._made):
            leftovers.delete_netns(ns)
        self.hosts, self.cgroups, self.spares, self._made = {}, {}, {}, []
        leftovers.forget(self)

    def __enter__(self) -> Rig:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def _check(hosts: Sequence[HostSpec], links: Sequence[LinkSpec]) -> None:
    names = [h.name for h in hosts]
    for name in [*names, *(link.name for link in links)]:
        if not _NAME.fullmatch(name) or name == LAN:
            raise ValueError(f"rig name {name!r}: expected a lowercase letter then up to 7 letters or digits, not lan")
    if len(set(names)) != len(names) or len({link.name for link in links}) != len(links):
        raise ValueError(f"rig names must be unique: hosts {names}, links {[link.name for link in links]}")
    for h in hosts:
        if h.lan is not None:
            rate_bits(h.lan)
        if h.cpu is not None and h.cpu <= 0:
            raise ValueError(f"host {h.name!r}: cpu {h.cpu}: expected a positive number of cores, or None")
    for link in links:
        rate_bits(link.rate)
        if link.a == link.b or link.a not in names or link.b not in names:
            raise ValueError(f"link {link.name!r}: joins {link.a!r} and {link.b!r}; expected two of the hosts {names}")
    lonely = [h.name for h in hosts if h.lan is None and not any(h.name in (link.a, link.b) for link in links)]
    if lonely:
        raise ValueError(f"hosts {lonely} are on no path: give them a LAN rate or a link")


def _hierarchy() -> cpu_quota.Hierarchy:
    found = cpu_quota.find_hierarchy()
    if isinstance(found, str):
        raise RuntimeError(f"a CPU quota needs a cgroup hierarchy with the cpu controller: {found}")
    return found
