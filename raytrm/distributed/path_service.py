"""The head's path service: on every interface, at Ray's port + 1, it answers joining Macs that hold the cluster's
token with the head's addresses, echoes for latency and a sink for rate (the protocol: raytrm.distributed.paths).

It also advertises the head by mDNS (DNS-SD `_raytrm._tcp`) on the addresses the Mac has at each moment, so that
`raytrm cluster join` with no address finds it (raytrm.distributed.discovery). `raytrm cluster head` starts it as a
small process of its own beside Ray's head (`python -m raytrm.distributed.path_service`), which stops when `raytrm
cluster stop` stops it or, whatever stopped Ray (`ray stop`, a crash), within seconds of Ray's head no longer
answering: nothing is left behind. Its pid file and log live in Ray's /tmp/ray.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import secrets
import signal
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from raytrm.distributed import discovery, paths
from raytrm.distributed.path_client import open_service
from raytrm.errors import UserError

logger = logging.getLogger(__name__)

RUN_DIR = Path("/tmp/ray")  # Ray's own directory for a node's files, one per machine
PID_FILE, LOG_FILE = RUN_DIR / "raytrm_paths.pid", RUN_DIR / "raytrm_paths.log"
MODULE = "raytrm.distributed.path_service"
#: How often it asks whether Ray's head still answers, and after how many misses in a row it stops.
WATCH_S, WATCH_MISSES = 2.0, 3
#: How often the head's mDNS record is checked against this Mac's addresses.
READVERTISE_S = 10.0
#: A sink counts at most this much: a client cannot keep it busy for long.
SINK_LIMIT = 2**31
START_S, STOP_S = 20.0, 5.0


class Service(socketserver.ThreadingTCPServer):
    """The listener: one thread per connection, each with its deadlines (paths.REPLY_S per read)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, token: str, addresses: Callable[[], list[paths.Interface]], host: str = "0.0.0.0"):
        self.token, self.addresses = token, addresses
        super().__init__((host, port), Handler)


class Handler(socketserver.BaseRequestHandler):
    server: Service

    def handle(self) -> None:
        conn = paths.Conn(self.request)
        nonce = secrets.token_hex(16)
        try:
            conn.send(f"{paths.GREETING} {nonce}")
            if not _same(conn.line(), paths.proof(self.server.token, nonce)):
                conn.send("refused")
                return
            conn.send("ok")
            while True:
                command, _, arg = conn.line().partition(" ")
                if command == "addresses":
                    conn.send(json.dumps({"addresses": [vars(a) for a in self.server.addresses()]}))
                elif command == "echo" and arg.isdigit() and int(arg) <= 100:
                    for _ in range(int(arg)):
                        conn.sock.sendall(conn.exactly(paths.ECHO_BYTES))
                elif command == "sink":
                    conn.send(json.dumps(_sink(conn)))
                    return
                else:
                    conn.send("unknown")
                    return
        except (paths.PathProblem, OSError) as e:  # a client that left or stalled: its connection alone ends
            logger.debug("path service: %s: %s", self.client_address, e)


def _same(got: str, expected: str) -> bool:
    import hmac

    return hmac.compare_digest(got.encode(), expected.encode())


def _sink(conn: paths.Conn) -> dict[str, float]:
    """Count what arrives until the client closes its side: bytes, and seconds from the first to the close."""
    total, first = len(conn.buffer), time.perf_counter() if conn.buffer else None
    conn.buffer = b""
    while total < SINK_LIMIT:
        data = conn.sock.recv(1 << 20)
        if not data:
            break
        first = time.perf_counter() if first is None else first
        total += len(data)
    return {"bytes": total, "seconds": time.perf_counter() - (first or time.perf_counter())}


def _watch(service: Service, ray_address: str) -> None:
    """Stop the service once Ray's head at ray_address has not answered WATCH_MISSES times in a row."""
    from raytrm.distributed.reach import unreachable

    host, _, port = ray_address.rpartition(":")
    misses = 0
    while misses < WATCH_MISSES:
        time.sleep(WATCH_S)
        misses = misses + 1 if unreachable(host, int(port), timeout_s=1.0) else 0
    logger.info("Ray's head at %s stopped answering: the path service stops", ray_address)
    service.shutdown()


class Advertising:
    """The head's mDNS record on this Mac's interfaces, made again whenever their addresses change (a Wi-Fi network
    rejoined, a Thunderbolt bridge plugged in), checked every `every` seconds until `stop`. `make` makes a record
    (discovery.Advert; a test's stand-in)."""

    def __init__(
        self,
        ray_port: int,
        port: int,
        every: float = READVERTISE_S,
        make: Callable[..., discovery.Advert] | None = None,
    ) -> None:
        self.ray_port, self.port, self.every = ray_port, port, every
        self.make = make or discovery.Advert
        self.advert: discovery.Advert | None = None
        self.shown: list[str] | None = None  # the addresses of the record now out
        self._stop, self._lock = threading.Event(), threading.Lock()

    def run(self) -> None:
        while True:
            found = paths.interfaces()
            addresses = [i.ip for i in found]
            with self._lock:
                if self._stop.is_set():
                    return
                if addresses != self.shown:
                    self._close()
                    if self.shown is not None:
                        logger.info("this Mac's addresses changed to %s: advertised again", ", ".join(addresses))
                    self.shown = addresses
                    try:
                        self.advert = self.make(self.ray_port, self.port, found)
                    except Exception as error:  # no multicast here: joining by address still works
                        logger.warning("the head is not advertised by mDNS (%s): join it by its address", error)
            if self._stop.wait(self.every):
                return

    def _close(self) -> None:
        if self.advert is not None:
            self.advert.close()
            self.advert = None

    def stop(self) -> None:
        """Take the record down (a goodbye on the network); the thread ends at its next look."""
        with self._lock:
            self._stop.set()
            self._close()


