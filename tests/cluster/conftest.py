"""Real hosts on this machine, made of Linux namespaces (tests.support.hosts), for the cluster commands' tests: a
pair joined by one link, and three hosts with CPU quotas on a LAN, two of them also joined directly.

Root only: elsewhere the tests are skipped with the reason.
"""

from __future__ import annotations

import pytest

from tests.support.hosts import HostSpec, LinkSpec, Pair, Rig, cannot_make_hosts

pytestmark = pytest.mark.cluster

#: A Mac Studio and two MacBooks on one Wi-Fi, the Studio and the first MacBook also joined by a Thunderbolt
#: bridge; quotas of this machine's cores that sum under its two, so that scaling across them is measurable here.
LAN_RATE, TB_RATE = "100mbit", "1gbit"
THREE_HOSTS = [
    HostSpec("studio", cpu=0.8, lan=LAN_RATE),
    HostSpec("mba", cpu=0.4, lan=LAN_RATE),
    HostSpec("mbp", cpu=0.4, lan=LAN_RATE),
]
THREE_LINKS = [LinkSpec("tb", "studio", "mba", rate=TB_RATE)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Hosts a and b joined by an unshaped veth pair; removed at the end with their processes, whatever happened."""
    reason = cannot_make_hosts()
    if reason:
        pytest.skip(f"two namespace hosts cannot be made here: {reason}")
    with Pair(tmp_path_factory.mktemp("hosts")) as made:
        yield made


@pytest.fixture(scope="module")
def hosts(pair):
    """The pair's hosts by name."""
    return {"a": pair.a, "b": pair.b}


@pytest.fixture(scope="module")
def three_hosts(tmp_path_factory):
    """THREE_HOSTS joined by THREE_LINKS and the LAN, one rig per test module (its tests may change rates, take paths
    down, stop or restart hosts); removed at the end with their processes, whatever happened."""
    reason = cannot_make_hosts(cpu=True)
    if reason:
        pytest.skip(f"namespace hosts with CPU quotas cannot be made here: {reason}")
    with Rig(tmp_path_factory.mktemp("rig"), THREE_HOSTS, THREE_LINKS) as made:
        yield made
