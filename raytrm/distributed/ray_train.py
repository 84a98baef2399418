"""`raytrm train --workers N | --address ...`: the plain training loop on Ray Train workers, one model trained together.

The driver checks everything a user can get wrong before any worker starts (worker count, tiers of the profiles,
the run directory on every node), then starts a TorchTrainer whose workers each build the same Trainer with a
`ProcessGroupSync` and their share of every global batch. Each worker takes its machine's settings (micro-batch,
threads, memory budget, thermal cap) from the profile of its node's tier, or from its tier's defaults; the learning
settings are the same everywhere. Rank 0 writes the run directory, which every node must reach at the same path.

A lost worker: the group restarts (on one machine Ray Train's FailureConfig restarts it; on a cluster the driver
does, on the Macs still there), and the restarted workers resume from the run directory's latest checkpoint:
resume is exact, so the restart changes nothing but the time it costs.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raytrm import config as cfg
from raytrm.constants import DEFAULT_LOG_LEVEL, GLOO_IFNAME_ENV, LOG_LEVEL_ENV, RESOURCE_MACHINE
from raytrm.distributed.workers import (
    MACHINE_FIELDS,
    Node,
    first_shares,
    node_tier,
    raytrm_nodes,
    without_machine_settings,
)
from raytrm.distributed.workers import worker_config as worker_config
from raytrm.errors import UserError

logger = logging.getLogger(__name__)


def profile_settings(profiles: Sequence[cfg.Profile], names: Sequence[str]) -> tuple[dict, dict]:
    """Per tier: the machine settings and the measured samples/s of its profile.

    Every profile must describe the same experiment (model, data and learning settings): only machine fields may
    differ, or the workers would not be training one model.
    """
    machines: dict[str, dict[str, Any]] = {}
    weights: dict[str, float] = {}
    shared: dict[str, Any] | None = None
    for profile, name in zip(profiles, names, strict=True):
        if profile.tier in machines:
            raise UserError(f"{name}: a second profile for tier {profile.tier}; give one --profile per tier")
        training = cfg.to_dict(profile.training)
        machine = {k: training.pop(k) for k in MACHINE_FIELDS}
        machine["micro_batch_size"] = profile.training.micro_batch
        machine["memory_budget_mb"] = machine["memory_budget_mb"] or profile.limits.memory_budget_mb
        machine["thermal_cap"] = machine["thermal_cap"] or profile.limits.thermal_cap
        training.pop("grad_accum_steps")
        experiment = {"model": cfg.to_dict(profile.model), "data": cfg.to_dict(profile.data), "training": training}
        if shared is not None and experiment != shared:
            differs = sorted(
                f"{section}.{key}"
                for section in experiment
                for key in experiment[section]
                if experiment[section][key] != shared[section].get(key)
            )
            raise UserError(
                f"{name}: the profiles describe different experiments ({', '.join(differs)} differ); profiles of "
                "one run may differ only in machine settings (micro-batch, threads, limits, device)"
            )
        shared = experiment
        machines[profile.tier] = machine
        weights[profile.tier] = profile.measured.samples_per_sec or 0.0
    return machines, weights


def _check_nodes(run_dir: Path, data_path: str | None, nodes: Sequence[Node]) -> None:
    """On every node (any may hold rank 0): the dataset is there, and the run directory can be written, at the
    same paths."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def check(run: str, data: str | None) -> str | None:
        if data and not Path(data).exists():
            return (
                f"{data}: no such dataset on this node; put it at the same path on every Mac, or leave --data out "
                "to have each node generate it"
            )
        probe = Path(run) / f".raytrm-write-check-{uuid.uuid4().hex}"
        try:
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            return (
                f"{run}: cannot write the run directory ({e.strerror or e}); give --out a path every Mac reaches "
                "at the same place (a shared mount, see README 'Training on several Macs')"
            )
        return None

    run = str(run_dir.resolve())
    data = str(Path(data_path).resolve()) if data_path else None
    strategy = NodeAffinitySchedulingStrategy
    checks = [check.options(scheduling_strategy=strategy(n.node_id, soft=False)).remote(run, data) for n in nodes]
    for node, error in zip(nodes, ray.get(checks), strict=True):
        if error:
            raise UserError(f"node {node.address}: {error}")


