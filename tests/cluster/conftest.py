"""Two real hosts on this machine, made of Linux namespaces (tests.support.hosts), for the cluster commands' tests.

Root only: elsewhere the tests are skipped with the reason.
"""

from __future__ import annotations

import pytest

from tests.support.hosts import Pair, cannot_make_hosts

pytestmark = pytest.mark.cluster


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
