"""Finding a head by mDNS: which of its addresses to join, and one line when none or several answer. No multicast is
sent here (the browse is a stand-in); tests/cluster/test_cluster.py joins a head found on a real network."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest

from raytrm.distributed import discovery, path_service, paths
from raytrm.distributed.discovery import Head, find_head
from raytrm.errors import UserError

WIFI = paths.Interface("en0", "192.168.1.21", 24)
BRIDGE = paths.Interface("bridge0", "169.254.10.2", 16)
STUDIO = Head("studio", ("192.168.1.10", "169.254.10.1"), 6379, 6380)


def test_the_address_joined_is_the_heads_on_a_network_of_this_mac():
    assert STUDIO.address_from([WIFI]) == "192.168.1.10:6379"
    assert STUDIO.address_from([BRIDGE]) == "169.254.10.1:6379"
    assert STUDIO.address_from([paths.Interface("en5", "10.9.0.2", 24)]) == "192.168.1.10:6379"  # none: its first


def test_one_head_found_is_joined(monkeypatch):
    monkeypatch.setattr(paths, "interfaces", lambda: [WIFI])
    assert find_head(0.1, look=lambda s: [STUDIO]) == (STUDIO, "192.168.1.10:6379")


def test_none_found_says_multicast_may_be_blocked_and_names_the_static_form(monkeypatch):
    monkeypatch.setattr(paths, "interfaces", lambda: [WIFI])
    with pytest.raises(UserError) as error:
        find_head(3, look=lambda s: [])
    assert str(error.value) == (
        "no raytrm head answered by mDNS (DNS-SD _raytrm._tcp) within 3 s: none runs on this network, or multicast "
        "is blocked here (macOS blocks it in SSH sessions, and some Wi-Fi networks do); give the head's address as "
        "`raytrm cluster head` printed it: raytrm cluster join HEAD[:PORT]"
    )


def test_several_found_are_named_and_none_is_picked(monkeypatch):
    monkeypatch.setattr(paths, "interfaces", lambda: [WIFI])
    other = Head("mini", ("192.168.1.30",), 6379, 6380)
    with pytest.raises(UserError, match=r"^2 raytrm heads answered by mDNS \(studio at 192.168.1.10:6379, mini at "):
        find_head(3, look=lambda s: [STUDIO, other])


def test_no_socket_for_multicast_is_one_line(monkeypatch):
    monkeypatch.setattr(paths, "interfaces", lambda: [WIFI])

    def blocked(seconds):
        raise OSError(1, "Operation not permitted")

    with pytest.raises(
        UserError, match=r"^cannot look for a head by mDNS here \(\[Errno 1\] Operation not permitted\)"
    ):
        find_head(3, look=blocked)


def test_with_no_interface_but_loopback_nothing_is_browsed():
    assert discovery.browse(5, interfaces=[]) == []  # at once, without a socket


def record(port: int, ray_port: bytes | None, addresses: list[str]) -> SimpleNamespace:
    """What zeroconf resolves a name to (its ServiceInfo's fields that `_head` reads)."""
    return SimpleNamespace(
        name=f"studio.{discovery.SERVICE}",
        port=port,
        properties={} if ray_port is None else {b"ray_port": ray_port},
        parsed_addresses=lambda: addresses,
    )


def test_a_record_is_read_and_one_without_a_ray_port_or_an_ipv4_address_is_left_out():
    assert discovery._head(record(6380, b"6379", ["192.168.1.10", "fe80::1"])) == Head(
        "studio", ("192.168.1.10",), 6379, 6380
    )
    assert discovery._head(record(6380, None, ["192.168.1.10"])) is None
    assert discovery._head(record(6380, b"port", ["192.168.1.10"])) is None
    assert discovery._head(record(6380, b"6379", ["fe80::1"])) is None


def test_a_head_on_loopback_is_not_advertised():
    assert not path_service.advertised("127.0.0.1")
    assert path_service.advertised("192.168.1.10")


def test_the_record_carries_the_heads_addresses_and_both_ports(monkeypatch):
    # The advert's record, made without a network: zeroconf's registration is replaced by a note of it.
    made = []
    monkeypatch.setattr(
        discovery, "_zeroconf", lambda addresses: SimpleNamespace(register_service=lambda info, **kw: made.append(info))
    )
    monkeypatch.setattr(socket, "gethostname", lambda: "studio.local")
    advert = discovery.Advert(6379, 6380, [WIFI, BRIDGE])
    (info,) = made
    assert info is advert.info and info.name == f"studio.{discovery.SERVICE}" and info.port == 6380
    assert info.parsed_addresses() == ["192.168.1.21", "169.254.10.2"]
    assert discovery._head(info) == Head("studio", ("192.168.1.21", "169.254.10.2"), 6379, 6380)


def test_the_heads_record_is_made_again_when_its_macs_addresses_change_and_taken_down_at_stop(monkeypatch):
    now = [[WIFI], [WIFI], [WIFI, BRIDGE], [WIFI, BRIDGE]]
    monkeypatch.setattr(paths, "interfaces", lambda: now.pop(0) if len(now) > 1 else now[0])

    class Record:
        def __init__(self, ray_port, paths_port, interfaces):
            self.addresses, self.closed = [i.ip for i in interfaces], False
            made.append(self)

        def close(self):
            self.closed = True

    made: list[Record] = []
    advertising = path_service.Advertising(6379, 6380, every=0.01, make=Record)
    looking = threading.Thread(target=advertising.run)
    looking.start()
    deadline = time.monotonic() + 10
    while len(made) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    advertising.stop()
    looking.join(timeout=10)
    assert not looking.is_alive()
    seen = [r.addresses for r in made]
    assert seen == [["192.168.1.21"], ["192.168.1.21", "169.254.10.2"]]  # once per change, not at every look
    assert [r.closed for r in made] == [True, True]  # the old record goodbye'd at the change, the new one at stop
