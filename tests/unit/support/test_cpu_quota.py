"""The rig's CPU quotas (tests/support/cpu_quota.py) without root: which cgroup hierarchy is chosen from the mounts,
what is written for a quota in each version, and the reason given when neither has the cpu controller. The quotas
on this machine's real hierarchy: tests/cluster/test_rig.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cpu_quota import CpuGroup, Hierarchy, find_hierarchy


def mounts(*lines: str) -> str:
    return "\n".join(["proc /proc proc rw,nosuid 0 0", *lines]) + "\n"


@pytest.fixture
def unified(tmp_path):
    """A cgroup2 mount point whose controllers are set by the test."""
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.subtree_control").write_text("")
    return root


def test_v2_is_chosen_where_it_has_the_cpu_controller_even_beside_a_v1_cpu_hierarchy(unified):
    (unified / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    found = find_hierarchy(mounts(f"cgroup2 {unified} cgroup2 rw 0 0", "cgroup /v1cpu cgroup rw,cpu,cpuacct 0 0"))
    assert found == Hierarchy(unified, 2)


def test_v1_is_chosen_where_the_unified_hierarchy_lacks_the_cpu_controller(unified):
    (unified / "cgroup.controllers").write_text("")
    hybrid = [f"cgroup2 {unified} cgroup2 rw 0 0", "cgroup /sys/fs/cgroup/cpuset cgroup rw,cpuset 0 0"]
    found = find_hierarchy(mounts(*hybrid, "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0"))
    assert found == Hierarchy(Path("/sys/fs/cgroup/cpu"), 1)


def test_without_either_the_reason_names_what_the_unified_hierarchy_offers(unified):
    (unified / "cgroup.controllers").write_text("memory pids\n")
    found = find_hierarchy(mounts(f"cgroup2 {unified} cgroup2 rw 0 0", "cgroup /cs cgroup rw,cpuset 0 0"))
    offers = f"({unified} offers memory pids)"
    assert found == f"no cgroup v2 with the cpu controller {offers} and no cgroup v1 cpu hierarchy"
    assert find_hierarchy(mounts()) == "no cgroup v2 mounted and no cgroup v1 cpu hierarchy"


def test_a_v2_quota_enables_cpu_for_the_children_and_writes_cpu_max_and_its_weight(unified):
    group = Hierarchy(unified, 2).group("rtn1-0-a")
    assert (unified / "cgroup.subtree_control").read_text() == "+cpu"
    group.limit(0.4)
    assert (group.path / "cpu.max").read_text() == "40000 100000" and group.cores() == 0.4
    assert (group.path / "cpu.weight").read_text() == "4000"  # in proportion to the quota, the most for a core
    assert group.procs == unified / "rtn1-0-a" / "cgroup.procs"
    group.limit(None)
    assert (group.path / "cpu.max").read_text() == "max 100000" and group.cores() is None
    assert (group.path / "cpu.weight").read_text() == "100"


def test_a_v1_quota_writes_the_period_the_quota_and_the_shares(tmp_path):
    group = Hierarchy(tmp_path, 1).group("rtn1-0-a")
    group.limit(0.8)
    assert (group.path / "cpu.cfs_quota_us").read_text() == "80000"
    assert (group.path / "cpu.cfs_period_us").read_text() == "100000" and group.cores() == 0.8
    assert (group.path / "cpu.shares").read_text() == "209715"
    group.limit(1.5)
    assert (group.path / "cpu.shares").read_text() == "262144"
    group.limit(None)
    assert (group.path / "cpu.cfs_quota_us").read_text() == "-1" and group.cores() is None


def test_a_quota_of_no_cores_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cpu quota 0: expected a positive number of cores"):
        CpuGroup(tmp_path, 1).limit(0)
