"""The paths between two Macs: the choice and the table from made-up measurements, the gradient sync's network for a
run (two Macs, three with mixed links), and the path service's protocol on loopback addresses (all on lo: right for
the protocol, not for rates). No Ray; nothing sent off loopback."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest

from raytrm.distributed import cluster_commands, path_client, paths
from raytrm.distributed.gloo_path import NodeNet, describe, newcomer, plan
from raytrm.distributed.path_service import Service
from raytrm.distributed.paths import Interface, Measured
from raytrm.errors import UserError
from tests.unit.distributed.servers import closed_port, listening

TOKEN = "ab" * 32

TB = Measured("10.0.0.1", "bridge0", "10.0.0.2", "bridge0", mbit_s=9000.0, latency_ms=0.4)
ETHERNET = Measured("192.168.1.10", "en0", "192.168.1.11", "en0", mbit_s=940.0, latency_ms=0.6)
WIFI = Measured("192.168.1.20", "en1", "192.168.1.21", "en1", mbit_s=870.0, latency_ms=6.0)
GONE = Measured("169.254.3.4", "bridge1", None, None, problem="no answer within 1.5 s")


def test_the_fastest_rate_wins_whatever_the_order():
    for order in ([WIFI, ETHERNET, TB, GONE], [TB, GONE, WIFI, ETHERNET], [GONE, ETHERNET, WIFI, TB]):
        assert paths.choose(order) == TB


def test_rates_near_the_best_are_a_tie_that_the_lower_latency_breaks():
    # Wi-Fi measured a little faster than Ethernet in a short transfer: within NEAR_TIE, Ethernet's latency wins.
    lucky_wifi = Measured("192.168.1.20", "en1", "192.168.1.21", "en1", mbit_s=990.0, latency_ms=6.0)
    assert paths.choose([lucky_wifi, ETHERNET]) == ETHERNET
    # Far enough ahead, the rate wins over the latency.
    fast_wifi = Measured("192.168.1.20", "en1", "192.168.1.21", "en1", mbit_s=940.0 / paths.NEAR_TIE + 1, latency_ms=6)
    assert paths.choose([fast_wifi, ETHERNET]) == fast_wifi


def test_no_measured_path_is_no_choice():
    assert paths.choose([]) is None
    assert paths.choose([GONE]) is None


def test_the_table_names_each_path_its_rate_latency_and_the_one_chosen():
    assert paths.table([TB, WIFI, GONE], TB).splitlines() == [
        "  path                                             rate     latency",
        "  bridge0 10.0.0.2 -> 10.0.0.1 (bridge0)    9.00 Gbit/s     0.40 ms  chosen",
        "  en1 192.168.1.21 -> 192.168.1.20 (en1)   870.0 Mbit/s     6.00 ms",
        "  ? (no route) -> 169.254.3.4 (bridge1)   no answer within 1.5 s",
    ]


# -- the gradient sync's network for a run -------------------------------------------------------------------------

LAN = {name: Interface("en0", f"192.168.1.{k}", 24) for k, name in enumerate(("studio", "mba", "mbp"), start=10)}
BRIDGE = {"studio": Interface("bridge0", "10.0.0.1", 24), "mba": Interface("bridge0", "10.0.0.2", 24)}


def node(name: str, path: str | None = None, bridged: bool = True) -> NodeNet:
    found = (LAN[name], BRIDGE[name]) if bridged and name in BRIDGE else (LAN[name],)
    return NodeNet(name, LAN[name].ip, found, path)


def test_two_macs_sync_over_the_path_join_chose():
    studio, mba = node("studio"), node("mba", path="10.0.0.2")
    assert plan([studio, mba]) == {"studio": BRIDGE["studio"], "mba": BRIDGE["mba"]}
    assert plan([mba, studio]) == plan([studio, mba])
    assert describe(plan([studio, mba]), [studio, mba]) == (
        "the gradient sync binds 192.168.1.10: bridge0 10.0.0.1, 192.168.1.11: bridge0 10.0.0.2"
    )
    # The LAN chosen (the bridge measured slower): the LAN it is.
    assert plan([studio, node("mba", path="192.168.1.11")]) == {"studio": LAN["studio"], "mba": LAN["mba"]}


def test_three_macs_with_mixed_links_sync_over_the_network_all_three_share():
    studio, mba, mbp = node("studio"), node("mba", path="10.0.0.2"), node("mbp", path="192.168.1.12")
    assert plan([studio, mba, mbp]) == {"studio": LAN["studio"], "mba": LAN["mba"], "mbp": LAN["mbp"]}
    # A run on the two bridged Macs alone takes the bridge.
    assert plan([studio, mba])["mba"] == BRIDGE["mba"]  # type: ignore[index]


def test_of_two_addresses_on_one_network_the_ends_join_measured_are_bound():
    # A MacBook head whose Wi-Fi (en0) and USB Ethernet (en7) are both on the LAN; join measured the Ethernet.
    wifi, ethernet = Interface("en0", "192.168.1.20", 24), Interface("en7", "192.168.1.10", 24)
    studio = NodeNet("studio", wifi.ip, (wifi, ethernet))
    mba = NodeNet("mba", "192.168.1.11", (LAN["mba"],), path="192.168.1.11", path_head=ethernet.ip)
    assert plan([studio, mba]) == {"studio": ethernet, "mba": LAN["mba"]}
    assert plan([studio, NodeNet("mba", "192.168.1.11", (LAN["mba"],))])["studio"] == wifi  # type: ignore[index]


def test_a_mac_entering_a_running_run_binds_the_network_the_run_binds():
    bridged = plan([node("studio"), node("mba", path="10.0.0.2")])
    # The MacBook back with a new node (a new `cluster join`): the bridge again, by its path's end.
    back = NodeNet("mba-again", LAN["mba"].ip, (LAN["mba"], BRIDGE["mba"]), "10.0.0.2")
    assert newcomer(bridged, back) == BRIDGE["mba"]
    assert newcomer(bridged, node("studio")) == BRIDGE["studio"]  # a node of the plan keeps its interface
    # A Mac on the LAN alone cannot reach the bridge: nothing to bind (it keeps its Ray address's interface).
    assert newcomer(bridged, node("mbp")) is None
    over_lan = plan([node("studio"), node("mba", path="192.168.1.11")])
    assert newcomer(over_lan, node("mbp")) == LAN["mbp"]
    assert newcomer(None, node("mbp")) is None


def test_one_node_or_no_shared_network_keeps_each_nodes_own_interface():
    studio = node("studio")
    assert plan([studio]) is None
    assert plan([studio, studio]) is None  # two workers of one node
    stranger = NodeNet("far", "172.16.0.5", (Interface("en0", "172.16.0.5", 24),), None)
    assert plan([studio, stranger]) is None
    assert describe(None, [studio, stranger]).startswith("the gradient sync binds each node's Ray address's")


# -- the path service on loopback ----------------------------------------------------------------------------------

SERVED = [Interface("lo", "127.0.0.2", 8), Interface("lo", "127.0.0.3", 8)]


@contextlib.contextmanager
def service(host: str = "127.0.0.2") -> Iterator[int]:
    """A path service on host only, on a port the kernel picks, listing SERVED."""
    server = Service(0, TOKEN, lambda: list(SERVED), host=host)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_the_service_lists_the_heads_addresses_to_the_token_and_measures_what_answers():
    with service() as port:
        conn = path_client.open_service("127.0.0.2", port, TOKEN)
        assert path_client.ask_addresses(conn) == SERVED
        conn.close()
        # 127.0.0.3 is on lo too, but the service listens on 127.0.0.2 alone: refused, as a path that is down.
        found = path_client.measure_paths(SERVED, port, TOKEN, sink_s=0.05, local_interface={"127.0.0.1": "lo"})
    up, down = found
    assert up.usable and up.remote == "127.0.0.2" and up.local == "127.0.0.1" and up.interface == "lo"
    assert up.mbit_s > 1 and 0 < up.latency_ms < 1000  # type: ignore[operator]
    assert not down.usable and down.problem == "Connection refused"
    assert paths.choose(found) == up


def test_a_client_without_the_token_is_refused_and_learns_nothing():
    with service() as port, pytest.raises(paths.PathProblem) as refused:
        path_client.open_service("127.0.0.2", port, "cd" * 32)
    assert refused.value.kind == "refused"


def test_join_without_a_path_service_or_with_something_else_there_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "CONNECT_S", 0.2)
    token = tmp_path / "auth_token"
    with closed_port() as port, pytest.raises(UserError) as older:
        path_client.find_paths("127.0.0.1", port, TOKEN, token)
    assert str(older.value).startswith(
        f"127.0.0.1:{port}: no path service listens there (Connection refused): the head runs an older raytrm, or "
        "its path service listens on another port; restart the head with this raytrm"
    )
    for kind, why in (("close", "it closed the connection before a greeting"), ("grpc", "no greeting within 0.2 s")):
        with listening(kind) as port, pytest.raises(UserError) as other:
            path_client.find_paths("127.0.0.1", port, TOKEN, token)
        assert str(other.value).startswith(
            f"127.0.0.1:{port}: something answers there, but not as raytrm's path service ({why}"
        ), other.value
    with service() as port, pytest.raises(UserError) as wrong:
        path_client.find_paths("127.0.0.2", port, "cd" * 32, token)
    assert str(wrong.value) == (
        f"the path service at 127.0.0.2:{port} refused the cluster token at {token}: it is not the head's; copy the "
        "head's"
    )


def test_the_path_service_port_is_rays_plus_one_unless_given_and_never_rays_own():
    assert path_client.service_port(6379, None) == 6380 and path_client.service_port(7000, 7100) == 7100
    for port, given in ((6379, 6379), (6379, 8265)):
        with pytest.raises(UserError, match=rf"^--paths-port {given}: Ray's own port; give another"):
            path_client.service_port(port, given)


def test_status_names_the_path_a_node_joined_by_where_it_is_not_its_ray_address():
    row = {"alive": True, "head": False, "tier": "macbook-air-8gb", "cpus": 8, "memory_gb": 8.0, "budget_mb": 5632}
    row |= {"busy": False, "versions": {"raytrm": "0.1.0"}}
    report = {"nodes": [row | {"address": "192.168.1.11", "path": "10.0.0.2"}], "jobs": []}
    assert cluster_commands.format_status(report).splitlines()[1].endswith("free  (joined by the path of 10.0.0.2)")
    report = {"nodes": [row | {"address": "192.168.1.11", "path": "192.168.1.11"}], "jobs": []}
    assert cluster_commands.format_status(report).splitlines()[1].endswith("free")


def test_join_and_paths_say_which_path_the_sync_takes(capsys):
    from raytrm.cli import _print_paths

    _print_paths({"head": "10.0.0.1:6379", "paths": [TB, WIFI], "chosen": TB})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "paths to the head 10.0.0.1, measured from this Mac:" and out[2].endswith("chosen")
    assert out[-1] == "the gradient sync takes the fastest: bridge0 10.0.0.2"
    _print_paths({"head": "10.0.0.1:6379", "paths": [TB, WIFI], "chosen": TB}, joined=False)
    assert capsys.readouterr().out.splitlines()[-1] == (
        "the fastest: bridge0 10.0.0.2 (`raytrm cluster join` takes it for the gradient sync)"
    )
    _print_paths({"head": "10.0.0.1:6379", "paths": [TB, WIFI], "chosen": None, "path": "192.168.1.21"})
    out = capsys.readouterr().out.splitlines()
    assert not any(line.endswith("chosen") for line in out)
    assert out[-1] == "the gradient sync takes the path of --node-ip 192.168.1.21, as given"


def test_paths_with_no_address_measures_the_head_found_by_mdns_or_names_the_static_form(tmp_path, monkeypatch, capsys):
    from raytrm.cli import main
    from raytrm.distributed import discovery

    token = tmp_path / "auth_token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    with service() as port:
        studio = discovery.Head("studio", ("127.0.0.2",), 6379, port)
        monkeypatch.setattr(discovery, "browse", lambda seconds, mine: [studio])
        assert main(["cluster", "paths", "--token-file", str(token)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        "found the head studio at 127.0.0.2:6379 by mDNS",
        "paths to the head 127.0.0.2, measured from this Mac:",
    ]
    assert out[-1].startswith("the fastest: ") and " 127.0.0.1 " in out[-1]
    monkeypatch.setattr(discovery, "browse", lambda seconds, mine: [])
    assert main(["cluster", "paths", "--token-file", str(token)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("raytrm cluster paths HEAD[:PORT]"), err
