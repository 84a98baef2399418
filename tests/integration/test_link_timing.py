"""The link between the cluster's machines, as the tuner's speed stage measures it and `raytrm cluster status --link`
shows it: one Ray task per raytrm machine, joined in a gloo group, timing sums of growing buffers (on the shared local
Ray, two logical nodes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

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


def test_cluster_status_link_prints_the_rate_and_latency_of_a_sum(ray_cluster, tmp_path):
    """What a person runs to check the link between two Macs, as a driver of its own."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"HOME": str(tmp_path)}  # no token here
    argv = [sys.executable, "-m", "raytrm.cli", "cluster", "status", "--address", ray_cluster.address, "--link"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("link")]
    rate = (
        r"link between the 2 raytrm machines: ([\d.]+) Mbit/s and ([\d.]+) ms a sum "
        r"\(gloo(?: through [^)]+)?, as training sums\)"
    )
    found = re.fullmatch(rate, line)
    assert found and float(found[1]) > 8 and float(found[2]) < 1000, line
