"""Asking the head's path service (raytrm.distributed.path_service): the head's addresses, then every path to them
measured, one connection each, every wait with a deadline; `find_paths` says in one line why it could not.

Ray-free.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from raytrm.distributed import paths
from raytrm.distributed.node import DASHBOARD_PORT, port_number
from raytrm.distributed.paths import (
    CHUNK,
    ECHO_BYTES,
    ECHO_ROUNDS,
    GREETING,
    PORT_OFFSET,
    REPLY_S,
    SINK_MAX_BYTES,
    SINK_S,
    Conn,
    Interface,
    Measured,
    PathProblem,
    interfaces,
    proof,
)
from raytrm.errors import UserError


def open_service(host: str, port: int, token: str, timeout_s: float | None = None) -> Conn:
    """An authenticated connection to the path service at host:port, connected and greeted within timeout_s
    (paths.CONNECT_S); raises PathProblem."""
    timeout_s = timeout_s or paths.CONNECT_S
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError:
        raise PathProblem("unreachable", f"no answer within {timeout_s:g} s") from None
    except ConnectionRefusedError as e:  # the machine answered: nothing listens on the port
        raise PathProblem("no_service", str(e.strerror or e)) from None
    except OSError as e:
        raise PathProblem("unreachable", str(e.strerror or e)) from None
    conn = Conn(sock, timeout_s)
    try:
        try:
            greeting = conn.line()
        except TimeoutError:
            raise PathProblem("not_service", f"no greeting within {timeout_s:g} s") from None
        except (PathProblem, OSError) as e:
            raise PathProblem("not_service", f"{getattr(e, 'strerror', None) or e} before a greeting") from None
        if not greeting.startswith(GREETING + " "):
            raise PathProblem("not_service", "its greeting is not raytrm's path service's")
        conn.sock.settimeout(REPLY_S)
        conn.send(proof(token, greeting[len(GREETING) + 1 :]))
        if conn.line() != "ok":
            raise PathProblem("refused", "it refused the cluster token")
    except TimeoutError:
        conn.close()
        raise PathProblem("lost", f"no reply within {REPLY_S:g} s") from None
    except OSError as e:
        conn.close()
        raise PathProblem("lost", str(e.strerror or e)) from None
    except PathProblem:
        conn.close()
        raise
    return conn


def ask_addresses(conn: Conn) -> list[Interface]:
    """The head's addresses, as its service lists them."""
    conn.send("addresses")
    try:
        return [Interface.from_dict(d) for d in json.loads(conn.line())["addresses"]]
    except (ValueError, KeyError, TypeError) as e:
        raise PathProblem("not_service", f"its address list is not readable ({e})") from None


def measure(conn: Conn, sink_s: float = SINK_S, max_bytes: int = SINK_MAX_BYTES) -> tuple[float, float]:
    """(Mbit/s, latency in ms) over one connection: ECHO_ROUNDS round trips, then a sink that closes it."""
    rounds, payload = [], bytes(ECHO_BYTES)
    conn.send(f"echo {ECHO_ROUNDS}")
    for _ in range(ECHO_ROUNDS):
        start = time.perf_counter()
        conn.sock.sendall(payload)
        conn.exactly(ECHO_BYTES)
        rounds.append(time.perf_counter() - start)
    conn.send("sink")
    chunk, sent, stop = bytes(CHUNK), 0, time.monotonic() + sink_s
    while time.monotonic() < stop and sent < max_bytes:
        conn.sock.sendall(chunk)
        sent += len(chunk)
    conn.sock.shutdown(socket.SHUT_WR)
    try:
        got = json.loads(conn.line())
        mbit_s = got["bytes"] * 8 / max(float(got["seconds"]), 1e-6) / 1e6
    except (ValueError, KeyError, TypeError) as e:
        raise PathProblem("not_service", f"its sink's answer is not readable ({e})") from None
    finally:
        conn.close()
    return mbit_s, statistics.median(rounds) * 1e3


