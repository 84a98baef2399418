"""The link between a cluster's machines, measured for the tuner: one Ray task per raytrm machine, joined in a gloo
group, times sums of growing buffers, the probe a run takes at its start (raytrm.sync.link.measure_link).

`choose_for_cluster` then picks the sync mode and round length that keep the wait under 5% of a step, from that
link, the model's gradient bytes and the cluster's step: every machine at its tier's measured samples/s, the global
batch shared so that they finish together, is B / (sum of the machines' samples/s). `link_status` is the same probe
for a person: `raytrm cluster status --link`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from raytrm import config as cfg
from raytrm.distributed.gloo_path import nodes_net, plan
from raytrm.distributed.paths import Interface
from raytrm.distributed.ray_train import Node, raytrm_nodes
from raytrm.errors import UserError
from raytrm.sync.link import TARGET_SHARE, Link, choose, fewest_steps, measure_link

logger = logging.getLogger(__name__)

#: The largest sum `raytrm cluster status --link` times: a large model's gradient (the probe stops at a 1 s sum).
STATUS_PROBE_BYTES = 1 << 26
#: How long it waits for the probe: machines that cannot open a connection to each other never answer.
STATUS_PROBE_TIMEOUT_S = 120.0


def model_bytes(experiment: dict[str, Any]) -> int:
    """Bytes of the gradient the experiment's model sums each step (its trainable parameters)."""
    from raytrm.train.trainer import Trainer

    trainer = Trainer(cfg.from_dict(cfg.ExperimentConfig, experiment, "<link probe>"))
    try:
        return sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    finally:
        trainer.close()


def probe(
    rank: int, world_size: int, address: str, port: int, nbytes: int, interface: str | None = None
) -> dict[str, Any]:
    """One machine's part: join the group at address:port (gloo bound to interface, where given), time the sums,
    leave; returns the fitted link and the interface the sums went through."""
    import os

    import torch.distributed as dist

    from raytrm.constants import GLOO_IFNAME_ENV
    from raytrm.distributed.gloo_path import bind
    from raytrm.hardware import device as devices
    from raytrm.sync.process_group import ProcessGroupSync

    cpu = torch.device(devices.CPU)
    previous = bind(interface)  # a task's process serves later tasks: its environment is put back below
    try:
        used = os.environ.get(GLOO_IFNAME_ENV)
        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size)
        try:
            link, seconds = measure_link(ProcessGroupSync(cpu), cpu, nbytes, budget_s=1.0)
        finally:
            dist.destroy_process_group()
    finally:
        if previous is None:
            os.environ.pop(GLOO_IFNAME_ENV, None)
        else:
            os.environ[GLOO_IFNAME_ENV] = previous
    return {"latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s, "probe_s": seconds, "interface": used}


def measure_cluster_link(
    nbytes: int,
    nodes: Sequence[Node] | None = None,
    timeout_s: float | None = None,
    interfaces: list[str | None] | None = None,
) -> Link | None:
    """The link between the cluster's raytrm machines (Ray connected), through the interfaces a run's gradient sync
    binds (gloo_path); None with fewer than two. timeout_s: Ray's GetTimeoutError past it (default: wait).
    interfaces: filled with each machine's interface, where given."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raytrm.distributed.launch import free_port

    nodes = list(nodes if nodes is not None else raytrm_nodes())
    if len(nodes) < 2:
        return None

    def on(node: Node, fn: Any) -> Any:
        strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        return ray.remote(num_cpus=0)(fn).options(scheduling_strategy=strategy)

    port = ray.get(on(nodes[0], free_port).remote(), timeout=timeout_s)
    found_nets = nodes_net([n.node_id for n in nodes], timeout_s)
    chosen = plan(found_nets) or {}
    address, count = nodes[0].address, len(nodes)
    probes = [
        on(node, probe).remote(rank, count, address, port, nbytes, _name(chosen.get(net.node_id)))
        for rank, (node, net) in enumerate(zip(nodes, found_nets, strict=True))
    ]
    results = ray.get(probes, timeout=timeout_s)
    found = results[0]
    logger.info("the link between %d machines, probed in %.1f s", len(nodes), found["probe_s"])
    if interfaces is not None:
        interfaces.extend(r["interface"] for r in results)
    return Link(found["latency_s"], found["bytes_per_s"])


def _name(interface: Interface | None) -> str | None:
    return None if interface is None else interface.name


def link_status(nbytes: int = STATUS_PROBE_BYTES, timeout_s: float = STATUS_PROBE_TIMEOUT_S) -> dict[str, Any]:
    """The rate and latency of a sum between the cluster's raytrm machines (Ray connected), as `raytrm cluster status
    --link` shows them: {machines, mbit_s, latency_ms}, the last two only where there are two machines or more."""
    from ray.exceptions import GetTimeoutError

    nodes = raytrm_nodes()
    used: list[str | None] = []
    try:
        found = measure_cluster_link(nbytes, nodes, timeout_s, used)
    except GetTimeoutError:
        raise UserError(
            f"the link probe between the {len(nodes)} raytrm machines got no answer in {timeout_s:.0f} s: each Mac "
            "must accept connections from the others on any port (the firewall: cluster/README.md); allow them and "
            "run `raytrm cluster status --link` again"
        ) from None
    named = {n.address: i for n, i in zip(nodes, used, strict=False) if i}
    return {"machines": len(nodes), **(found.to_dict() if found else {}), **({"interfaces": named} if named else {})}


def describe_link_status(found: dict[str, Any]) -> str:
    """link_status as the line `raytrm cluster status --link` prints."""
    if "mbit_s" not in found:
        return f"link: {found['machines']} raytrm machine(s), nothing to measure (a sum needs two)"
    link = Link(found["latency_ms"] / 1e3, found["mbit_s"] * 1e6 / 8)
    through = ", ".join(f"{address} {name}" for address, name in sorted(found.get("interfaces", {}).items()))
    where = f"gloo through {through}" if through else "gloo"
    return f"link between the {found['machines']} raytrm machines: {link.describe()} ({where}, as training sums)"


def choose_for_cluster(
    link: Link, nbytes: int, global_batch: int, rates: dict[str, float], machines: dict[str, int]
) -> dict[str, Any]:
    """The sync choice for a cluster of `machines` (tier -> count) whose tiers train at `rates` samples/s, as the
    record a profile keeps (measured.sync): the link, the step, the choice, and the fewest steps a local round needs
    with the chosen overlap (the lower bound of H where a search tries it)."""
    speed = sum(rates[t] * n for t, n in machines.items() if t in rates)
    step_s = global_batch / speed if speed > 0 else 0.0
    choice = choose(link, step_s, nbytes)
    return {
        **link.to_dict(),
        "step_s": step_s,
        "model_mb": nbytes / 1e6,
        "machines": dict(machines),
        "mode": choice.mode,
        "every": choice.every,
        "overlap": choice.overlap,
        "predicted_share": choice.share,
        "fewest_every": fewest_steps(link, step_s, nbytes, choice.overlap, TARGET_SHARE) if step_s > 0 else None,
        "reason": choice.reason,
    }