def _user_error(error: BaseException) -> UserError | None:
    """The UserError a worker raised, under Ray's wrapping, if that is what failed it."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, UserError):
            return seen
        seen = getattr(seen, "cause", None) or seen.__cause__
    return None


def train_distributed(
    config: cfg.ExperimentConfig,
    run_dir: str | Path,
    *,
    workers: int | None = None,
    address: str | None = None,
    profiles: Sequence[cfg.Profile] = (),
    profile_names: Sequence[str] = (),
    explicit: Sequence[str] = (),
    resume: bool = False,
    progress: bool = True,
    balance: bool = True,
    max_failures: int = 2,
    elastic: bool = False,
) -> dict[str, Any]:
    """Train config on Ray Train workers (N on this machine, or one per node of the cluster at address).

    `explicit` names the training fields the user set by flag: they hold on every worker over tier defaults.
    Without `progress` (--quiet) the terminal shows warnings only; Ray's lines and the workers' INFO lines go to
    RUN_DIR/logs either way (raytrm.distributed.run_logs). Returns rank 0's summary. `elastic`: the workers are
    the driver's own actors, which may come and go without a restart (raytrm.distributed.elastic_run).
    """
    from raytrm.distributed.cluster import connect
    from raytrm.distributed.run_logs import DriverLogs
    from raytrm.train.run.directory import check_new_run_dir
    from raytrm.train.run.training import SUMMARY_FILE, check_resume

    if workers is not None and workers < 1:
        raise UserError(f"--workers {workers}: expected a number of workers >= 1")
    run_dir = Path(run_dir)
    if not resume:
        check_new_run_dir(run_dir)
    machines, weights = profile_settings(profiles, profile_names) if profiles else ({}, {})
    if resume:  # here, not on the workers: their refusal would come after Ray Train's retries and their tracebacks
        check_resume(config, run_dir)
    if profiles:  # the first profile's machine settings are its tier's: other tiers take theirs, or their defaults
        config = without_machine_settings(config, keep=explicit)
    logs, owned = DriverLogs(run_dir, quiet=not progress).start(), False
    try:
        owned = connect(address, dashboard=True, on_import=logs.ray_imported)
        logs.forward()
        nodes = raytrm_nodes()
        on_cluster = address is not None
        count = workers or len(nodes)
        if on_cluster and count > len(nodes):
            raise UserError(
                f"--workers {count}: the cluster has {len(nodes)} raytrm machine(s), one worker each; start more "
                "nodes with `raytrm cluster join` or ask for fewer workers"
            )
        missing = sorted(set(machines) - {n.tier for n in nodes})
        if missing:
            raise UserError(
                f"--profile for tier(s) {', '.join(missing)}: no node of the cluster has that tier (it has: "
                f"{', '.join(sorted({str(n.tier) for n in nodes}))}); drop that profile or start such a node"
            )
        _check_nodes(run_dir, config.data.path, nodes)
        logs.keep()
        job = {
            "config": config,
            "run_dir": str(run_dir.resolve()),
            "resume": resume,
            "progress": progress,
            "balance": balance,
            "machines": machines,
            "weights": weights,
            "explicit": list(explicit),
            "workers_per_machine": 1 if on_cluster else count,
            "driver_restarts": on_cluster,  # and says so (_fit); on one machine Ray Train restarts the group
        }
        if elastic:
            from raytrm.distributed.elastic_run import fit_elastic

            fit_elastic(job, count, on_cluster, nodes, run_dir, grow=workers is None)
        else:
            _fit(job, count, on_cluster, nodes, run_dir, max_failures)
        return json.loads((run_dir / SUMMARY_FILE).read_text())
    finally:
        if owned:
            import ray

            ray.shutdown()
        logs.close()


def _fit(job: dict, count: int, on_cluster: bool, nodes: Sequence[Node], run_dir: Path, max_failures: int) -> None:
    """Train to the end, restarting a failed group up to max_failures times.

    On a cluster the driver restarts it, on the machines alive then: a Mac that left for good is gone from the
    cluster's nodes at once, whereas Ray Train's elastic restart would first ask for the group's old size and wait
    out its worker-group start timeout (60 s) for it.
    """
    from ray.train import TrainingFailedError

    if not on_cluster:
        _fit_group(job, count, on_cluster, nodes, run_dir, max_failures)
        return
    for restarts in range(max_failures + 1):
        try:
            _fit_group(job, count, on_cluster, nodes, run_dir, 0)
            return
        except TrainingFailedError as error:
            left = 0 if restarts == max_failures else len(raytrm_nodes())
            if not left:
                raise
            logger.warning(
                "the group of %d worker(s) failed (%s); restarting it on the %d machine(s) left, from the last "
                "checkpoint",
                count,
                _why_failed(error),
                min(count, left),
            )
            count = min(count, left)


def _why_failed(error: Exception) -> str:
    """A failed group's cause in a few words: a worker's machine that left, else the first worker's first line."""
    failures = [*getattr(error, "worker_failures", {}).values()] or [error]
    texts = [str(failure) for failure in failures]
    if any("node has died" in text for text in texts):
        return "a worker's machine left the cluster"
    lines = [line.strip() for line in texts[0].splitlines() if line.strip()]
    return lines[0] if lines else type(failures[0]).__name__


