"""`raytrm cluster head | join | status` before Ray: what each checks, in which order, and that a refusal starts
nothing and leaves the token as it was (no Ray started, nothing sent off loopback)."""

from __future__ import annotations

import os

import pytest

from raytrm.distributed import cluster, node, path_client, tokens
from raytrm.distributed import cluster_commands as commands
from raytrm.errors import UserError
from tests.unit.distributed.servers import closed_port

TOKEN = "ab" * 32


@pytest.fixture
def token(tmp_path, monkeypatch):
    """A private environment, HOME in tmp_path with a token, and `ray start` forbidden."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("RAY_")})
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / ".ray" / "auth_token"
    path.parent.mkdir()
    path.write_text(TOKEN)
    path.chmod(0o600)

    def no_ray_start(argv, env, what, timeout_s=120):
        raise AssertionError(f"{what} ran")

    monkeypatch.setattr(node, "run_ray", no_ray_start)
    return path


def test_join_checks_the_address_then_the_token_then_the_head_then_the_paths(token, tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(commands, "check_head", lambda host, port, label, env: asked.append((host, port, label, env)))
    monkeypatch.setattr(path_client, "find_paths", lambda *a: asked.append(a) or [])
    monkeypatch.setattr(node, "this_node", lambda *a: (_ for _ in ()).throw(UserError("probed")))
    with pytest.raises(UserError, match="got port '0'"):
        commands.join("10.0.0.1:0", token_file=str(tmp_path / "missing"))  # the address, before the token
    with pytest.raises(UserError, match="no cluster token at"):
        commands.join("10.0.0.1", token_file=str(tmp_path / "missing"))  # the token, before the network
    assert asked == []
    with pytest.raises(UserError, match=r"^probed$"):  # the head answered: then this machine is probed
        commands.join("10.0.0.1")
    assert asked == [
        ("10.0.0.1", 6379, "10.0.0.1:6379", tokens.ray_environment(token)),
        ("10.0.0.1", 6380, TOKEN, token),
    ]
    asked.clear()
    with pytest.raises(UserError, match=r"^probed$"):  # the path service on a port of its own
        commands.join("10.0.0.1:7000", paths_port=7100)
    assert asked[1] == ("10.0.0.1", 7100, TOKEN, token)
    with pytest.raises(UserError, match=r"^--paths-port 65536: expected a port from 1 to 65535"):
        commands.join("10.0.0.1:65535")


def test_the_head_refuses_a_port_out_of_range_before_it_probes_anything(token, monkeypatch):
    monkeypatch.setattr(node, "this_node", lambda *a: pytest.fail("probed"))
    for port in (0, -1, 65536, 70000):
        with pytest.raises(UserError) as refused:
            commands.head(port=port)
        assert str(refused.value) == f"--port {port}: expected a port from 1 to 65535, e.g. 6379"


def test_the_head_checks_its_token_before_it_starts(token, tmp_path, monkeypatch):
    monkeypatch.setattr(commands, "port_taken", lambda ip, port: None)
    (tmp_path / "dir").mkdir()
    with pytest.raises(UserError, match=r"the cluster token at .*dir is a directory, .*; move it away and run again"):
        commands.head(node_ip="127.0.0.1", token_file=str(tmp_path / "dir"))
    token.chmod(0o644)
    with pytest.raises(UserError, match=r"is open to other users \(mode 0644\): .* run `chmod 600 .*auth_token`"):
        commands.head(node_ip="127.0.0.1")
    token.chmod(0o600)
    with pytest.raises(AssertionError, match="ray start --head ran"):  # checked, then started
        commands.head(node_ip="127.0.0.1")
    assert token.read_text() == TOKEN


def test_status_reads_the_token_before_it_asks_the_network(token, tmp_path, monkeypatch):
    monkeypatch.setattr(commands, "check_address", lambda *a, **k: pytest.fail("asked the network"))
    with pytest.raises(UserError, match=r"^no cluster token at .*missing"):
        commands.status("127.0.0.1:6379", token_file=str(tmp_path / "missing"))


def test_an_address_auto_means_this_macs_cluster_or_one_line(token, monkeypatch):
    asked = []
    monkeypatch.setattr(cluster, "check_head", lambda host, port, label: asked.append((host, port, label)))
    monkeypatch.setattr(cluster, "ray_node_here", lambda: True)
    monkeypatch.setattr(cluster, "_auto_address", lambda: None)
    with pytest.raises(UserError) as refused:
        cluster.check_address("auto")
    assert str(refused.value) == (
        "--address auto: no Ray cluster runs on this Mac; start one with `raytrm cluster head`, join one with `raytrm "
        "cluster join HEAD`, or give --address HEAD:PORT"
    )
    with pytest.raises(UserError, match=r"^no raytrm cluster runs on this Mac; "):
        cluster.check_address(None)
    monkeypatch.setattr(cluster, "_auto_address", lambda: "10.0.0.1:6379")
    assert cluster.check_address("auto") == cluster.check_address(None) == "10.0.0.1:6379"
    assert asked == [
        ("10.0.0.1", 6379, "--address auto (10.0.0.1:6379)"),
        ("10.0.0.1", 6379, "this Mac's cluster at 10.0.0.1:6379"),
    ]


def test_a_driver_needs_a_ray_node_on_this_mac(token, monkeypatch):
    """Else ray.init waits 60 s for a raylet here, then fails."""
    monkeypatch.setattr(cluster, "check_head", lambda host, port, label: None)
    monkeypatch.setattr(cluster, "ray_node_here", lambda: False)
    with pytest.raises(UserError) as refused:
        cluster.check_address("10.0.0.1:6379")
    assert str(refused.value) == (
        "--address 10.0.0.1:6379: this Mac runs no Ray node, and a Ray driver needs one; run this on the head or on a "
        "Mac that joined it (`raytrm cluster join HEAD`)"
    )


def test_an_empty_address_is_refused_not_taken_for_none(token, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail(f"ray.init({kw})"))
    with pytest.raises(UserError, match=r"^--address '': got an empty host"):
        cluster.connect("")
    with closed_port() as port, pytest.raises(UserError, match=r"cannot reach a Ray head there \(Connection refused"):
        cluster.connect(f"127.0.0.1:{port}")
