"""What a raytrm worker is, on whichever launcher runs it (Ray Train's group, raytrm.distributed.ray_train, or the
elastic run's actors, raytrm.distributed.elastic_run): the cluster's raytrm machines, the tier of the node a worker
runs on, and the experiment with that worker's machine settings."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from raytrm import config as cfg
from raytrm.constants import RESOURCE_MACHINE, TIER_RESOURCE_PREFIX

#: The machine settings each worker takes from its own tier (the accumulation follows from the micro-batch it takes).
MACHINE_FIELDS = tuple(name for name in cfg.MACHINE_SETTINGS if name != "grad_accum_steps")


@dataclasses.dataclass
class Node:
    """One alive Ray node that can take a raytrm worker."""

    node_id: str
    address: str
    tier: str | None
    cpus: float


def raytrm_nodes() -> list[Node]:
    """Alive nodes, raytrm machines first (those advertising the machine unit), each with its tier."""
    import ray

    nodes = []
    for info in ray.nodes():
        if not info.get("Alive"):
            continue
        res = info.get("Resources", {})
        tiers = [k[len(TIER_RESOURCE_PREFIX) :] for k in res if k.startswith(TIER_RESOURCE_PREFIX)]
        if res.get(RESOURCE_MACHINE):
            nodes.append(Node(info["NodeID"], info["NodeManagerAddress"], tiers[0] if tiers else None, res["CPU"]))
    return nodes


def node_tier() -> str:
    """The tier of the node this worker runs on: its Ray resource, else this machine's own tier."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    for node in raytrm_nodes():
        if node.node_id == me and node.tier:
            return node.tier
    from raytrm.hardware.probe import detect
    from raytrm.hardware.tiers import match_tier

    return match_tier(detect()).name


def worker_config(job: dict, tier: str) -> cfg.ExperimentConfig:
    """The experiment with this worker's machine settings: its tier's profile (over everything but flags), else
    its own tier's defaults where the experiment leaves a setting unset."""
    from raytrm.train.run.experiment import fill_from_tier

    config: cfg.ExperimentConfig = job["config"]
    training = cfg.to_dict(config.training)
    profile = job["machines"].get(tier)
    if profile:
        training.update({k: v for k, v in profile.items() if k not in job["explicit"] and v is not None})
    else:
        from raytrm.hardware.probe import detect
        from raytrm.hardware.tiers import match_tier
        from raytrm.train.run.experiment import tier_settings

        own = match_tier(detect())
        settings = tier_settings(own)
        share = job["workers_per_machine"]
        if share > 1:  # workers that share one machine share its cores and its memory
            settings["threads"] = max(1, own.threads // share)
            settings["memory_budget_mb"] = max(64, own.memory_budget_mb // share)
        fill_from_tier(training, settings)
    changes = {k: training[k] for k in MACHINE_FIELDS if training[k] != getattr(config.training, k)}
    return dataclasses.replace(config, training=dataclasses.replace(config.training, **changes))


def first_shares(sync: Any, job: dict, tier: str, global_batch: int) -> list[int]:
    """The run's first split of the global batch over its workers (a collective of the run's group): by the measured
    samples/s of each worker's tier in the run's profiles, evenly where a worker's tier has none. The peers' balancer
    refines it from the first round's end."""
    from raytrm.sync.shares import split

    speeds = [row[0] for row in sync.gather_floats([job["weights"].get(tier, 0.0)])]
    return split(global_batch, speeds if all(s > 0 for s in speeds) else [1.0] * len(speeds))


def without_machine_settings(config: cfg.ExperimentConfig, keep: Sequence[str] = ()) -> cfg.ExperimentConfig:
    """The experiment with its machine settings (but those in keep) unset, for workers to fill from their tiers."""
    defaults = cfg.TrainConfig()
    unset = {k: getattr(defaults, k) for k in MACHINE_FIELDS if k not in keep}
    return dataclasses.replace(config, training=dataclasses.replace(config.training, grad_accum_steps=1, **unset))
