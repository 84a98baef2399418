"""The cluster commands' hostile cases (issue 57, points 4, 5 and 8): secrets stay private, every network wait has
a deadline, ports are in range. Each case a fixed example, through the CLI, against 127.0.0.1 only.

Every case ends with exit code 2 and one line naming what was wrong (argparse's refusals end in that line), within
seconds, with the token files untouched byte for byte and mode for mode, and no `ray start` run. Fast, no Ray
started, except the two marked slow.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrm.cli import main
from raytrm.distributed import cluster, node
from tests.unit.distributed.servers import closed_port, listening

TOKEN = "c0ffee" * 10 + "c0de"


@pytest.fixture
def home(tmp_path, monkeypatch):
    """HOME in tmp_path holding a token of mode 0600, an environment of this test's own (the commands turn Ray's
    token auth on in it), and `ray start` forbidden: none of these cases may start a node."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("RAY_")})
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    token = tmp_path / "home" / ".ray" / "auth_token"
    token.parent.mkdir(parents=True)
    token.write_text(TOKEN)
    token.chmod(0o600)

    def no_ray_start(argv, env, what, timeout_s=120):
        raise AssertionError(f"{what} ran: {argv}")

    monkeypatch.setattr(node, "run_ray", no_ray_start)
    monkeypatch.setattr(cluster, "_auto_address", lambda: None)  # other Rays on this machine are not this Mac's
    return token


def cli(*argv: str) -> tuple[int, str, float]:
    """`raytrm ARGV` in this process: (exit code, the last line on stderr, seconds); argparse's exit included."""
    err = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code
    took = time.monotonic() - start
    text = err.getvalue()
    assert "Traceback" not in text, text
    lines = text.strip().splitlines()
    return code, lines[-1] if lines else "", took


def refused(*argv: str, within: float = 5.0) -> str:
    """The one line of a refusal, after checking exit code 2 and the deadline."""
    code, line, took = cli(*argv)
    assert code == 2 and took < within, (code, line, took)
    return line


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


REACH = "start it with `raytrm cluster head`, or check the address and the head's firewall"
NOT_A_HEAD = "give the address `raytrm cluster head` printed (port 6379 unless given --port)"


# 1. A local run's token: Ray 2.60 turns token auth on for a local cluster and writes ~/.ray/auth_token with the
# umask's mode (0644) when it finds none.


def rays_local_init(**kwargs) -> None:
    """What ray.init(address="local") does to the token: Ray's own code writes one where there is none."""
    from ray._private.authentication.authentication_token_setup import generate_and_save_token

    if not (Path.home() / ".ray" / "auth_token").exists():
        generate_and_save_token()


def open_to_others(token: Path) -> str:
    return (
        f"raytrm: error: the cluster token at {token} is open to other users (mode 0644): anyone on this Mac could "
        f"read it and drive the cluster; run `chmod 600 {token}` and try again"
    )


def test_1_a_local_run_leaves_its_token_private(home, monkeypatch):
    import ray

    home.unlink()
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", rays_local_init)
    assert cluster.connect(None) is True
    assert mode(home) == 0o600 and len(home.read_text()) == 64


def test_1_a_local_runs_token_left_open_by_an_earlier_ray_is_refused_with_the_chmod(home, monkeypatch):
    import ray

    home.chmod(0o644)
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("a local Ray started"))
    assert refused("train", "--workers", "2", "--steps", "1", "--quiet") == open_to_others(home)
    assert mode(home) == 0o644 and home.read_text() == TOKEN


