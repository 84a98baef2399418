"""The paths between this Mac and the head: what a path is (the head's address, the local end, its rate and latency),
the fastest chosen, the table `raytrm cluster join` and `raytrm cluster paths` print, and the protocol the head's path
service (raytrm.distributed.path_service) and its client (raytrm.distributed.path_client) speak.

Ray-free. The protocol, one TCP connection per path: the service greets with GREETING and a fresh nonce; the client
answers with proof(token, nonce) (the token itself never travels), then asks, one line each: `addresses` (a JSON
line), `echo N` (N round trips of ECHO_BYTES) and `sink` (it counts what arrives until the client closes its side,
and answers with a JSON line of bytes and seconds).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass

GREETING = "raytrm-paths 1"
#: The service listens on Ray's port + PORT_OFFSET unless given another (--paths-port).
PORT_OFFSET = 1
#: An address that does not answer within CONNECT_S is skipped; every later reply has REPLY_S.
CONNECT_S, REPLY_S = 1.5, 10.0
#: The rate: zeros sent for SINK_S or SINK_MAX_BYTES, whichever ends first; the latency: the median of ECHO_ROUNDS.
SINK_S, SINK_MAX_BYTES = 0.4, 64 * 2**20
ECHO_ROUNDS, ECHO_BYTES = 5, 64
#: Paths within this share of the best rate are a tie, which the lower latency breaks: a short transfer's rate is
#: noisy, while a Wi-Fi path's latency stands apart from a wired one's.
NEAR_TIE = 0.8
LINE_MAX = 1 << 16
CHUNK = 1 << 16


@dataclass(frozen=True)
class Interface:
    """One IPv4 address of a machine: its interface's name, the address and its prefix length."""

    name: str
    ip: str
    prefix: int

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{self.ip}/{self.prefix}", strict=False)

    @classmethod
    def from_dict(cls, d: dict) -> Interface:
        return cls(str(d["name"]), str(d["ip"]), int(d["prefix"]))


def interfaces() -> list[Interface]:
    """This machine's IPv4 addresses on interfaces that are up, loopback left out."""
    import psutil

    up = {name for name, s in psutil.net_if_stats().items() if s.isup}
    found = []
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        for a in addrs:
            if name in up and a.family == socket.AF_INET and not ipaddress.IPv4Address(a.address).is_loopback:
                prefix = ipaddress.IPv4Network(f"0.0.0.0/{a.netmask}").prefixlen if a.netmask else 32
                found.append(Interface(name, a.address, prefix))
    return found


def proof(token: str, nonce: str) -> str:
    """What shows that a client holds the cluster's token, for one nonce, without sending it."""
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


class PathProblem(Exception):
    """Why a path gave no measurement, as a few words for the table; its kind says which: unreachable (no answer),
    no_service (nothing listens), not_service (something else listens), refused (the token), lost (broke off)."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


class Conn:
    """A socket read by lines and by exact sizes, each read with a deadline."""

    def __init__(self, sock: socket.socket, timeout_s: float = REPLY_S) -> None:
        self.sock, self.buffer = sock, b""
        sock.settimeout(timeout_s)

    def line(self) -> str:
        while b"\n" not in self.buffer:
            if len(self.buffer) > LINE_MAX:
                raise PathProblem("not_service", "a line longer than the protocol's")
            data = self.sock.recv(CHUNK)
            if not data:
                raise PathProblem("lost", "it closed the connection")
            self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode("utf-8", "replace")

    def exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            data = self.sock.recv(CHUNK)
            if not data:
                raise PathProblem("lost", "it closed the connection")
            self.buffer += data
        out, self.buffer = self.buffer[:size], self.buffer[size:]
        return out

    def send(self, text: str) -> None:
        self.sock.sendall(text.encode() + b"\n")

    def close(self) -> None:
        self.sock.close()


@dataclass(frozen=True)
class Measured:
    """One path to the head: its address there, the local end the kernel sends from, and the rate and latency
    measured, or the problem that left it unmeasured."""

    remote: str
    remote_interface: str = ""
    local: str | None = None
    interface: str | None = None
    mbit_s: float | None = None
    latency_ms: float | None = None
    problem: str | None = None

    @property
    def usable(self) -> bool:
        return self.problem is None and self.mbit_s is not None and self.latency_ms is not None

    def to_dict(self) -> dict:
        return asdict(self)


def choose(paths: Sequence[Measured]) -> Measured | None:
    """The fastest path: the highest rate, the lower latency among rates within NEAR_TIE of it; None if no path was
    measured."""
    usable = [p for p in paths if p.usable]
    if not usable:
        return None
    best = max(p.mbit_s for p in usable)  # type: ignore[type-var]
    near = [p for p in usable if p.mbit_s >= NEAR_TIE * best]  # type: ignore[operator]
    return min(near, key=lambda p: (p.latency_ms, -p.mbit_s))  # type: ignore[operator]


def _rate(mbit_s: float) -> str:
    return f"{mbit_s / 1e3:.2f} Gbit/s" if mbit_s >= 1e3 else f"{mbit_s:.1f} Mbit/s"


def table(paths: Sequence[Measured], chosen: Measured | None, note: str = "chosen") -> str:
    """The paths as lines a person reads: this Mac's interface and address -> the head's, rate, latency, and which
    one was chosen (note says why)."""
    rows = []
    for p in paths:
        here = f"{p.interface or '?'} {p.local or '(no route)'}"
        there = f"{p.remote} ({p.remote_interface})" if p.remote_interface else p.remote
        rows.append((f"{here} -> {there}", p))
    width = max([len(r[0]) for r in rows] + [len("path")])
    lines = [f"  {'path':<{width}}  {'rate':>13}  {'latency':>10}"]
    for text, p in rows:
        if p.usable:
            mark = f"  {note}" if p == chosen else ""
            lines.append(f"  {text:<{width}}  {_rate(p.mbit_s):>13}  {p.latency_ms:>7.2f} ms{mark}")  # type: ignore[arg-type]
        else:
            lines.append(f"  {text:<{width}}  {p.problem}")
    return "\n".join(lines)
