"""`raytrm cluster status --link` without a cluster: its line, with two machines or one, and a probe that gets no
answer, refused in one line that says what to fix."""

from __future__ import annotations

import pytest

from raytrm.distributed import cluster_commands
from raytrm.distributed import cluster_link as link
from raytrm.distributed.ray_train import Node
from raytrm.errors import UserError

TWO = [Node("a", "192.168.1.10", "mac-desktop-16gb", 10), Node("b", "192.168.1.11", "macbook-air-8gb", 8)]


def test_the_line_gives_the_rate_and_the_latency_of_a_sum():
    found = {"machines": 2, "mbit_s": 940.0, "latency_ms": 0.35}
    assert link.describe_link_status(found) == (
        "link between the 2 raytrm machines: 940 Mbit/s and 0.35 ms a sum (gloo, as training sums)"
    )
    slow = link.describe_link_status({"machines": 3, "mbit_s": 22.5, "latency_ms": 4.0})
    assert slow == "link between the 3 raytrm machines: 22.5 Mbit/s and 4.00 ms a sum (gloo, as training sums)"
    bound = {"machines": 2, "mbit_s": 940.0, "latency_ms": 0.35, "interfaces": {"10.0.0.2": "en0", "10.0.0.1": "en1"}}
    assert link.describe_link_status(bound).endswith("(gloo through 10.0.0.1 en1, 10.0.0.2 en0, as training sums)")


def test_one_machine_has_no_link_to_measure(monkeypatch):
    monkeypatch.setattr(link, "raytrm_nodes", lambda: TWO[:1])
    found = link.link_status()
    assert found == {"machines": 1}
    assert link.describe_link_status(found) == "link: 1 raytrm machine(s), nothing to measure (a sum needs two)"


def test_the_status_table_carries_the_link_line_after_the_nodes():
    node = {"address": "192.168.1.10", "alive": True, "head": True, "tier": "mac-desktop-16gb", "cpus": 10}
    node |= {"memory_gb": 32.0, "budget_mb": 24000, "busy": False, "versions": {"raytrm": "0.1.0"}}
    report = {"nodes": [node], "jobs": [], "link": {"machines": 2, "mbit_s": 940.0, "latency_ms": 0.35}}
    lines = cluster_commands.format_status(report).splitlines()
    assert lines[-2].startswith("link between the 2 raytrm machines: 940 Mbit/s")
    assert lines[-1] == "jobs: none submitted"
    del report["link"]
    assert not any(line.startswith("link") for line in cluster_commands.format_status(report).splitlines())


def test_a_probe_without_an_answer_is_one_line_with_the_fix(monkeypatch):
    from ray.exceptions import GetTimeoutError

    def silent(nbytes, nodes, timeout_s, interfaces=None):
        raise GetTimeoutError(f"Get timed out: some object(s) not ready after {timeout_s} s")

    monkeypatch.setattr(link, "raytrm_nodes", lambda: TWO)
    monkeypatch.setattr(link, "measure_cluster_link", silent)
    with pytest.raises(UserError) as e:
        link.link_status(timeout_s=5)
    assert str(e.value) == (
        "the link probe between the 2 raytrm machines got no answer in 5 s: each Mac must accept connections from the "
        "others on any port (the firewall: cluster/README.md); allow them and run `raytrm cluster status --link` again"
    )
