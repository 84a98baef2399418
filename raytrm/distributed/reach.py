"""Whether a Ray head answers at HOST:PORT, within seconds: every network wait here has a deadline.

`raytrm cluster join`, `status` and the drivers of `train` and `tune` ask before Ray does, because Ray's client
retries an address that does not answer for minutes, printing C++ retry lines all the while.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from raytrm.distributed.node import DEFAULT_PORT
from raytrm.distributed.tokens import RAY_AUTH_MODE_ENV, RAY_TOKEN_PATH_ENV
from raytrm.errors import UserError

#: Every network wait of a check has a deadline: a name lookup, a TCP connection and an HTTP/2 answer each get
#: CHECK_TIMEOUT_S; Ray's own authenticated call, in a child process (its import included), RAY_CALL_TIMEOUT_S.
CHECK_TIMEOUT_S, RAY_CALL_TIMEOUT_S = 3.0, 10.0
# Ray's gRPC knobs for that child only, so that it gives up (in about 5 s) before it is killed at the deadline; a head
# on the LAN answers in milliseconds.
_RAY_CALL_ENV = {"RAY_gcs_rpc_server_connect_timeout_s": "1", "RAY_py_gcs_connect_timeout_s": "2"}
# An HTTP/2 client's preface and an empty SETTINGS frame: a gRPC server (Ray's head is one) answers with its SETTINGS.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS_FRAME = 4
# The head's GCS, asked once with this process's token: what it says, as one JSON line.
_RAY_CALL = """
import json, sys
try:
    from ray.exceptions import AuthenticationError, RpcError
    from raytrm.distributed.ray_internals import gcs_client
    try:
        gcs_client(sys.argv[1])
        said = {}
    except AuthenticationError as e:
        said = {"refused": str(e)}
    except RpcError as e:
        said = {"rpc": str(e)}
except Exception as e:
    said = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(said))
