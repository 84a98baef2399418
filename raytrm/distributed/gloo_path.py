"""The interface gloo binds on each node of a run: the network every node of the run shares, the fastest path
`raytrm cluster join` measured where the run's nodes share it.

Ray's own traffic goes through each node's Ray address, which every Mac of the cluster reaches; the gradient sync,
the bulk of a run's traffic, goes where this plan says. gloo binds one interface per process and every rank dials
every other at the address it binds, so the run needs one network that all its nodes are on: with two Macs, the
path `join` chose (a Thunderbolt bridge); with a third Mac on the LAN alone, the LAN. A node that joined records the
ends of the path it chose as its `raytrm/path` (its own address) and `raytrm/path-head` labels; the head has none.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raytrm.constants import GLOO_IFNAME_ENV
from raytrm.distributed.node import PATH_HEAD_LABEL, PATH_LABEL
from raytrm.distributed.paths import Interface

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeNet:
    """What the plan knows of one node: its Ray address, its interfaces, and the ends of the path it joined by (its
    own address there and the head's)."""

    node_id: str
    node_ip: str
    interfaces: tuple[Interface, ...]
    path: str | None = None
    path_head: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeNet:
        found = tuple(Interface.from_dict(i) for i in d["interfaces"])
        return cls(str(d["node_id"]), str(d["node_ip"]), found, d.get("path") or None, d.get("path_head") or None)


def _inside(ip: str | None, net: ipaddress.IPv4Network) -> bool:
    try:
        return ip is not None and ipaddress.IPv4Address(ip) in net
    except ValueError:
        return False


def plan(nodes: Sequence[NodeNet]) -> dict[str, Interface] | None:
    """Each node's interface for gloo (by node id), all on one network that every node is on: the one holding the
    most nodes' chosen paths, then the most Ray addresses. None for a run on one node, or where no network is shared
    (each node then keeps the interface of its Ray address)."""
    unique = list({n.node_id: n for n in nodes}.values())
    if len(unique) < 2:
        return None
    networks = sorted({i.network for i in unique[0].interfaces}, key=str)
    shared = [net for net in networks if all(any(_inside(i.ip, net) for i in n.interfaces) for n in unique)]
    if not shared:
        return None

    def score(net: ipaddress.IPv4Network) -> tuple[int, int]:
        return sum(_inside(n.path, net) for n in unique), sum(_inside(n.node_ip, net) for n in unique)

    best = max(shared, key=score)  # the first of equals, in a stable order
    # A Mac may hold two addresses on one network (Wi-Fi and Ethernet on one LAN): the ends join measured come first.
    ends = {a for n in unique for a in (n.path, n.path_head) if a}
    picked = {n.node_id: _pick(n, best, ends) for n in unique}  # every node is on the shared network
    return {node_id: i for node_id, i in picked.items() if i is not None}


def _pick(node: NodeNet, network: ipaddress.IPv4Network, ends: set[str]) -> Interface | None:
    inside = [i for i in node.interfaces if _inside(i.ip, network)]
    return next((i for i in inside if i.ip in ends), inside[0] if inside else None)


def newcomer(plan_: dict[str, Interface] | None, node: NodeNet) -> Interface | None:
    """The interface of a node that enters a running run: the one on the network the run's plan binds (the end of the
    path it joined by first), None where the run binds no plan or the node is not on that network."""
    if not plan_:
        return None
    if node.node_id in plan_:
        return plan_[node.node_id]
    first = next(iter(plan_.values()))
    ends = {a for a in (node.path, node.path_head) if a} | {i.ip for i in plan_.values()}
    return _pick(node, first.network, ends)


def describe(plan_: dict[str, Interface] | None, nodes: Sequence[NodeNet]) -> str:
    """The plan as a line for the logs."""
    if plan_ is None:
        return "the gradient sync binds each node's Ray address's interface (the run's nodes share no other network)"
    named = ", ".join(
        f"{n.node_ip}: {plan_[n.node_id].name} {plan_[n.node_id].ip}" for n in nodes if n.node_id in plan_
    )
    return f"the gradient sync binds {named}"


# -- on Ray's workers ---------------------------------------------------------------------------------------------


def node_here() -> dict[str, Any]:
    """This worker's node, as NodeNet.from_dict reads it (run on a Ray worker)."""
    import ray

    from raytrm.distributed.paths import interfaces

    context = ray.get_runtime_context()
    labels = context.get_node_labels()

    def label(key: str) -> str | None:
        value = labels.get(key)
        return (value[0] if value else None) if isinstance(value, list) else value

    return {
        "node_id": context.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "interfaces": [vars(i) for i in interfaces()],
        "path": label(PATH_LABEL),
        "path_head": label(PATH_HEAD_LABEL),
    }


def nodes_net(node_ids: Sequence[str], timeout_s: float | None = None) -> list[NodeNet]:
    """What the plan knows of each node (by Ray node id), from a task on each (Ray connected)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(node_here)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(i, soft=False)).remote() for i in node_ids]
    return [NodeNet.from_dict(d) for d in ray.get(refs, timeout=timeout_s)]


def bind(name: str | None) -> str | None:
    """Bind this process's next gloo group to interface name (None: leave it as it is); returns what was set."""
    previous = os.environ.get(GLOO_IFNAME_ENV)
    if name is not None:
        os.environ[GLOO_IFNAME_ENV] = name
    return previous


def before_group(worker_group: Any) -> None:
    """Ray Train's hook before its workers' process group starts: each worker bound to the plan's interface."""
    found = [NodeNet.from_dict(d) for d in worker_group.execute(node_here)]
    chosen = plan(found)
    logger.info(describe(chosen, found))
    if chosen is not None:
        for rank, node in enumerate(found):
            worker_group.execute_single(rank, bind, chosen[node.node_id].name)


def torch_config(backend: str) -> Any:
    """Ray Train's TorchConfig for backend, its workers bound by the plan before their group starts."""
    from raytrm.distributed.ray_internals import torch_config_with_setup

    return torch_config_with_setup(backend, before_group)
