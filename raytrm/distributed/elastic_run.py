"""`raytrm train --elastic`: the workers as Ray actors of the driver's own, so a Mac that leaves costs the others a
deadline and a Mac that comes (back) enters at a round boundary, with no restart of the group.

Ray Train's worker group restarts every worker from the last checkpoint when one is lost, and keeps a returning
machine out until then. Here the driver instead:

- serves the run's membership store (a `torch.distributed.TCPStore` on the head: no worker hosts what the others
  need) and starts one actor per Mac (`--workers N` on one machine), named in rank order, the head's first, its gloo
  bound to the network of the fastest paths (raytrm.distributed.gloo_path; a Mac that comes later, to the same);
- waits on the actors' runs: one that fails or whose Mac leaves is logged and left to the membership (the others
  regroup within its deadline, raytrm.train.elastic);
- every few seconds looks for raytrm machines with no worker (a Mac that joined the cluster, or came back with a new
  `raytrm cluster join`) and starts one there, which asks to join and is admitted at the next boundary with a live
  peer's state; a Mac whose worker left gets none for LEFT_HOLD_S, since Ray lists a Mac killed or asleep until its
  health checks give it up, and a worker started there would die without entering (a Mac that comes back joins the
  cluster as a new node);
- ends when the first worker (the head's, which writes the run directory) returns its summary.

Each worker trains as a Ray Train worker would (raytrm.distributed.ray_train's machine settings per tier, the first
split of the batch by the profiles' measured speeds, the run directory written by rank 0), through `run_training`
with its `Elastic`.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raytrm.constants import DEFAULT_LOG_LEVEL, GLOO_IFNAME_ENV, LOG_LEVEL_ENV, RESOURCE_MACHINE
from raytrm.distributed import gloo_path
from raytrm.errors import UserError

logger = logging.getLogger(__name__)

#: Seconds between the driver's looks for machines with no worker.
NODE_POLL_S = 5.0
#: Seconds a Mac whose worker left gets no new one while Ray still lists it (Ray's health checks give a silent node up
#: within tens of seconds; a Mac whose worker failed while the Mac stayed gets a new one after this).
LEFT_HOLD_S = 60.0
#: A collective's deadline before the run has measured its link and its steps (the next membership takes the
#: measured one: raytrm.train.elastic).
FIRST_DEADLINE_S = 60.0


def fit_elastic(
    job: dict, count: int, on_cluster: bool, nodes: Sequence[Any], run_dir: Path, grow: bool = True
) -> None:
    """Train to the end with workers that may come and go (see the module docstring). `grow`: a machine that joins
    the cluster takes part (no worker count was asked); otherwise only to bring the run back to `count` workers."""
    import ray
    from torch.distributed import TCPStore

    from raytrm.distributed.workers import raytrm_nodes

    host = ray.util.get_node_ip_address()
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    job = {**job, "store": (host, store.port), "size": count}
    here = ray.get_runtime_context().get_node_id()
    ordered = sorted(nodes, key=lambda n: n.node_id != here)[:count] if on_cluster else []
    # Every worker's gloo bound to the network of the fastest paths (Ray Train's workers are bound the same way).
    found = gloo_path.nodes_net([n.node_id for n in ordered], timeout_s=FIRST_DEADLINE_S) if on_cluster else []
    paths = gloo_path.plan(found)
    if on_cluster:
        logger.info(gloo_path.describe(paths, found))
    runs: dict[Any, tuple[str, str | None]] = {}  # an actor's run -> its name and node
    actors: dict[str, Any] = {}

    def start(name: str, node_id: str | None, join: bool) -> None:
        interface = None
        if paths and node_id is not None:
            interface = paths.get(node_id)
            if interface is None:  # a Mac that comes later: its interface on the run's network
                interface = gloo_path.newcomer(paths, gloo_path.nodes_net([node_id], FIRST_DEADLINE_S)[0])
            if interface is None:
                logger.warning("worker %s: its Mac is not on the network the run's gradient sync binds", name)
        options = _placement(node_id, on_cluster, count)
        actor = _worker_class().options(**options).remote(job, name, join, interface and interface.name)
        actors[name] = actor
        runs[actor.run.remote()] = (name, node_id)

    for i in range(count):
        start(f"w{i:02d}", ordered[i].node_id if on_cluster else None, join=False)
    first, joined, next_look = "w00", count, time.monotonic() + NODE_POLL_S
    left: dict[str, float] = {}  # a node whose worker left -> when
    try:
        while runs:
            done, _ = ray.wait(list(runs), num_returns=1, timeout=1.0)
            for ref in done:
                name, node_id = runs.pop(ref)
                try:
                    ray.get(ref)
                except Exception as error:  # a worker's failure, or its Mac gone: the membership goes on without it
                    found = _user_error(error)
                    if found is not None:
                        raise found from None
                    if name == first:
                        raise
                    logger.warning("worker %s left the run (%s)", name, failure_line(error))
                    if node_id is not None:
                        left[node_id] = time.monotonic()
                    continue
                if name == first:
                    return
            if on_cluster and time.monotonic() >= next_look:
                next_look = time.monotonic() + NODE_POLL_S
                busy = {node_id for _, node_id in runs.values()}
                for node in without_worker(raytrm_nodes(), busy, left, time.monotonic()):
                    if grow or len(runs) < count:
                        logger.warning("a raytrm machine at %s has no worker: it joins the run", node.address)
                        start(f"w{joined:02d}", node.node_id, join=True)
                        joined += 1
    finally:
        store.set("finished", "1")
        for actor in actors.values():
            ray.kill(actor, no_restart=True)


def without_worker(nodes: Sequence[Any], busy: set[str], left: dict[str, float], now: float) -> list[Any]:
    """The raytrm machines to start a worker on now: those running none, but for a machine whose worker left less
    than LEFT_HOLD_S ago (`left`: node id -> when)."""
    held = {node_id for node_id, when in left.items() if now - when < LEFT_HOLD_S}
    return [n for n in nodes if n.node_id not in busy | held]


def _placement(node_id: str | None, on_cluster: bool, count: int) -> dict[str, Any]:
    """One worker per Mac on a cluster (its machine unit, on that node); on one machine, a share of its CPUs."""
    if on_cluster:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {
            "resources": {RESOURCE_MACHINE: 1},
            "num_cpus": 1,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
        }
    return {"num_cpus": min(1.0, (os.cpu_count() or 1) / count)}


def _user_error(error: BaseException) -> UserError | None:
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, UserError) else None


def failure_line(error: BaseException) -> str:
    """What failed in a worker, in a line: the worker's own exception (a Ray task error's cause), not Ray's wrapper."""
    cause = getattr(error, "cause", None)
    cause = cause if isinstance(cause, BaseException) else error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__


