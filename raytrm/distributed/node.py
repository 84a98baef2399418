"""This machine as a node of a raytrm cluster: `ray start` with its tier, its LAN address and token authentication.

`raytrm cluster head` and `raytrm cluster join` build one `ray start` command each: the node advertises one
`raytrm_machine` unit and its `raytrm_tier:<tier>` resource (what trials and training workers are placed by), and
labels with its tier, memory budget and versions (what `status` shows and `join` checks). Token authentication is
always on (raytrm.distributed.tokens): a node without the head's token is refused by Ray itself.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass

from raytrm.constants import GLOO_IFNAME_ENV, RESOURCE_MACHINE, tier_resource
from raytrm.errors import UserError

logger = logging.getLogger(__name__)

DEFAULT_PORT = 6379
DASHBOARD_PORT = 8265
#: Node label keys (Kubernetes syntax, as Ray requires): the tier, the memory budget and the versions `join` checks.
LABEL_PREFIX = "raytrm/"
VERSION_KEYS = ("python", "ray", "torch", "raytrm")
#: The label of a node that joined: its address on the path to the head that `join` measured fastest, where the
#: gradient sync goes (raytrm.distributed.gloo_path).
PATH_LABEL, PATH_HEAD_LABEL = f"{LABEL_PREFIX}path", f"{LABEL_PREFIX}path-head"  # and the head's end of that path
# Ray caps a Mac's object store at 2 GiB; raytrm moves checkpoints and results through it, never datasets, so a
# small store leaves the memory to the training budget.
OBJECT_STORE_MIN, OBJECT_STORE_MAX, OBJECT_STORE_FRACTION = 512 * 2**20, 2 * 2**30, 0.05
PORT_RANGE = (1, 65535)


def lan_address(explicit: str | None = None, toward: str | None = None) -> str:
    """The IPv4 address other Macs reach this one at: --node-ip, else the one this Mac sends from to toward (the
    head), else the interface of the default route, else the first non-loopback address that is up (a Thunderbolt
    bridge or a LAN without a router)."""
    if explicit is not None:
        if not re.fullmatch(r"[0-9]{1,3}(\.[0-9]{1,3}){3}", explicit) or not _is_ipv4(explicit):
            raise UserError(f"--node-ip {shown(explicit)}: not an IPv4 address; give this Mac's LAN address")
        if interface_of(explicit) is None:
            held = ", ".join(local_addresses()) or "none"
            raise UserError(
                f"--node-ip {explicit}: not an address of this Mac (it holds {held}); give one of them, or leave "
                "--node-ip out to use the LAN interface's"
            )
        return explicit
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((toward or "192.0.2.1", 9))  # a UDP "connect" sends nothing; it only picks the interface
        return probe.getsockname()[0]
    except OSError:
        pass
    finally:
        probe.close()
    import psutil

    up = {name for name, s in psutil.net_if_stats().items() if s.isup}
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        for addr in addrs:
            if name in up and addr.family == socket.AF_INET and not addr.address.startswith("127."):
                return addr.address
    raise UserError("no network address found on this Mac: connect it to the LAN, or pass --node-ip")


def _is_ipv4(text: str) -> bool:
    try:
        socket.inet_aton(text)
    except OSError:
        return False
    return True


def local_addresses() -> list[str]:
    """The IPv4 addresses of this machine's interfaces, loopback last."""
    import psutil

    found = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    return sorted(found, key=lambda ip: (ip.startswith("127."), ip))


def interface_of(ip: str) -> str | None:
    """The name of the network interface that holds ip (en0, bridge0, ...), or None."""
    import psutil

    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None


def collective_environment(node_ip: str) -> dict[str, str]:
    """What the node's training workers need to reach the other Macs: gloo bound to the interface of node_ip.

    Left alone, gloo advertises the address its host name resolves to, often 127.0.0.1 (or a link-local address
    on a Mac), and the other nodes' workers cannot connect ("connectFullMesh failed ... 127.0.0.1"). Workers
    inherit the environment of `ray start`, so the node sets it once for all of them.
    """
    name = interface_of(node_ip)
    return {GLOO_IFNAME_ENV: name} if name else {}


def object_store_bytes(memory_bytes: int, explicit_mb: int | None = None) -> int:
    """The object store: --object-store-mb, else 5% of memory within [512 MiB, 2 GiB]."""
    if explicit_mb is not None:
        if explicit_mb < 100:
            raise UserError(f"--object-store-mb {explicit_mb}: Ray needs at least 100 MiB; give 100 or more")
        return explicit_mb * 2**20
    return int(min(OBJECT_STORE_MAX, max(OBJECT_STORE_MIN, OBJECT_STORE_FRACTION * memory_bytes)))


