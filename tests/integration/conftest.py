"""One Ray for every integration test of the session: two logical nodes of different tiers on this machine.

Each node advertises one raytrm machine unit and its tier's resource, as `ray start --resources` does on a real
Mac; a test that wants one tier names it in its space file (`tiers: [...]`).
"""

from __future__ import annotations

import os

import pytest

from raytrm.constants import CACHE_DIR_ENV, RESOURCE_MACHINE, tier_resource

TIER_A, TIER_B = "macbook-air-8gb", "mac-desktop-16gb"


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    # Set before the nodes start, so every worker inherits it: trials share one private dataset cache.
    os.environ[CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("cache"))
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "resources": {RESOURCE_MACHINE: 1, tier_resource(TIER_A): 1},
        },
    )
    node_b = cluster.add_node(num_cpus=1, resources={RESOURCE_MACHINE: 1, tier_resource(TIER_B): 1})
    ray.init(address=cluster.address)
    cluster.node_ids = {TIER_A: cluster.head_node.node_id, TIER_B: node_b.node_id}
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