def _worker_class() -> Any:
    import ray

    return ray.remote(max_restarts=0, max_concurrency=2)(ElasticWorker)


class ElasticWorker:
    """One worker of an elastic run, in a Ray actor: it starts with the run's first members or joins the run."""

    def __init__(self, job: dict, name: str, join: bool, interface: str | None = None) -> None:
        self.job, self.name, self.join, self.interface = job, name, join, interface

    def pid(self) -> int:
        return os.getpid()

    def run(self) -> dict[str, Any]:
        from torch.distributed import TCPStore

        from raytrm.distributed.run_logs import worker_logs
        from raytrm.distributed.workers import first_shares, node_tier, worker_config
        from raytrm.hardware import device as devices
        from raytrm.sync.membership import Membership, RunFinished
        from raytrm.sync.process_group import ProcessGroupSync
        from raytrm.train.elastic import Elastic
        from raytrm.train.run.training import run_training

        job, run_dir = self.job, Path(self.job["run_dir"])
        first = self.name == "w00"
        level = os.environ.get(LOG_LEVEL_ENV, DEFAULT_LOG_LEVEL)
        worker_logs(run_dir, int(self.name[1:]), quiet=not job["progress"], level=level)
        tier = node_tier()
        config = worker_config(job, tier)
        logger.info("worker %s (pid %d) on tier %s%s", self.name, os.getpid(), tier, ", joining" if self.join else "")
        gloo_path.bind(self.interface)  # read by gloo at each membership's group
        if os.environ.get(GLOO_IFNAME_ENV):
            logger.info("worker %s: the gradient sync goes through %s", self.name, os.environ[GLOO_IFNAME_ENV])
        host, port = job["store"]
        store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=120))
        members = Membership(store, self.name, deadline=job.get("deadline_s", FIRST_DEADLINE_S))
        elastic = Elastic(members)
        device = devices.pick_device(config.training.device)
        common = {"progress": job["progress"] and first, "balance": job["balance"], "elastic": elastic}
        try:
            if self.join:
                return run_training(config, run_dir, join_sync=lambda: ProcessGroupSync(device), **common)
            members.start(job["size"])
            sync = ProcessGroupSync(device)
            shares = first_shares(sync, job, tier, config.training.global_batch_size)
            return run_training(config, run_dir, resume=job["resume"], sync=sync, shares=shares, **common)
        except RunFinished:  # away when the run ended: nothing of it to do
            logger.warning("worker %s: the run ended while it was away", self.name)
            return {"finished_outside": True}
        finally:
            members.leave(finished=first)
