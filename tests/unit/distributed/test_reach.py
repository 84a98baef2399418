"""Whether a Ray head answers: every check ends within its deadline with one line, against loopback only."""

from __future__ import annotations

import socket
import time

import pytest

from raytrm.distributed import reach
from raytrm.errors import UserError
from tests.unit.distributed.servers import closed_port, listening


def timed(fn, *args, **kwargs):
    start = time.monotonic()
    return fn(*args, **kwargs), time.monotonic() - start


def test_a_closed_port_is_unreachable_at_once():
    with closed_port() as port:
        why, took = timed(reach.unreachable, "127.0.0.1", port)
    assert why == "Connection refused" and took < 1


def test_a_name_lookup_that_does_not_answer_has_a_deadline(monkeypatch):
    def resolver_away(*args, **kwargs):
        time.sleep(5)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", resolver_away)
    why, took = timed(reach.unreachable, "mac-studio.local", 6379, timeout_s=0.3)
    assert why == "no answer for the name mac-studio.local within 0.3 s" and took < 1


def test_a_name_that_does_not_resolve_or_cannot_be_a_name_is_its_reason(monkeypatch):
    def unknown(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    assert reach.unreachable("no-such-mac.invalid", 6379) == "Name or service not known"
    monkeypatch.undo()
    label = "a" * 64  # one label over 63 characters: the IDNA codec refuses it, before any lookup is sent
    assert "label" in reach.unreachable(f"{label}.local", 6379)


def test_the_grpc_check_tells_a_grpc_server_from_what_is_not_one():
    with listening("grpc") as port:
        assert reach.not_grpc("127.0.0.1", port) is None
    with listening("http") as port:
        assert reach.not_grpc("127.0.0.1", port) == "its answer is not gRPC's HTTP/2"
    with listening("close") as port:
        assert reach.not_grpc("127.0.0.1", port) in ("it closed the connection", "Connection reset by peer")
    with listening("silent") as port:
        why, took = timed(reach.not_grpc, "127.0.0.1", port, timeout_s=0.5)
    assert why == "no HTTP/2 answer within 0.5 s" and 0.4 < took < 2


def test_rays_own_call_is_killed_at_its_deadline(monkeypatch):
    monkeypatch.setattr(reach, "_RAY_CALL", "import time; time.sleep(60)")
    said, took = timed(reach.ray_call, "127.0.0.1", 1, timeout_s=1.0)
    assert said == {"timeout": 1.0} and took < 5


def test_rays_own_call_that_breaks_is_its_last_line(monkeypatch):
    monkeypatch.setattr(reach, "_RAY_CALL", "raise SystemExit('ray: no such module here')")
    assert reach.ray_call("127.0.0.1", 1) == {"error": "ray: no such module here"}
    monkeypatch.setattr(reach, "_RAY_CALL", "import json; print(json.dumps({'rpc': 'UNIMPLEMENTED'}))")
    assert reach.ray_call("127.0.0.1", 1) == {"rpc": "UNIMPLEMENTED"}


NOT_A_HEAD = "give the address `raytrm cluster head` printed (port 6379 unless given --port)"


def test_check_head_says_why_in_one_line(monkeypatch):
    with closed_port() as port, pytest.raises(UserError) as refused:
        reach.check_head("127.0.0.1", port, f"--address 127.0.0.1:{port}")
    assert str(refused.value) == (
        f"--address 127.0.0.1:{port}: cannot reach a Ray head there (Connection refused); start it with `raytrm "
        "cluster head`, or check the address and the head's firewall"
    )
    with listening("http") as port, pytest.raises(UserError) as refused:
        reach.check_head("127.0.0.1", port, f"127.0.0.1:{port}")
    assert str(refused.value) == (
        f"127.0.0.1:{port}: something answers there, but not as a Ray head (its answer is not gRPC's HTTP/2); "
        + NOT_A_HEAD
    )


@pytest.mark.parametrize(
    ("said", "env", "line"),
    [
        (
            {"refused": "InvalidAuthToken"},
            {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/t/auth_token"},
            "the head at 127.0.0.1:{port} refused the cluster token at /t/auth_token: it is not the head's; copy the "
            "head's (`scp 127.0.0.1:.ray/auth_token /t/auth_token && chmod 600 /t/auth_token`)",
        ),
        (
            {"refused": "InvalidAuthToken"},
            {"RAY_AUTH_MODE": "disabled"},
            "the head at 127.0.0.1:{port} wants its cluster token and this Mac has none: copy it (`scp "
            "127.0.0.1:.ray/auth_token ~/.ray/auth_token && chmod 600 ~/.ray/auth_token`), or pass --token-file",
        ),
        (
            {"timeout": 10.0},
            {},
            "H: something answers there, but no Ray head replied within 10 s; " + NOT_A_HEAD,
        ),
        (
            {"rpc": "RPC error: Deadline Exceeded\nmore"},
            {},
            "H: something answers there, but not as a Ray head (RPC error: Deadline Exceeded); " + NOT_A_HEAD,
        ),
        (
            {"error": "ModuleNotFoundError: No module named 'ray'"},
            {},
            "H: could not ask the Ray head there (ModuleNotFoundError: No module named 'ray'); check this Mac's Ray "
            "install",
        ),
    ],
)
def test_what_rays_own_call_says_is_one_line(monkeypatch, said, env, line):
    asked = []
    monkeypatch.setattr(reach, "ray_call", lambda host, port, env: asked.append(env) or said)
    with listening("grpc") as port, pytest.raises(UserError) as refused:
        reach.check_head("127.0.0.1", port, "H", env)
    assert str(refused.value) == line.format(port=port) and asked == [env]


def test_a_head_that_answers_and_takes_the_token_passes(monkeypatch):
    monkeypatch.setattr(reach, "ray_call", lambda host, port, env: {})
    with listening("grpc") as port:
        reach.check_head("127.0.0.1", port, "H")


def test_a_port_something_listens_on_or_holds_is_taken():
    with listening("silent") as port:
        assert reach.port_taken("127.0.0.1", port) == f"something answers at 127.0.0.1:{port} already"
    with closed_port() as port:
        assert reach.port_taken("127.0.0.1", port) == "Address already in use"
    assert reach.port_taken("127.0.0.1", port) is None  # let go


@pytest.mark.slow
def test_a_grpc_server_that_is_no_ray_head_ends_within_the_deadline():
    """Ray's own client, asked in a child: a gRPC server that never answers Ray's call is one line within seconds
    (Ray's client alone retries for 40 s)."""
    with listening("grpc") as port:
        start = time.monotonic()
        with pytest.raises(UserError) as refused:
            reach.check_head("127.0.0.1", port, "H")
        took = time.monotonic() - start
    assert str(refused.value).startswith("H: something answers there, but ") and str(refused.value).endswith(NOT_A_HEAD)
    assert took < reach.RAY_CALL_TIMEOUT_S + 1
