"""A node's `ray start`: its address, the head's address, object store, labels, version check and error lines (no Ray
started)."""

from __future__ import annotations

import json

import pytest

from raytrm.distributed import node as nodes
from raytrm.errors import UserError

SPEC = nodes.NodeSpec(
    tier="mac-desktop-16gb",
    memory_budget_mb=12288,
    node_ip="192.168.1.10",
    versions={"python": "3.11.7", "ray": "2.60.0", "torch": "2.13.0+cpu", "raytrm": "0.1.0"},
    memory_bytes=16 * 2**30,
)


def test_the_node_address():
    assert nodes.lan_address("127.0.0.1") == "127.0.0.1"
    for wrong in ("mac.local", "300.1.1", "1.2.3.4 ", "", "0x7f.1", "1.2.3"):
        with pytest.raises(UserError, match=r"^--node-ip '.*': not an IPv4 address; give this Mac's LAN address$"):
            nodes.lan_address(wrong)
    found = nodes.lan_address()
    assert found.count(".") == 3 and not found.startswith("127.")
    assert found in nodes.local_addresses() and nodes.local_addresses()[-1].startswith("127.")


def test_a_node_address_this_machine_does_not_hold_is_refused_with_the_ones_it_does():
    # 203.0.113.0/24 is TEST-NET-3: documentation only, never a machine's address.
    with pytest.raises(UserError) as refused:
        nodes.lan_address("203.0.113.77")
    held = ", ".join(nodes.local_addresses())
    assert str(refused.value) == (
        f"--node-ip 203.0.113.77: not an address of this Mac (it holds {held}); give one of them, or leave --node-ip "
        "out to use the LAN interface's"
    )


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


def test_addresses():
    assert nodes.split_address("10.0.0.1") == ("10.0.0.1", 6379)
    assert nodes.split_address("10.0.0.1:7000") == ("10.0.0.1", 7000)
    assert nodes.split_address("mac-studio.local:1") == ("mac-studio.local", 1)
    assert nodes.split_address("h:65535", what="--address", default_port=None) == ("h", 65535)
    with pytest.raises(UserError, match=r"^--address 'h': got no port, expected HOST:PORT \(e\.g\. 192"):
        nodes.split_address("h", what="--address", default_port=None)


@pytest.mark.parametrize(
    ("address", "found"),
    [
        ("10.0.0.1:port", "got port 'port'"),
        ("10.0.0.1:0", "got port '0'"),
        ("10.0.0.1:65536", "got port '65536'"),
        ("10.0.0.1:99999", "got port '99999'"),
        ("10.0.0.1:-1", "got port '-1'"),
        ("10.0.0.1:", "got port ''"),
        ("10.0.0.1: 80", "got port ' 80'"),
        ("10.0.0.1:\u0661\u0662", "got port '\u0661\u0662'"),  # digits, but not ASCII ones
    ],
)
def test_a_port_out_of_range_or_not_a_number_is_refused_naming_it_and_the_range(address, found):
    with pytest.raises(UserError) as refused:
        nodes.split_address(address)
    assert str(refused.value) == (
        f"the head's address {address!r}: {found}, expected a port from 1 to 65535 (e.g. 192.168.1.10:6379)"
    )


@pytest.mark.parametrize("address", [":6379", "", "[::1]:6379", "::1", "a b:1", "h\n:1", "x" * 254 + ":1", "-h:1"])
def test_a_host_that_is_empty_or_no_host_name_is_refused(address):
    with pytest.raises(UserError, match=r"^the head's address '.*': got (an empty host|host '.*'), expected an IPv4"):
        nodes.split_address(address)


def test_the_port_numbers():
    assert [nodes.port_number(t) for t in ("1", "6379", "65535", "06379")] == [1, 6379, 65535, 6379]
    assert [nodes.port_number(t) for t in ("0", "65536", "-1", "", "abc", "1e3", "+80", "123456")] == [None] * 8


def test_version_checks():
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