def test_1_rays_own_token_writer_is_what_this_guards_against(tmp_path, monkeypatch):
    """Without raytrm's token first, Ray's writer leaves the token readable by every user (umask 022)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    old = os.umask(0o022)
    try:
        rays_local_init()
    finally:
        os.umask(old)
    assert mode(tmp_path / ".ray" / "auth_token") == 0o644


# 2. Token files on join, status and any driver: one rule (refused with the chmod to run where other users could
# read or replace them; never changed behind the user's back), and a file that is no token is one line.


def commands(port: int, token: Path) -> dict[str, list[str]]:
    return {
        "join": ["cluster", "join", f"127.0.0.1:{port}", "--token-file", str(token)],
        "status": ["cluster", "status", "--address", f"127.0.0.1:{port}", "--token-file", str(token)],
        "train": ["train", "--address", f"127.0.0.1:{port}", "--steps", "1", "--quiet"],  # reads ~/.ray/auth_token
    }


@pytest.mark.parametrize("command", ["join", "status", "train"])
@pytest.mark.parametrize("found", [0o644, 0o640, 0o604, 0o620])
def test_2_a_token_other_users_could_read_or_replace_is_refused_with_the_chmod(home, command, found):
    home.chmod(found)
    with closed_port() as port:
        line = refused(*commands(port, home)[command])
    assert line == open_to_others(home).replace("mode 0644", f"mode {found:04o}")
    assert mode(home) == found and home.read_text() == TOKEN


def copy_fix(token: Path) -> str:
    return f"copy the head's (`scp 127.0.0.1:.ray/auth_token {token} && chmod 600 {token}`)"


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda p: p.mkdir(), "is a directory, expected a file holding the token"),
        (lambda p: os.mkfifo(p), "is not a regular file, expected a file holding the token"),
        (lambda p: p.write_bytes(b""), "is empty, expected one line of letters and digits"),
        (lambda p: p.write_bytes(b"\n\n"), "is empty, expected one line of letters and digits"),
        (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n"), "is not text (bytes other than ASCII), expected one line"),
        (lambda p: p.write_bytes(TOKEN.encode() + b"\nsecond\n"), "holds 2 lines, expected one line"),
        (lambda p: p.write_bytes(b"my token"), "holds spaces or control characters, expected one line"),
    ],
)
@pytest.mark.parametrize("command", ["join", "status"])
def test_2_a_token_file_that_is_no_token_is_one_line(home, tmp_path, command, make, problem):
    token = tmp_path / "given_token"
    make(token)
    if token.is_file():
        token.chmod(0o600)
    before = token.read_bytes() if token.is_file() else None
    with closed_port() as port:
        line = refused(*commands(port, token)[command])
    assert line.startswith(f"raytrm: error: the cluster token at {token} {problem}")
    # join names the head to copy the token from; a driver, which may not know it, says HEAD
    assert line.endswith(copy_fix(token) if command == "join" else copy_fix(token).replace("127.0.0.1", "HEAD"))
    assert TOKEN not in line and "second" not in line and "my token" not in line  # the secret is never shown
    if before is not None:
        assert token.read_bytes() == before


def test_2_a_missing_or_unreadable_token_is_one_line(home, tmp_path, monkeypatch):
    with closed_port() as port:
        missing = tmp_path / "missing"
        assert refused("cluster", "join", f"127.0.0.1:{port}", "--token-file", str(missing)) == (
            f"raytrm: error: no cluster token at {missing}: copy the head's ~/.ray/auth_token here (`scp "
            f"127.0.0.1:.ray/auth_token {missing} && chmod 600 {missing}`), or pass --token-file"
        )
        line = refused("cluster", "status", "--address", f"127.0.0.1:{port}", "--token-file", str(missing))
        assert line.startswith(f"raytrm: error: no cluster token at {missing}: ")
        from raytrm.distributed import tokens

        def unreadable(*args, **kwargs):  # as root, mode 000 would still read: the refusal is faked
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(tokens, "open", unreadable, raising=False)
        assert refused("cluster", "join", f"127.0.0.1:{port}") == (
            f"raytrm: error: cannot read the cluster token at {home} (Permission denied); {copy_fix(home)}"
        )


# 3. Every network wait has a deadline: nothing answers, something answers that is no Ray head; the head's port
# taken, its address not this machine's.


@pytest.mark.parametrize("command", ["join", "status", "train"])
def test_3_an_unreachable_address_is_one_line_at_once(home, command):
    with closed_port() as port:
        line = refused(*commands(port, home)[command], within=3)
    where = f"127.0.0.1:{port}" if command == "join" else f"--address 127.0.0.1:{port}"
    assert line == f"raytrm: error: {where}: cannot reach a Ray head there (Connection refused); {REACH}"
    assert home.read_text() == TOKEN and mode(home) == 0o600


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("silent", "no HTTP/2 answer within 1 s"),  # 3 s unless shortened, as here
        ("http", "its answer is not gRPC's HTTP/2"),
        ("close", None),  # closed, or reset: as the kernel has it
    ],
)
@pytest.mark.parametrize("command", ["join", "status", "train"])
def test_3_a_port_that_answers_but_is_no_ray_head_is_one_line_within_seconds(home, monkeypatch, command, kind, why):
    from raytrm.distributed import reach

    monkeypatch.setattr(reach, "CHECK_TIMEOUT_S", 1.0)
    with listening(kind) as port:
        line = refused(*commands(port, home)[command], within=5)
    where = f"127.0.0.1:{port}" if command == "join" else f"--address 127.0.0.1:{port}"
    assert line.startswith(f"raytrm: error: {where}: something answers there, but not as a Ray head (")
    assert line.endswith(f"); {NOT_A_HEAD}")
    if why:
        assert f"({why})" in line


def test_3_status_without_a_cluster_on_this_mac_is_one_line(home):
    assert refused("cluster", "status") == (
        "raytrm: error: no raytrm cluster runs on this Mac; start one with `raytrm cluster head`, join one with "
        "`raytrm cluster join HEAD`, or give --address HEAD:PORT"
    )


def test_3_the_head_on_a_port_already_taken_is_one_line(home):
    with listening("silent") as port:
        line = refused("cluster", "head", "--port", str(port))
    assert line.startswith(f"raytrm: error: --port {port}: the head cannot listen there (something answers at ")
    assert line.endswith(
        f":{port} already); stop what uses it (`lsof -i :{port}` names it; `raytrm cluster stop` if it is a Ray "
        "node), or give another --port"
    )


@pytest.mark.parametrize("command", ["head", "join"])
def test_3_a_node_address_that_is_not_this_machines_is_one_line(home, monkeypatch, command):
    from raytrm.distributed import cluster_commands

    monkeypatch.setattr(cluster_commands, "check_head", lambda *args: None)  # join asks the head first: it answers
    held = ", ".join(node.local_addresses())
    target = ["head"] if command == "head" else ["join", "127.0.0.1:6379"]
    assert refused("cluster", *target, "--node-ip", "203.0.113.9") == (  # TEST-NET-3: no machine's address
        f"raytrm: error: --node-ip 203.0.113.9: not an address of this Mac (it holds {held}); give one of them, or "
        "leave --node-ip out to use the LAN interface's"
    )


def test_3_a_dashboard_host_that_is_not_this_machines_is_one_line(home):
    assert refused("cluster", "head", "--dashboard-host", "203.0.113.9").startswith(
        "raytrm: error: --dashboard-host '203.0.113.9': not an address of this Mac; give 127.0.0.1 (this Mac only), "
        "0.0.0.0 (every interface) or one of "
    )


# 4. Ports out of range, or no port at all: refused naming the value and the range.


@pytest.mark.parametrize("port", ["70000", "65536", "0", "-1", "abc", "", "6379.0", " 80"])
def test_4_the_heads_port_out_of_range_is_refused_naming_it_and_the_range(home, port):
    line = refused("cluster", "head", f"--port={port}")
    assert line == (
        f"raytrm: error: raytrm cluster head: --port: got {port!r}, expected a port from 1 to 65535 "
        "(see `raytrm cluster head --help`)"
    ), line


@pytest.mark.parametrize(
    ("address", "found"),
    [
        ("127.0.0.1:99999", "got port '99999'"),
        ("127.0.0.1:0", "got port '0'"),
        ("127.0.0.1:-1", "got port '-1'"),
        ("127.0.0.1:abc", "got port 'abc'"),
        ("127.0.0.1:", "got port ''"),
        (":6379", "got an empty host"),
        ("", "got an empty host"),
        ("[::1]:6379", "got host '[::1]'"),
    ],
)
def test_4_an_address_out_of_range_or_without_a_host_is_refused(home, address, found):
    range_or_host = "a port from 1 to 65535" if "port" in found else "an IPv4 address or a host name"
    expected = f"{found}, expected {range_or_host} (e.g. 192.168.1.10:6379)"
    assert refused("cluster", "join", address) == f"raytrm: error: the head's address {address!r}: {expected}"
    assert refused("cluster", "status", "--address", address) == f"raytrm: error: --address {address!r}: {expected}"
    line = refused("train", "--address", address, "--steps", "1", "--quiet")  # "" too: not a run without Ray
    assert line == f"raytrm: error: --address {address!r}: {expected}"
    assert home.read_text() == TOKEN


def test_4_a_train_address_needs_its_port(home):
    assert refused("train", "--address", "127.0.0.1", "--steps", "1", "--quiet") == (
        "raytrm: error: --address '127.0.0.1': got no port, expected HOST:PORT (e.g. 192.168.1.10:6379)"
    )


# 5. Ray's C++ retry lines never reach the terminal beside raytrm's line: the commands run as a person runs them,
# with stderr as the file descriptor Ray's C++ logging writes to.


def run_raytrm(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(home.parent.parent)
    return subprocess.run(
        [sys.executable, "-m", "raytrm.cli", *argv], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_5_an_unreachable_status_prints_one_line_and_nothing_of_rays(home):
    with closed_port() as port:
        done = run_raytrm(home, "cluster", "status", "--address", f"127.0.0.1:{port}")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"raytrm: error: --address 127.0.0.1:{port}: cannot reach a Ray head there (Connection refused); {REACH}"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["join", "status"])
def test_5_a_grpc_server_that_is_no_ray_head_prints_one_line_within_seconds(home, command):
    """Ray's own client asks (Ray imported in a child): alone it retries for 40 s, with C++ lines on stderr."""
    with listening("grpc") as port:
        start = time.monotonic()
        argv = commands(port, home)[command]
        done = run_raytrm(home, *argv)
        took = time.monotonic() - start
    where = f"127.0.0.1:{port}" if command == "join" else f"--address 127.0.0.1:{port}"
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"raytrm: error: {where}: something answers there, but ") and took < 20