def local_end(remote: str) -> str | None:
    """The address this machine sends from to reach remote (a UDP connect sends nothing), or None: no route."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((remote, 9))
        return probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()


def measure_paths(
    remotes: Sequence[Interface],
    port: int,
    token: str,
    connect_s: float | None = None,
    sink_s: float = SINK_S,
    local_interface: dict[str, str] | None = None,
) -> list[Measured]:
    """Each of the head's addresses: connected to all at once (one deadline for all), then measured one at a time,
    so that no two measurements share the machine. local_interface maps this machine's addresses to interfaces."""
    connect_s = connect_s or paths.CONNECT_S
    if local_interface is None:
        local_interface = {i.ip: i.name for i in interfaces()}
    conns: dict[int, Conn | PathProblem] = {}

    def connect(k: int, remote: Interface) -> None:
        try:
            conns[k] = open_service(remote.ip, port, token, connect_s)
        except PathProblem as e:
            conns[k] = e

    threads = [threading.Thread(target=connect, args=(k, r), daemon=True) for k, r in enumerate(remotes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(connect_s + REPLY_S)
    found = []
    for k, remote in enumerate(remotes):
        local = local_end(remote.ip)
        row = {"remote": remote.ip, "remote_interface": remote.name, "local": local}
        row["interface"] = local_interface.get(local) if local else None
        conn = conns.get(k, PathProblem("unreachable", f"no answer within {connect_s:g} s"))
        if isinstance(conn, PathProblem):
            found.append(Measured(**row, problem=str(conn)))
            continue
        try:
            mbit_s, latency_ms = measure(conn, sink_s)
        except TimeoutError:
            found.append(Measured(**row, problem=f"lost: no reply within {REPLY_S:g} s"))
        except (PathProblem, OSError) as e:
            found.append(Measured(**row, problem=f"lost: {getattr(e, 'strerror', None) or e}"))
        else:
            found.append(Measured(**row, mbit_s=mbit_s, latency_ms=latency_ms))
    return found


def service_port(port: int, explicit: int | None) -> int:
    """The path service's port: explicit (--paths-port), else Ray's port + PORT_OFFSET; never one of Ray's own."""
    found = port + PORT_OFFSET if explicit is None else explicit
    if found in (port, DASHBOARD_PORT):
        raise UserError(f"--paths-port {found}: Ray's own port; give another (default: Ray's port + {PORT_OFFSET})")
    if port_number(str(found)) is None:
        raise UserError(
            f"--paths-port {found}: expected a port from 1 to 65535 (the path service's, Ray's port + "
            f"{PORT_OFFSET} unless given)"
        )
    return found


def find_paths(head_ip: str, port: int, secret: str, token: Path) -> list[Measured]:
    """Every path to the head, measured through its path service at head_ip:port: one line where the service does
    not answer there, or no path could be measured."""
    where = f"{head_ip}:{port}"
    try:
        conn = open_service(head_ip, port, secret)
        try:
            listed = ask_addresses(conn)
        finally:
            conn.close()
    except PathProblem as e:
        raise UserError(_service_problem(where, e, token)) from None
    if head_ip not in {i.ip for i in listed}:
        listed.append(Interface("", head_ip, 32))  # the address given reached it: a path too
    measured = measure_paths(listed, port, secret)
    if paths.choose(measured) is None:
        named = "; ".join(f"{m.remote}: {m.problem}" for m in measured)
        raise UserError(f"{where}: no path to the head could be measured ({named}); check the links and join again")
    return measured


def _service_problem(where: str, problem: PathProblem, token: Path) -> str:
    if problem.kind == "unreachable":
        return f"{where}: cannot reach the head there ({problem}); check the address, the links and the head's firewall"
    if problem.kind == "no_service":
        return (
            f"{where}: no path service listens there ({problem}): the head runs an older raytrm, or its path service "
            "listens on another port; restart the head with this raytrm (`raytrm cluster stop && raytrm cluster "
            "head`), or give its --paths-port"
        )
    if problem.kind == "refused":
        return (
            f"the path service at {where} refused the cluster token at {token}: it is not the head's; copy the head's"
        )
    if problem.kind == "not_service":
        return (
            f"{where}: something answers there, but not as raytrm's path service ({problem}); give the port "
            f"`raytrm cluster head` printed for it with --paths-port (Ray's port + {PORT_OFFSET} unless given)"
        )
    return f"{where}: the head's path service broke off ({problem}); join again"