"""


def _resolve(host: str, port: int, timeout_s: float) -> tuple:
    """host:port as an IPv4 socket address, the name lookup bounded by timeout_s (the resolver's own can be 30 s)."""
    found: dict[str, object] = {}

    def lookup() -> None:
        try:
            found["info"] = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:  # UnicodeError: a name the IDNA codec refuses (a label over 63)
            found["error"] = e

    worker = threading.Thread(target=lookup, name="raytrm-resolve", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if "info" in found:
        return found["info"][0][4]  # type: ignore[index]
    error = found.get("error")
    if error is None:
        raise OSError(f"no answer for the name {host} within {timeout_s:g} s")
    raise OSError(getattr(error, "strerror", None) or str(error))


def ipv4_of(host: str, timeout_s: float | None = None) -> str:
    """host's IPv4 address (host itself if it is one), the name lookup bounded by timeout_s (CHECK_TIMEOUT_S); one
    line where the name has none."""
    try:
        return str(_resolve(host, 0, timeout_s or CHECK_TIMEOUT_S)[0])
    except OSError as e:
        raise UserError(f"{host}: no IPv4 address for this name ({e}); give the head's IP address") from None


def unreachable(host: str, port: int, timeout_s: float | None = None) -> str | None:
    """Why nothing answers a TCP connection at host:port within timeout_s (CHECK_TIMEOUT_S), or None if something
    does."""
    timeout_s = timeout_s or CHECK_TIMEOUT_S
    try:
        socket.create_connection(_resolve(host, port, timeout_s), timeout=timeout_s).close()
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as e:
        return str(e.strerror or e)
    return None


def not_grpc(host: str, port: int, timeout_s: float | None = None) -> str | None:
    """Why what answers at host:port is no gRPC server (as Ray's head is) within timeout_s (CHECK_TIMEOUT_S), or
    None if it is one."""
    timeout_s = timeout_s or CHECK_TIMEOUT_S
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection(_resolve(host, port, timeout_s), timeout=timeout_s) as conn:
            conn.sendall(_HTTP2_HELLO)
            head = b""
            while len(head) < 9:
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = conn.recv(9 - len(head))
                if not chunk:
                    return "it closed the connection"
                head += chunk
    except TimeoutError:
        return f"no HTTP/2 answer within {timeout_s:g} s"
    except OSError as e:
        return str(e.strerror or e)
    return None if head[3] == _SETTINGS_FRAME else "its answer is not gRPC's HTTP/2"


def ray_call(host: str, port: int, env: dict[str, str] | None = None, timeout_s: float | None = None) -> dict:
    """What the Ray head at host:port says to one call with this process's token (plus env), asked in a child
    process killed at timeout_s (RAY_CALL_TIMEOUT_S): {} (it answered), {"refused": ...}, {"rpc": ...},
    {"error": ...} or {"timeout": seconds}.

    A child, so that the deadline holds whatever Ray's client does (it retries for 40 s or more) and Ray's C++
    retry lines stay off this terminal.
    """
    timeout_s = timeout_s or RAY_CALL_TIMEOUT_S
    argv = [sys.executable, "-c", _RAY_CALL, f"{host}:{port}"]
    child_env = {**os.environ, **(env or {}), **_RAY_CALL_ENV}
    try:
        done = subprocess.run(argv, env=child_env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"timeout": timeout_s}
    lines = done.stdout.strip().splitlines()
    try:
        return dict(json.loads(lines[-1]))
    except (IndexError, ValueError, TypeError):
        said = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return {"error": said[:300]}


def check_head(host: str, port: int, label: str, env: dict[str, str] | None = None) -> None:
    """One line within seconds unless a Ray head answers at host:port and takes this process's token (plus env).

    label names the input in the line ("--address 10.0.0.1:6379"). Checked in rising cost: a TCP connection, an
    HTTP/2 answer (a port that answers but is no Ray head ends here), then Ray's own call, bounded by a deadline.
    """
    not_a_head = f"give the address `raytrm cluster head` printed (port {DEFAULT_PORT} unless given --port)"
    why = unreachable(host, port)
    if why:
        raise UserError(
            f"{label}: cannot reach a Ray head there ({why}); start it with `raytrm cluster head`, or check the "
            "address and the head's firewall"
        )
    why = not_grpc(host, port)
    if why:
        raise UserError(f"{label}: something answers there, but not as a Ray head ({why}); {not_a_head}")
    said = ray_call(host, port, env)
    if "refused" in said:
        settings = {**os.environ, **(env or {})}
        token = settings.get(RAY_TOKEN_PATH_ENV) if settings.get(RAY_AUTH_MODE_ENV, "").lower() == "token" else None
        if token:
            raise UserError(
                f"the head at {host}:{port} refused the cluster token at {token}: it is not the head's; copy the "
                f"head's (`scp {host}:.ray/auth_token {token} && chmod 600 {token}`)"
            )
        raise UserError(
            f"the head at {host}:{port} wants its cluster token and this Mac has none: copy it "
            f"(`scp {host}:.ray/auth_token ~/.ray/auth_token && chmod 600 ~/.ray/auth_token`), or pass --token-file"
        )
    if "timeout" in said:
        raise UserError(
            f"{label}: something answers there, but no Ray head replied within {said['timeout']:g} s; {not_a_head}"
        )
    if "rpc" in said:
        first = str(said["rpc"]).splitlines()[0] if str(said["rpc"]).strip() else "no reason given"
        raise UserError(f"{label}: something answers there, but not as a Ray head ({first}); {not_a_head}")
    if "error" in said:
        raise UserError(f"{label}: could not ask the Ray head there ({said['error']}); check this Mac's Ray install")


def port_taken(ip: str, port: int) -> str | None:
    """Why a head could not listen on port (at ip, where Ray's head listens, or on every interface), or None."""
    for host in (ip, "127.0.0.1"):
        if unreachable(host, port, timeout_s=1.0) is None:
            return f"something answers at {host}:{port} already"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As a gRPC server binds: SO_REUSEADDR lets it past connections closing on the port, not past a listener.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as e:
            return str(e.strerror or e)
    return None
