"""A node's `ray start`: token file, address, object store, labels, version check and error lines (no Ray started)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from raytrm.cli import main
from raytrm.distributed import node as nodes
from raytrm.errors import UserError

SPEC = nodes.NodeSpec(
    tier="mac-desktop-16gb",
    memory_budget_mb=12288,
    node_ip="192.168.1.10",
    versions={"python": "3.11.7", "ray": "2.60.0", "torch": "2.13.0+cpu", "raytrm": "0.1.0"},
    memory_bytes=16 * 2**30,
)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_head_token_is_created_private_and_kept(tmp_path):
    token = tmp_path / ".ray" / "auth_token"
    assert nodes.ensure_token(token) is True
    text = token.read_text()
    assert mode(token) == 0o600 and len(text) == 64 and int(text, 16) >= 0
    assert nodes.ensure_token(token) is False and token.read_text() == text  # joined nodes keep working
    token.chmod(0o644)  # as Ray writes its own
    nodes.ensure_token(token)
    assert mode(token) == 0o600


def test_a_missing_or_empty_token_says_how_to_bring_it(tmp_path):
    with pytest.raises(UserError, match=r"no cluster token at .*missing.*scp 10\.0\.0\.1:\.ray/auth_token"):
        nodes.read_token(tmp_path / "missing", head="10.0.0.1")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(UserError, match="no cluster token"):
        nodes.read_token(tmp_path / "empty")
    (tmp_path / "ok").write_text("ab12\n")
    assert nodes.read_token(tmp_path / "ok") == "ab12"


def test_the_node_address():
    assert nodes.lan_address("192.168.1.20") == "192.168.1.20"
    with pytest.raises(UserError, match=r"--node-ip mac\.local: not an IPv4 address"):
        nodes.lan_address("mac.local")
    found = nodes.lan_address()
    assert found.count(".") == 3 and not found.startswith("127.")


def test_gloo_is_bound_to_the_interface_of_the_node_address():
    loopback = nodes.interface_of("127.0.0.1")
    assert loopback in ("lo", "lo0")  # Linux, macOS
    assert nodes.collective_environment("127.0.0.1") == {"GLOO_SOCKET_IFNAME": loopback}
    assert nodes.collective_environment("203.0.113.77") == {}  # an address this machine does not hold


def test_the_object_store_is_small_beside_the_training_budget():
    assert nodes.object_store_bytes(8 * 2**30) == 512 * 2**20  # 5% is under the floor
    assert nodes.object_store_bytes(16 * 2**30) == int(0.05 * 16 * 2**30)
    assert nodes.object_store_bytes(128 * 2**30) == 2 * 2**30  # Ray's cap on a Mac
    assert nodes.object_store_bytes(16 * 2**30, explicit_mb=300) == 300 * 2**20
    with pytest.raises(UserError, match="--object-store-mb 10: Ray needs at least 100 MiB"):
        nodes.object_store_bytes(16 * 2**30, explicit_mb=10)


def test_start_commands_advertise_the_tier_and_the_versions():
    head = nodes.start_command(SPEC)
    assert head[1:4] == ["-m", "ray.scripts.scripts", "start"]
    assert "--head" in head and "--port=6379" in head and "--dashboard-host=127.0.0.1" in head
    assert "--node-ip-address=192.168.1.10" in head and "--disable-usage-stats" in head
    resources = json.loads(next(a for a in head if a.startswith("--resources="))[len("--resources=") :])
    assert resources == {"raytrm_machine": 1, "raytrm_tier:mac-desktop-16gb": 1}
    labels = dict(pair.split("=") for pair in next(a for a in head if a.startswith("--labels="))[9:].split(","))
    assert labels == {
        "raytrm/tier": "mac-desktop-16gb",
        "raytrm/budget-mb": "12288",
        "raytrm/python": "3.11.7",
        "raytrm/ray": "2.60.0",
        "raytrm/torch": "2.13.0_cpu",  # "+" is not allowed in a Ray label
        "raytrm/raytrm": "0.1.0",
    }
    join = nodes.start_command(SPEC, head="192.168.1.10:6379")
    assert "--address=192.168.1.10:6379" in join and "--head" not in join
    assert not any(a.startswith("--dashboard") for a in join)


def test_ray_labels_accept_what_the_node_advertises():
    from ray._private.label_utils import validate_node_label_syntax

    validate_node_label_syntax(SPEC.labels())  # raises on a key or value Ray would refuse


def test_the_environment_turns_token_auth_on_and_macos_clustering(tmp_path):
    env = nodes.ray_environment(tmp_path / "t", platform="darwin")
    assert env == {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(tmp_path / "t"),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
    }
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in nodes.ray_environment(tmp_path / "t", platform="linux")


def test_addresses_and_version_checks():
    assert nodes.split_address("10.0.0.1") == ("10.0.0.1", 6379)
    assert nodes.split_address("10.0.0.1:7000") == ("10.0.0.1", 7000)
    with pytest.raises(UserError, match="expected HEAD or HEAD:PORT"):
        nodes.split_address("10.0.0.1:port")
    head = SPEC.labels()
    assert nodes.version_mismatch(head, dict(head)) is None
    mine = {**head, "raytrm/torch": "2.12.0", "raytrm/raytrm": "0.2.0"}
    assert nodes.version_mismatch(mine, head) == (
        "versions differ from the head's: torch 2.12.0 here, 2.13.0_cpu on the head; raytrm 0.2.0 here, 0.1.0 on "
        "the head; install the head's versions on this Mac and join again"
    )


def test_a_failed_ray_command_is_its_reason_in_one_line():
    output = "\n".join(
        [
            "2026-11-23 INFO scripts.py -- Local node IP: 10.0.0.2",
            "Traceback (most recent call last):",
            '  File "x.py", line 1, in <module>',
            "ray.exceptions.AuthenticationError: Authentication token is missing or incorrect",
        ]
    )
    assert nodes._ray_error(output) == "Authentication token is missing or incorrect"
    assert nodes._ray_error("") == "no output"
    with pytest.raises(UserError, match=r"^ray start failed: .*No such option"):
        nodes.run_ray([*nodes.start_command(SPEC)[:4], "--no-such-option"], {}, "ray start")


@pytest.mark.parametrize(
    ("argv", "piece"),
    [
        (["cluster", "join", "10.0.0.1", "--token-file", "{tmp}/none"], "no cluster token at"),
        (["cluster", "join", "10.0.0.1:x", "--token-file", "{tmp}/none"], "expected HEAD or HEAD:PORT"),
        (["cluster", "join", "127.0.0.1:9", "--token-file", "{tmp}/token"], "cannot reach the head at 127.0.0.1:9"),
        (["cluster", "head", "--tier", "no-such-tier"], "--tier no-such-tier: not in the tier table"),
        (["cluster", "head", "--node-ip", "300.1.1"], "--node-ip 300.1.1: not an IPv4 address"),
    ],
)
def test_bad_cluster_input_is_one_line_and_starts_nothing(tmp_path, capsys, argv, piece):
    (tmp_path / "token").write_text("ab" * 32)
    code = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and piece in err[0], err


def test_a_driver_on_a_node_turns_token_auth_on_when_it_holds_the_token(tmp_path, monkeypatch):
    # A private copy of the environment: what the function sets must not reach the other tests (or Ray).
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("RAY_")})
    assert nodes.use_cluster_token(tmp_path / "missing") is False and "RAY_AUTH_MODE" not in os.environ
    token = tmp_path / "auth_token"
    token.write_text("ab" * 32)
    assert nodes.use_cluster_token(token) is True
    assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ["RAY_AUTH_TOKEN_PATH"] == str(token)
    os.environ["RAY_AUTH_MODE"] = "disabled"  # said otherwise: left alone
    assert nodes.use_cluster_token(token) is False and os.environ["RAY_AUTH_MODE"] == "disabled"
