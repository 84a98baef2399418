"""Joining Ray for raytrm's jobs: a running cluster, a cluster at an address, or a local one started here.

Both `raytrm tune` and distributed `raytrm train` connect here, so an unreachable address or a cluster without
raytrm machines is the same one line for both.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from raytrm.constants import RAY_ADDRESS_ENV, RESOURCE_MACHINE, TIER_RESOURCE_PREFIX, tier_resource
from raytrm.distributed import node as nodes
from raytrm.distributed import tokens
from raytrm.distributed.reach import check_head, unreachable
from raytrm.errors import UserError

logger = logging.getLogger(__name__)


def _check_reachable(address: str) -> None:
    """One clear line, before anything is started or written, if no Ray head can answer at HOST:PORT."""
    host, port = nodes.split_address(address, what="--address", default_port=None)
    why = unreachable(host, port)
    if why:
        raise UserError(
            f"--address {address}: cannot reach a Ray head there ({why}); start it with `raytrm cluster head`, or "
            "check the address and the head's firewall"
        )


def _auto_address() -> str | None:
    """HOST:PORT of the cluster `auto` means here ($RAY_ADDRESS, else this Mac's node's cluster), or None."""
    from raytrm.distributed.ray_internals import auto_address

    try:
        return auto_address()
    except (ConnectionError, ValueError):
        return None


def ray_node_here() -> bool:
    """Whether a Ray node (its raylet) runs on this machine: a driver needs one, or Ray waits 60 s, then fails."""
    import psutil

    return any(p.info["name"] == "raylet" for p in psutil.process_iter(["name"]))


def check_address(address: str | None, default_port: int | None = None) -> str:
    """The HOST:PORT that address (HOST:PORT, auto, or None: this Mac's cluster) means, once a Ray head answers
    there and takes this process's token (check_head) and this Mac runs a Ray node to drive it from; else one line,
    within seconds."""
    label = f"--address {address}"
    if address in (None, "auto"):
        found = _auto_address()
        if found is None:
            where = "--address auto: no Ray cluster" if address else "no raytrm cluster"
            raise UserError(
                f"{where} runs on this Mac; start one with `raytrm cluster head`, join one with `raytrm cluster "
                "join HEAD`, or give --address HEAD:PORT"
            )
        label = f"{label} ({found})" if address else f"this Mac's cluster at {found}"
        address = found
    host, port = nodes.split_address(address, what="--address", default_port=default_port)
    check_head(host, port, label)
    if not ray_node_here():
        raise UserError(
            f"{label}: this Mac runs no Ray node, and a Ray driver needs one; run this on the head or on a Mac that "
            "joined it (`raytrm cluster join HEAD`)"
        )
    return f"{host}:{port}"


def connect(address: str | None, dashboard: bool = False, on_import: Callable[[], None] | None = None) -> bool:
    """Connect to Ray: the running one (tests), a cluster at address, or a local one started here. True if owned.

    Without an address, a driver that Ray started for a job (RAY_ADDRESS set) joins the job's cluster, as
    `--address auto` would; elsewhere a local Ray is started. A cluster made by `raytrm cluster` wants its token: with
    one on this Mac, token authentication is turned on. A local Ray finds its token made 0600 before it starts
    (else Ray writes one that every user can read). dashboard starts a local Ray with its dashboard, whose state
    API Ray Train's placement-group cleaner polls (without it, the cleaner warns every second); tuning does without
    and saves its memory. on_import is called once Ray is imported and before it is joined (a driver routes Ray's
    log lines there: raytrm.distributed.run_logs).
    """
    if address is None and os.environ.get(RAY_ADDRESS_ENV):
        logger.info("%s=%s (a Ray job's driver): joining that cluster", RAY_ADDRESS_ENV, os.environ[RAY_ADDRESS_ENV])
        address = "auto"
    if address is not None:  # "" too: refused below as an address without a host, not taken for none
        tokens.use_cluster_token()  # before Ray is imported, which reads its auth mode once
    import ray

    if on_import is not None:
        on_import()
    if ray.is_initialized():
        if address is not None and address != "auto":
            _check_reachable(address)
        return False
    if address is not None:
        check_address(address)
        try:
            ray.init(address=address, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise UserError(f"--address {address}: could not join the Ray cluster: {str(e).splitlines()[0]}") from None
        return True
    from raytrm.hardware.probe import detect
    from raytrm.hardware.tiers import match_tier

    tier = match_tier(detect())
    token = tokens.ensure_local_token()
    ray.init(
        # "local": a Ray of its own, even where this machine runs a cluster's node (ray.init without an address
        # would join that one, and refuse the CPUs and resources given here); --address auto joins it.
        address="local",
        num_cpus=os.cpu_count() or 1,
        include_dashboard=dashboard,
        resources={RESOURCE_MACHINE: 1, tier_resource(tier.name): 1},
    )
    logger.info("started a local Ray: one machine of tier %s%s", tier.name, f", token {token} (0600)" if token else "")
    return True


def alive_tiers() -> dict[str, int]:
    """Tier name -> number of alive machines advertising it (and one raytrm machine unit); may be empty."""
    import ray

    tiers: dict[str, int] = {}
    for node in ray.nodes():
        res = node.get("Resources", {}) if node.get("Alive") else {}
        if res.get(RESOURCE_MACHINE):
            for key in res:
                if key.startswith(TIER_RESOURCE_PREFIX):
                    name = key[len(TIER_RESOURCE_PREFIX) :]
                    tiers[name] = tiers.get(name, 0) + 1
    return tiers


def cluster_tiers() -> dict[str, int]:
    """Tier name -> number of alive machines advertising it; a cluster without raytrm machines is one line."""
    tiers = alive_tiers()
    if not tiers:
        raise UserError(
            "the Ray cluster has no raytrm machine: start its nodes with `raytrm cluster head` and `raytrm cluster "
            f"""join` (or `ray start ... --resources='{{"{RESOURCE_MACHINE}": 1, "{TIER_RESOURCE_PREFIX}TIER": 1}}'`)"""
        )
    return tiers
