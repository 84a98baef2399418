"""The link between the cluster's machines, as the tuner's speed stage measures it: one Ray task per raytrm
machine, joined in a gloo group, timing sums of growing buffers (on the shared local Ray, two logical nodes)."""

from __future__ import annotations

import pytest

from raytrm.distributed.cluster_link import choose_for_cluster, measure_cluster_link
from raytrm.distributed.ray_train import raytrm_nodes

pytestmark = pytest.mark.slow

TIER_A, TIER_B = "macbook-air-8gb", "mac-desktop-16gb"  # the conftest's two logical nodes


def test_the_speed_stage_measures_the_link_between_the_machines(ray_cluster):
    assert len(raytrm_nodes()) == 2
    link = measure_cluster_link(1 << 20)
    assert link is not None and link.bytes_per_s > 1e6 and 0 <= link.latency_s < 1
    # Loopback between the two nodes: a small model's exact sum costs little against a second's step.
    record = choose_for_cluster(link, 200_000, 32, {TIER_A: 10.0, TIER_B: 20.0}, {TIER_A: 1, TIER_B: 1})
    assert record["mode"] == "exact" and record["step_s"] == pytest.approx(32 / 30)
    # One machine: nothing to measure.
    assert measure_cluster_link(1 << 20, raytrm_nodes()[:1]) is None