def _label_value(value: str) -> str:
    """A version as a label value: Ray labels allow [A-Za-z0-9_.-] only ("2.13.0+cpu" becomes "2.13.0_cpu")."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", value)[:63].strip("_.-") or "unknown"


@dataclass
class NodeSpec:
    """What one node advertises: its tier, budget, address and the versions it runs."""

    tier: str
    memory_budget_mb: int
    node_ip: str
    versions: dict[str, str]
    memory_bytes: int
    path: str | None = None  # where it joined: its address on the path measured fastest to the head
    path_head: str | None = None  # the head's address on that path

    def labels(self) -> dict[str, str]:
        out = {f"{LABEL_PREFIX}tier": self.tier, f"{LABEL_PREFIX}budget-mb": str(self.memory_budget_mb)}
        out.update({f"{LABEL_PREFIX}{k}": _label_value(self.versions.get(k, "unknown")) for k in VERSION_KEYS})
        if self.path:
            out[PATH_LABEL] = self.path
        if self.path_head:
            out[PATH_HEAD_LABEL] = self.path_head
        return out

    def resources(self) -> dict[str, int]:
        return {RESOURCE_MACHINE: 1, tier_resource(self.tier): 1}


def this_node(node_ip: str | None, tier_name: str | None = None, toward: str | None = None) -> NodeSpec:
    """This machine from `raytrm probe`: its tier (or the named one, for a Mac the tier table guesses wrong), at the
    address it reaches toward (the head) by, unless node_ip names one."""
    from raytrm.hardware.probe import detect
    from raytrm.hardware.tiers import load_tiers, match_tier

    hw = detect()
    tiers = load_tiers()
    if tier_name is None:
        tier = match_tier(hw, tiers)
        name, budget = tier.name, tier.memory_budget_mb
    else:
        rows = {row.name: row for row in tiers}
        if tier_name not in rows:
            raise UserError(f"--tier {tier_name}: not in the tier table; use one of {', '.join(sorted(rows))}")
        name, budget = tier_name, rows[tier_name].memory_budget_mb
    return NodeSpec(name, budget, lan_address(node_ip, toward), hw.versions, hw.memory_bytes)


def start_command(
    spec: NodeSpec,
    head: str | None = None,
    port: int = DEFAULT_PORT,
    dashboard_host: str = "127.0.0.1",
    object_store_mb: int | None = None,
) -> list[str]:
    """The `ray start` command line of a head (head=None) or of a node joining head (HOST:PORT)."""
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", f"--node-ip-address={spec.node_ip}"]
    if head is None:
        argv += ["--head", f"--port={port}", f"--dashboard-host={dashboard_host}", f"--dashboard-port={DASHBOARD_PORT}"]
    else:
        argv += [f"--address={head}"]
    argv += [
        f"--resources={json.dumps(spec.resources())}",
        "--labels=" + ",".join(f"{k}={v}" for k, v in spec.labels().items()),
        f"--object-store-memory={object_store_bytes(spec.memory_bytes, object_store_mb)}",
        "--disable-usage-stats",
    ]
    return argv


def _ray_error(output: str) -> str:
    """The line of `ray start`'s output that says what went wrong (its last error or exception line)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"(Error|Exception|error|refused|mismatch|failed)", line):
            return re.sub(r"^\S*(Error|Exception):\s*", "", line)[:400]
    return lines[-1][:400] if lines else "no output"


def run_ray(argv: list[str], env: dict[str, str], what: str, timeout_s: float = 120) -> str:
    """Run a `ray` command with env added; its failure is one line naming what failed and Ray's reason."""
    logger.debug("running %s", " ".join(argv))
    try:
        done = subprocess.run(
            argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise UserError(
            f"{what}: `ray` did not finish in {timeout_s:.0f} s; check the address and the firewall"
        ) from None
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise UserError(f"{what} failed: {_ray_error(output)}")
    return output


def port_number(text: str) -> int | None:
    """text as a TCP port (1-65535), or None: a port out of range is refused, never wrapped or left to Ray."""
    if not re.fullmatch(r"[0-9]{1,5}", text):
        return None
    port = int(text)
    return port if PORT_RANGE[0] <= port <= PORT_RANGE[1] else None


def split_address(
    address: str, what: str = "the head's address", default_port: int | None = DEFAULT_PORT
) -> tuple[str, int]:
    """HOST[:PORT] as (host, port); without a port, default_port (an error where it is None).

    The host is an IPv4 address or a host name; the port one of 1-65535. what names the argument in the error.
    """
    host, sep, port = address.rpartition(":")
    if not sep:
        host, port = address, ""
    example = "e.g. 192.168.1.10:6379"
    if not host or len(host) > 253 or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", host):
        found = "an empty host" if not host else f"host {shown(host)}"
        raise UserError(f"{what} {shown(address)}: got {found}, expected an IPv4 address or a host name ({example})")
    if not sep and default_port is None:
        raise UserError(f"{what} {shown(address)}: got no port, expected HOST:PORT ({example})")
    number = port_number(port) if sep else default_port
    if number is None:
        raise UserError(
            f"{what} {shown(address)}: got port {shown(port)}, expected a port from {PORT_RANGE[0]} to "
            f"{PORT_RANGE[1]} ({example})"
        )
    return host, number


def shown(text: str, limit: int = 60) -> str:
    """text quoted for an error line: escapes visible, cut to limit characters."""
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def version_mismatch(mine: dict[str, str], head: dict[str, str]) -> str | None:
    """One line naming every version this node and the head disagree on, or None."""
    keys = [f"{LABEL_PREFIX}{k}" for k in VERSION_KEYS]
    differ = [(k[len(LABEL_PREFIX) :], mine.get(k), head.get(k)) for k in keys if mine.get(k) != head.get(k)]
    if not differ:
        return None
    named = "; ".join(f"{name} {own} here, {theirs} on the head" for name, own, theirs in differ)
    return f"versions differ from the head's: {named}; install the head's versions on this Mac and join again"