def serve(
    port: int, token_file: Path, ray_address: str | None, pid_file: Path | None = None, advertise: int | None = None
) -> None:
    """Run the service until SIGTERM, or until Ray's head at ray_address stops answering (if given); with
    `advertise` (Ray's port), the head is found by mDNS meanwhile (raytrm.distributed.discovery)."""
    from raytrm.distributed.tokens import read_token

    service = Service(port, read_token(token_file), paths.interfaces)
    advertising = Advertising(advertise, port) if advertise is not None else None
    if advertising is not None:  # beside the service: mDNS's probing for the name takes a second or two
        threading.Thread(target=advertising.run, name="raytrm-mdns", daemon=True).start()

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    if pid_file is not None:
        pid_file.write_text(f"{os.getpid()} {port}\n")
    try:
        if ray_address:
            threading.Thread(target=_watch, args=(service, ray_address), name="raytrm-watch", daemon=True).start()
        service.serve_forever(poll_interval=0.5)
    finally:
        if advertising is not None:
            advertising.stop()
        service.server_close()
        if pid_file is not None:
            with contextlib.suppress(OSError):
                if pid_file.read_text().split()[0] == str(os.getpid()):
                    pid_file.unlink()


# -- started and stopped by `raytrm cluster head | stop` ------------------------------------------------------------


def start(port: int, token_file: Path, ray_address: str, ready_at: str = "127.0.0.1") -> int:
    """Start the service as a process of its own (it outlives this command, as Ray's head does); returns its pid
    once it answers at ready_at:port. Its failure to start is one line. While it runs, the head is found by mDNS
    where `advertised`."""
    PID_FILE.parent.mkdir(parents=True, exist_ok=True)
    LOG_FILE.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", MODULE, "--port", str(port), "--token-file", str(token_file)]
    argv += ["--watch", ray_address, "--pid-file", str(PID_FILE)]
    host, _, ray_port = ray_address.rpartition(":")
    if advertised(host):
        argv += ["--advertise", ray_port]
    with LOG_FILE.open("w") as log:
        child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if child.poll() is not None:
            said = [line for line in LOG_FILE.read_text().splitlines() if line.strip()]
            raise UserError(
                f"the path service did not start on port {port} ({said[-1] if said else f'exit {child.returncode}'}); "
                "free the port or give another --paths-port"
            )
        try:
            open_service(ready_at, port, "", timeout_s=1.0).close()
        except paths.PathProblem as e:
            if e.kind == "refused":  # it answers: the empty token is refused, as it should be
                return child.pid
        time.sleep(0.1)
    child.kill()
    raise UserError(f"the path service gave no answer on port {port} within {START_S:g} s; see {LOG_FILE}")


def advertised(node_ip: str) -> bool:
    """Whether the service of a head at node_ip advertises it by mDNS: not on a loopback address, which no other Mac
    can reach."""
    return not ipaddress.IPv4Address(node_ip).is_loopback


def running(port: int | None = None) -> int | None:
    """The pid of this machine's path service (on port, where given), from its pid file, if that process is one."""
    import psutil

    try:
        pid_text, port_text = PID_FILE.read_text().split()[:2]
        pid = int(pid_text)
        alive = MODULE in " ".join(psutil.Process(pid).cmdline())
    except (OSError, ValueError, psutil.Error):
        return None
    return pid if alive and port in (None, int(port_text)) else None


def stop(port: int | None = None) -> bool:
    """Stop this machine's path service (the one on port, where given); True if one was running."""
    import psutil

    pid = running(port)
    if pid is None:
        return False
    proc = psutil.Process(pid)
    with contextlib.suppress(psutil.Error):
        proc.terminate()
        try:
            proc.wait(STOP_S)
        except psutil.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_S)
    with contextlib.suppress(OSError):
        PID_FILE.unlink()
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-file", type=Path, required=True)
    parser.add_argument("--watch", metavar="HOST:PORT", help="stop once Ray's head there stops answering")
    parser.add_argument("--pid-file", type=Path, help="where to write its pid (removed at its end)")
    parser.add_argument("--advertise", type=int, metavar="RAY_PORT", help="be found by mDNS, with Ray's port")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        serve(args.port, args.token_file, args.watch, args.pid_file, args.advertise)
    except (UserError, OSError) as e:
        print(f"raytrm path service: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