def _fit_group(
    job: dict, count: int, on_cluster: bool, nodes: Sequence[Node], run_dir: Path, max_failures: int
) -> None:
    """One TorchTrainer of `count` workers; Ray Train restarts it up to max_failures times."""
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrm.distributed import gloo_path
    from raytrm.hardware import device as devices

    kind, _ = devices.available_kind()
    use_gpu = kind == devices.CUDA and job["config"].training.device in ("auto", devices.CUDA)
    backend = devices.collective_backend(devices.pick_device(devices.CUDA if use_gpu else devices.CPU))
    if on_cluster:
        resources = {RESOURCE_MACHINE: 1, "CPU": 1}  # one worker per Mac: its machine unit
    else:
        cpus = min(n.cpus for n in nodes) if nodes else float(os.cpu_count() or 1)
        resources = {"CPU": min(1.0, cpus / count)}
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config=job,
        # On a cluster, each worker's gradient sync binds the fastest path the run's Macs share (gloo_path).
        torch_config=gloo_path.torch_config(backend) if on_cluster else TorchConfig(backend=backend),
        scaling_config=ScalingConfig(num_workers=count, use_gpu=use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=f"train-{uuid.uuid4().hex[:8]}",
            storage_path=str((run_dir / "ray").resolve()),
            failure_config=FailureConfig(max_failures=max_failures),
            # Ray Train's own INFO lines (state changes, reports) stay in its log files under the session's
            # logs/train/; its warnings reach RUN_DIR/logs/driver.log (raytrm.distributed.run_logs).
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
    )
    from ray.train import WorkerGroupError

    try:
        trainer.fit()
    except WorkerGroupError as e:  # a worker's bad input (say, a corrupt checkpoint) is still one line
        found = [u for u in map(_user_error, e.worker_failures.values()) if u is not None]
        if found:
            raise UserError(str(found[0])) from None
        raise


# -- inside each worker ------------------------------------------------------------------------------------------


def _worker_loop(job: dict) -> None:
    import ray.train

    from raytrm.distributed.run_logs import DRIVER_LOG, LOGS_DIR, worker_logs
    from raytrm.hardware import device as devices
    from raytrm.sync.process_group import ProcessGroupSync
    from raytrm.train import checkpoint as ckpt
    from raytrm.train.run.training import CHECKPOINT_DIR, run_training

    rank = ray.train.get_context().get_world_rank()
    run_dir = Path(job["run_dir"])
    # Rank 0 speaks for the run, the others say only what goes wrong; every worker's INFO lines go to its log file.
    worker_logs(run_dir, rank, quiet=not job["progress"], level=os.environ.get(LOG_LEVEL_ENV, DEFAULT_LOG_LEVEL))
    tier = node_tier()
    config = worker_config(job, tier)
    sync = ProcessGroupSync(devices.pick_device(config.training.device))
    global_batch = config.training.global_batch_size
    shares = first_shares(sync, job, tier, global_batch)
    # A restart after a lost worker finds this run's checkpoints (a fresh run started without any): resume.
    found = bool(ckpt.list_checkpoints(run_dir / CHECKPOINT_DIR)) if rank == 0 else None
    restarted = bool(sync.broadcast_object(found)) and not job["resume"]
    resume = job["resume"] or restarted
    if restarted and rank == 0 and not job["driver_restarts"]:  # Ray Train's account is in the log, not in sight
        logger.warning(
            "the workers restarted after a failure (Ray's account: %s); resuming from the last checkpoint",
            run_dir / LOGS_DIR / DRIVER_LOG,
        )
    logger.info("worker %d on tier %s: share %d of %d", rank, tier, shares[rank], global_batch)
    if os.environ.get(GLOO_IFNAME_ENV):
        logger.info("worker %d: the gradient sync goes through %s", rank, os.environ[GLOO_IFNAME_ENV])

    # Nothing is reported to Ray Train: the run directory holds the checkpoints and metrics, and a report blocks
    # every worker (it is collective) until Ray's controller takes the report before, which it polls every 2 s.
    run_training(
        config,
        run_dir,
        resume=resume,
        progress=job["progress"] and rank == 0,
        sync=sync,
        shares=shares,
        balance=job["balance"],
    )
