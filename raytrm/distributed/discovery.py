"""A head found on the local network without its address: DNS-SD over multicast DNS (service type `_raytrm._tcp`).

The head's path service (raytrm.distributed.path_service) advertises itself on this Mac's interfaces for as long
as it runs: its port, and Ray's port in the record's text. `raytrm cluster join` with no address browses for such
records for a few seconds and joins the one head it finds; the cluster's token is still required, as with an
address. Nothing here trusts the record: the path service and Ray's head both want the token.

zeroconf (python-zeroconf) speaks the protocol: a well-kept implementation that shares port 5353 with macOS's own
mDNSResponder, which hand-written sockets would have to get right on both systems.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from raytrm.distributed import paths
from raytrm.errors import UserError

logger = logging.getLogger(__name__)

SERVICE = "_raytrm._tcp.local."
#: How long `join` listens for heads' answers.
BROWSE_S = 3.0
#: How long it listens on for other heads once one answered.
OTHERS_S = 1.0
#: How long it waits for one head's record once it has seen its name.
RESOLVE_MS = 1500


@dataclass(frozen=True)
class Head:
    """One head's record: its instance name, its IPv4 addresses, Ray's port and the path service's."""

    name: str
    addresses: tuple[str, ...]
    ray_port: int
    paths_port: int

    def address_from(self, mine: Sequence[paths.Interface]) -> str:
        """HOST:PORT of its Ray, by the first of its addresses on a network of one of this Mac's interfaces (the
        path measured at `join` may then be another), else its first address."""
        for address in self.addresses:
            if any(ipaddress.IPv4Address(address) in i.network for i in mine):
                return f"{address}:{self.ray_port}"
        return f"{self.addresses[0]}:{self.ray_port}"


def _zeroconf(addresses: Sequence[str]) -> Any:
    from zeroconf import IPVersion, Zeroconf

    return Zeroconf(interfaces=list(addresses), ip_version=IPVersion.V4Only)


class Advert:
    """This head's record on every interface the path service answers on, until `close`."""

    def __init__(self, ray_port: int, paths_port: int, interfaces: Sequence[paths.Interface] | None = None) -> None:
        from zeroconf import ServiceInfo

        found = list(paths.interfaces() if interfaces is None else interfaces)
        self.zc = None
        if not found:
            logger.info("no interface but loopback: the head is not advertised by mDNS")
            return
        host = socket.gethostname().split(".")[0] or "raytrm"
        self.info = ServiceInfo(
            SERVICE,
            f"{host}.{SERVICE}",
            addresses=[socket.inet_aton(i.ip) for i in found],
            port=paths_port,
            properties={"ray_port": str(ray_port)},
            server=f"{host}-raytrm.local.",  # not the Mac's own name, whose addresses macOS answers for itself
        )
        self.zc = _zeroconf([i.ip for i in found])
        self.zc.register_service(self.info, allow_name_change=True)  # a second head of the same name: "host (2)"
        logger.info("advertised by mDNS as %s on %s", self.info.name, ", ".join(i.ip for i in found))

    def close(self) -> None:
        if self.zc is not None:
            self.zc.unregister_service(self.info)
            self.zc.close()
            self.zc = None


def browse(timeout_s: float = BROWSE_S, interfaces: Sequence[paths.Interface] | None = None) -> list[Head]:
    """The heads that answer on this Mac's networks within timeout_s (or OTHERS_S after the first), by name."""
    from zeroconf import ServiceBrowser, ServiceStateChange

    mine = list(paths.interfaces() if interfaces is None else interfaces)
    if not mine:
        return []
    names: set[str] = set()
    lock, first = threading.Lock(), threading.Event()

    def seen(zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        if state_change is ServiceStateChange.Added:
            with lock:
                names.add(name)
            first.set()

    zc = _zeroconf([i.ip for i in mine])
    try:
        browser = ServiceBrowser(zc, SERVICE, handlers=[seen])
        end = time.monotonic() + timeout_s
        if first.wait(timeout_s):  # others on the network answer about as soon: a moment more for them
            time.sleep(max(0.0, min(end - time.monotonic(), OTHERS_S)))
        browser.cancel()
        heads = []
        for name in sorted(names):
            info = zc.get_service_info(SERVICE, name, timeout=RESOLVE_MS)
            head = _head(info) if info is not None else None
            if head is not None:
                heads.append(head)
        return heads
    finally:
        zc.close()


def _head(info: Any) -> Head | None:
    """A record as a Head, or None where it lacks an address or a readable Ray port."""
    text = (info.properties or {}).get(b"ray_port") or b""
    addresses = tuple(a for a in info.parsed_addresses() if ":" not in a)
    if not text.isdigit() or not addresses or not info.port:
        return None
    return Head(info.name.removesuffix(f".{SERVICE}"), addresses, int(text), int(info.port))


STATIC_FORM = "give the head's address as `raytrm cluster head` printed it: raytrm cluster {command} HEAD[:PORT]"


def find_head(
    timeout_s: float = BROWSE_S, look: Callable[[float], list[Head]] | None = None, command: str = "join"
) -> tuple[Head, str]:
    """The one head on the local network and the HOST:PORT to join it by; else one line saying what was found and
    the static form of `raytrm cluster COMMAND`. look: the browse (a test's stand-in)."""
    static = STATIC_FORM.format(command=command)
    mine = paths.interfaces()
    try:
        heads = (look or (lambda s: browse(s, mine)))(timeout_s)
    except OSError as error:  # no socket for multicast at all (a sandbox, a firewall)
        raise UserError(f"cannot look for a head by mDNS here ({error}); {static}") from None
    if not heads:
        raise UserError(
            f"no raytrm head answered by mDNS (DNS-SD {SERVICE.removesuffix('.local.')}) within {timeout_s:g} s: "
            "none runs on this network, or multicast is blocked here (macOS blocks it in SSH sessions, and some "
            f"Wi-Fi networks do); {static}"
        )
    if len(heads) > 1:
        found = ", ".join(f"{h.name} at {h.address_from(mine)}" for h in heads)
        raise UserError(
            f"{len(heads)} raytrm heads answered by mDNS ({found}); pick one: raytrm cluster {command} HEAD[:PORT]"
        )
    return heads[0], heads[0].address_from(mine)
