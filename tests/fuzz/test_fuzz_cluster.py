"""Fuzzing the cluster commands' arguments: addresses, ports, node and dashboard addresses, token files (content,
mode, kind), through `raytrm cluster join | status | head` and `raytrm train --address`.

Property: each run ends within seconds with exit code 2 and one line on stderr, never a traceback; a token file is
left byte for byte and mode for mode as it was, one open to other users is never used, and its content never
shows. Only `head` may get as far as starting Ray, and it never does here: `ray start` is replaced by a marker of
acceptance.

Nothing leaves loopback: every name resolves to nothing but 127.0.0.1, and every port of 127.0.0.1 is one that
refuses connections, so no head is ever reached (Ray's own call is replaced too, and never asked).
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import stat
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mutations import FUZZ, Counter

from raytrm.cli import main
from raytrm.distributed import cluster, node, reach
from tests.unit.distributed.servers import closed_port

pytestmark = pytest.mark.slow

#: A run that takes longer than this has waited on the network without a deadline.
DEADLINE_S = 5.0

HOSTS = st.sampled_from(
    ["127.0.0.1", "localhost", "", "10.0.0.1", "192.168.1.10", "mac-studio.local", "[::1]", "::1", "a b", "-x", "é"]
) | st.text(max_size=12)
PORTS = (
    st.integers(-(2**16), 2**17).map(str)
    | st.sampled_from(["", "0", "1", "6379", "65535", "65536", "99999", "abc", "6379.0", " 80", "0x10", "١٢", "+1"])
    | st.text(max_size=6)
)
ADDRESSES = (
    st.builds(lambda host, sep, port: f"{host}{sep}{port}", HOSTS, st.sampled_from([":", "", "::", ":6379:"]), PORTS)
    | st.sampled_from(["auto", "", ":", "127.0.0.1:1"])
    | st.text(max_size=24)
)
NODE_IPS = st.sampled_from(["127.0.0.1", "203.0.113.9", "300.1.1.1", "", "1.2.3", "localhost"]) | st.text(max_size=10)
SAMPLE_TOKENS = [b"ab" * 32, b"ab" * 32 + b"\n", b"", b"\n", b"two\nlines", b"with space", b"\xff\xfe", b"a" * 5000]
TOKENS = st.sampled_from(SAMPLE_TOKENS) | st.binary(max_size=80) | st.text(max_size=40).map(str.encode)
KINDS = st.sampled_from(["file", "file", "file", "dir", "missing", "dangling", "fifo"])


def argv_of(draw, command: str, token: Path) -> list[str]:
    """A command line of command, with arguments drawn; the token file given (or left to ~/.ray/auth_token)."""
    given_token = ["--token-file", str(token)] if draw(st.booleans()) else []
    if command == "join":
        node_ip = ["--node-ip", draw(NODE_IPS)] if draw(st.booleans()) else []
        return ["cluster", "join", draw(ADDRESSES), *given_token, *node_ip]
    if command == "status":
        address = ["--address", draw(ADDRESSES)] if draw(st.booleans()) else []
        return ["cluster", "status", *address, *given_token]
    if command == "head":
        argv = ["cluster", "head", *given_token]
        argv += [f"--port={draw(PORTS)}"] if draw(st.booleans()) else []
        argv += ["--node-ip", draw(NODE_IPS)] if draw(st.booleans()) else []
        argv += ["--dashboard-host", draw(NODE_IPS)] if draw(st.booleans()) else []
        return argv
    return ["train", "--address", draw(ADDRESSES), "--steps", "1", "--quiet"]


def make_token(root: Path, kind: str, content: bytes, mode: int) -> Path:
    token = root / "home" / ".ray" / "auth_token"
    token.parent.mkdir(parents=True)
    if kind == "file":
        token.write_bytes(content)
        token.chmod(mode)
    elif kind == "dir":
        token.mkdir()
    elif kind == "dangling":
        token.symlink_to(root / "nowhere")
    elif kind == "fifo":
        os.mkfifo(token)
    return token


class Accepted(Exception):
    """`ray start` would have run: every argument passed."""


@contextlib.contextmanager
def loopback_only(closed: int):
    """Names resolve to 127.0.0.1 and the closed port alone, Ray's call and `ray start` never run, no other Ray."""
    real = socket.getaddrinfo

    def resolve(host, port, *args, **kwargs):
        if host in ("127.0.0.1", "localhost"):
            return real("127.0.0.1", closed, *args, **kwargs)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def ray_start(argv, env, what, timeout_s=120):
        raise Accepted(what)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket, "getaddrinfo", resolve)
        patch.setattr(node, "run_ray", ray_start)
        patch.setattr(reach, "ray_call", lambda *a, **k: pytest.fail("a head answered on loopback"))
        patch.setattr(cluster, "_auto_address", lambda: None)
        patch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("RAY_")})
        yield patch


def run(argv: list[str]) -> tuple[int | str, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code: int | str = main(argv)
        except SystemExit as e:
            code = e.code
        except Accepted:
            code = "accepted"
    return code, err.getvalue()


@pytest.fixture(scope="module")
def closed():
    with closed_port() as port:
        yield port


@pytest.fixture(scope="module")
def counter():
    counted = Counter("cluster commands")
    yield counted
    print(counted.report())


@FUZZ
@given(data=st.data())
def test_cluster_arguments_are_one_line_within_seconds(closed, counter, data):
    command = data.draw(st.sampled_from(["join", "status", "head", "train"]))
    kind, content, mode = data.draw(KINDS), data.draw(TOKENS), data.draw(st.integers(0, 0o777))
    with tempfile.TemporaryDirectory() as tmp, loopback_only(closed) as patch:
        root = Path(tmp)
        token = make_token(root, kind, content, mode)
        patch.setenv("HOME", str(root / "home"))
        argv = argv_of(data.draw, command, token)
        start = time.monotonic()
        code, err = run(argv)
        took = time.monotonic() - start
        assert took < DEADLINE_S, (argv, took)
        assert "Traceback" not in err, err[-2000:]
        lines = err.strip().splitlines()
        if code == "accepted":
            assert command == "head", argv
        else:
            assert code == 2 and lines, (argv, code, err[-2000:])
            line = lines[-1]
            assert line.startswith("raytrm: error: ") or (line.startswith("raytrm ") and ": error: " in line), line
            # One line of ours; argparse's own refusal (usage, then its line) is made one line elsewhere.
            assert len(lines) == 1 or not line.startswith("raytrm: error: "), err
        if kind == "file":
            assert token.read_bytes() == content and stat.S_IMODE(token.stat().st_mode) == mode  # never changed
            if mode & 0o077 and (code == "accepted" or "cannot reach a Ray head" in err):
                pytest.fail(f"a token open to others (mode {mode:04o}) was used: {argv}")
            secret = content.strip()
            if len(secret) >= 8 and b"\n" not in secret:
                assert secret.decode("latin-1") not in err
    counter.add(code != "accepted")
