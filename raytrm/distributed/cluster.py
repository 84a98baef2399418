"""Joining Ray for raytrm's jobs: a running cluster, a cluster at an address, or a local one started here.

Both `raytrm tune` and distributed `raytrm train` connect here, so an unreachable address or a cluster without
raytrm machines is the same one line for both.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable

from raytrm.constants import RAY_ADDRESS_ENV, RESOURCE_MACHINE, TIER_RESOURCE_PREFIX, tier_resource
from raytrm.errors import UserError

logger = logging.getLogger(__name__)


def unreachable(host: str, port: int) -> str | None:
    """Why nothing answers a TCP connection at host:port within 3 s, or None when something does."""
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as e:
        return str(e.strerror or e)
    return None


def _check_reachable(address: str) -> None:
    """One clear line, before anything is started or written, if no Ray head can answer at HOST:PORT."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--address {address}: expected auto or HOST:PORT, e.g. 192.168.1.10:6379")
    why = unreachable(host, int(port))
    if why:
        raise UserError(
            f"--address {address}: cannot reach a Ray head there ({why}); start it with "
            "`raytrm cluster head` or check the address and the firewall"
        )


def connect(address: str | None, dashboard: bool = False, on_import: Callable[[], None] | None = None) -> bool:
    """Connect to Ray: the running one (tests), a cluster at address, or a local one started here. True if owned.

    Without an address, a driver that Ray started for a job (RAY_ADDRESS set) joins the job's cluster, as
    `--address auto` would; elsewhere a local Ray is started. A cluster made by `raytrm cluster` wants its token: with
    one on this Mac, token authentication is turned on. dashboard starts a local Ray with its dashboard, whose state
    API Ray Train's placement-group cleaner polls (without it, the cleaner warns every second); tuning does without
    and saves its memory. on_import is called once Ray is imported and before it is joined (a driver routes Ray's
    log lines there: raytrm.distributed.run_logs).
    """
    if not address and os.environ.get(RAY_ADDRESS_ENV):
        logger.info("%s=%s (a Ray job's driver): joining that cluster", RAY_ADDRESS_ENV, os.environ[RAY_ADDRESS_ENV])
        address = "auto"
    if address:
        from raytrm.distributed.node import use_cluster_token

        use_cluster_token()  # before Ray is imported, which reads its auth mode once
    import ray

    if on_import is not None:
        on_import()

    if address and address != "auto":
        _check_reachable(address)
    if ray.is_initialized():
        return False
    if address:
        try:
            ray.init(address=address, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise UserError(f"--address {address}: could not join the Ray cluster: {str(e).splitlines()[0]}") from None
        return True
    from raytrm.hardware.probe import detect
    from raytrm.hardware.tiers import match_tier

    tier = match_tier(detect())
    ray.init(
        # "local": a Ray of its own, even where this machine runs a cluster's node (ray.init without an address
        # would join that one, and refuse the CPUs and resources given here); --address auto joins it.
        address="local",
        num_cpus=os.cpu_count() or 1,
        include_dashboard=dashboard,
        resources={RESOURCE_MACHINE: 1, tier_resource(tier.name): 1},
    )
    logger.info("started a local Ray: one machine of tier %s", tier.name)
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
