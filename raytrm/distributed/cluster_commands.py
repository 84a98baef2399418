"""`raytrm cluster head | join | paths | status | stop`: one command per Mac makes a cluster that raytrm understands.

Each prints what it did and what to do next; every failure (no token, an unreachable head, versions that differ,
a token the head refuses, no path that answers) is one line and exit code 2, and a node that cannot join properly
is stopped again. The head runs a path service beside Ray (raytrm.distributed.path_service), through which `join`
measures every path to the head and records the fastest for the gradient sync (raytrm.distributed.gloo_path).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from raytrm.distributed import discovery, path_client, path_service, paths, tokens
from raytrm.distributed import node as nodes
from raytrm.distributed.cluster import check_address, ray_node_here
from raytrm.distributed.reach import check_head, ipv4_of, port_taken
from raytrm.errors import UserError

logger = logging.getLogger(__name__)


HEAD_RESOURCE = "node:__internal_head__"  # Ray's marker of the head node among ray.nodes()


def _token_path(explicit: str | None) -> Path:
    return tokens.default_token_path() if explicit is None else Path(explicit).expanduser().resolve()


def _environment(token: Path, spec: nodes.NodeSpec) -> dict[str, str]:
    """`ray start`'s environment, which the node's workers inherit: token auth, macOS clustering, gloo's interface."""
    return {**tokens.ray_environment(token), **nodes.collective_environment(spec.node_ip)}


#: Dashboard hosts that mean every interface, and those that mean this Mac alone.
ANY_HOST = ("0.0.0.0", "::")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def head(
    node_ip: str | None = None,
    port: int = nodes.DEFAULT_PORT,
    tier: str | None = None,
    token_file: str | None = None,
    dashboard_host: str = "127.0.0.1",
    object_store_mb: int | None = None,
    autoscaling_config: str | None = None,
    paths_port: int | None = None,
) -> dict[str, Any]:
    """Start this Mac as the cluster's head, and its path service; returns what was started (also printed by the
    CLI).

    autoscaling_config: the file `ray up` writes on the head, whose autoscaler then starts the workers over SSH.
    paths_port: the path service's port (default: port + 1).
    """
    if nodes.port_number(str(port)) is None:
        raise UserError(f"--port {port}: expected a port from 1 to 65535, e.g. {nodes.DEFAULT_PORT}")
    paths_port = path_client.service_port(port, paths_port)
    if dashboard_host not in ANY_HOST + LOOPBACK and nodes.interface_of(dashboard_host) is None:
        raise UserError(
            f"--dashboard-host {nodes.shown(dashboard_host)}: not an address of this Mac; give 127.0.0.1 (this Mac "
            f"only), 0.0.0.0 (every interface) or one of {', '.join(nodes.local_addresses())}"
        )
    spec = nodes.this_node(node_ip, tier)
    taken = port_taken(spec.node_ip, port)
    if taken:
        raise UserError(
            f"--port {port}: the head cannot listen there ({taken}); stop what uses it (`lsof -i :{port}` names "
            "it; `raytrm cluster stop` if it is a Ray node), or give another --port"
        )
    path_service.stop(paths_port)  # no head runs here (its port is free): a service left on the port is stale
    taken = port_taken(spec.node_ip, paths_port)
    if taken:
        raise UserError(
            f"--paths-port {paths_port}: the head's path service cannot listen there ({taken}); stop what uses it "
            f"(`lsof -i :{paths_port}` names it), or give another --paths-port"
        )
    token = _token_path(token_file)
    created = tokens.ensure_token(token)
    argv = nodes.start_command(spec, None, port, dashboard_host, object_store_mb)
    if autoscaling_config:
        argv.append(f"--autoscaling-config={Path(autoscaling_config).expanduser()}")
    nodes.run_ray(argv, _environment(token, spec), "ray start --head")
    try:
        path_service.start(paths_port, token, f"{spec.node_ip}:{port}")
    except BaseException:
        stop()
        raise
    return {
        "role": "head",
        "address": f"{spec.node_ip}:{port}",
        "paths_port": paths_port,
        "advertised": path_service.advertised(spec.node_ip),
        "tier": spec.tier,
        "memory_budget_mb": spec.memory_budget_mb,
        "token_file": str(token),
        "token_created": created,
        # Listening on every interface, the dashboard is reached at the head's LAN address (0.0.0.0 is no address).
        "dashboard": f"http://{spec.node_ip if dashboard_host in ANY_HOST else dashboard_host}:{nodes.DASHBOARD_PORT}",
        "dashboard_on_lan": dashboard_host not in LOOPBACK,
    }


def join(
    address: str | None,
    node_ip: str | None = None,
    tier: str | None = None,
    token_file: str | None = None,
    object_store_mb: int | None = None,
    paths_port: int | None = None,
) -> dict[str, Any]:
    """Join the head at HEAD[:PORT] (None: the one head found on the local network by mDNS) with its token, the
    paths to it measured and the fastest recorded for the gradient sync (node_ip, where given, names the path
    instead); stopped again if its versions differ from the head's."""
    found, address, paths_port = _head_address(address, paths_port, "join")
    host, port = nodes.split_address(address)
    paths_port = path_client.service_port(port, paths_port)
    if node_ip is not None:
        nodes.lan_address(node_ip)  # a wrong --node-ip is refused before the network is asked anything
    token = _token_path(token_file)
    secret = tokens.read_token(token, head=host)
    check_head(host, port, f"{host}:{port}", tokens.ray_environment(token))
    head_ip = ipv4_of(host)
    measured = path_client.find_paths(head_ip, paths_port, secret, token)
    chosen = paths.choose(measured)
    spec = nodes.this_node(node_ip, tier, head_ip)
    spec.path = node_ip or (chosen.local if chosen else None)
    spec.path_head = None if node_ip or chosen is None else chosen.remote
    env = _environment(token, spec)
    nodes.run_ray(nodes.start_command(spec, f"{host}:{port}", object_store_mb=object_store_mb), env, "ray start")
    try:
        head_labels = _head_labels(f"{host}:{port}", env)
    except Exception:
        stop()
        raise
    problem = nodes.version_mismatch(spec.labels(), head_labels)
    if problem:
        stop()
        raise UserError(problem)
    return {
        "role": "worker",
        "head": f"{host}:{port}",
        "found": found.name if found is not None else None,
        "address": spec.node_ip,
        "tier": spec.tier,
        "paths": measured,
        "chosen": None if node_ip else chosen,
        "path": spec.path,
    }


def _head_address(
    address: str | None, paths_port: int | None, command: str
) -> tuple[discovery.Head | None, str, int | None]:
    """The head as given, or (None) the one found on the local network by mDNS, with its path service's port."""
    if address is not None:
        return None, address, paths_port
    found, address = discovery.find_head(command=command)
    return found, address, found.paths_port if paths_port is None else paths_port


def measure(address: str | None, token_file: str | None = None, paths_port: int | None = None) -> dict[str, Any]:
    """`raytrm cluster paths [HEAD[:PORT]]`: the paths to the head (None: found by mDNS) measured, and the one `join`
    would choose; joins nothing."""
    found, address, paths_port = _head_address(address, paths_port, "paths")
    host, port = nodes.split_address(address)
    paths_port = path_client.service_port(port, paths_port)
    token = _token_path(token_file)
    secret = tokens.read_token(token, head=host)
    measured = path_client.find_paths(ipv4_of(host), paths_port, secret, token)
    chosen = paths.choose(measured)
    return {"head": f"{host}:{port}", "found": found.name if found else None, "paths": measured, "chosen": chosen}


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the block, for output written below Python (C++ logging)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _head_labels(address: str, env: dict[str, str]) -> dict[str, str]:
    """The labels of the head node, read through a short driver connection."""
    os.environ.update(env)  # before Ray is imported: it reads its auth mode once, at import
    import ray

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        for info in ray.nodes():
            if info.get("Alive") and info.get("Resources", {}).get(HEAD_RESOURCE):
                return dict(info.get("Labels", {}))
        raise UserError(f"{address}: the head node is not in its own cluster's node list; restart the head")
    finally:
        ray.shutdown()


def stop() -> str:
    """Stop this Mac's Ray node (its raylet, and the head's services and path service on the head)."""
    service = path_service.stop()
    argv = [sys.executable, "-m", "ray.scripts.scripts", "stop"]
    out = nodes.run_ray(argv, {}, "ray stop")
    stopped = "Stopped" in out or "stopped" in out
    if not stopped:
        return "no Ray node was running here" + ("; stopped a path service left running" if service else "")
    return "stopped this Mac's Ray node" + (" and its path service" if service else "")


def block(poll_s: float = 5.0, running: Callable[[], bool] = ray_node_here) -> int:
    """Stay in the foreground while this Mac's node runs, so launchd can keep it alive: returns 1 when the node
    has stopped (launchd starts the command again); SIGTERM (launchctl bootout, Ctrl-C) stops the node first."""

    def on_term(signum: int, frame: object) -> None:
        stop()
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        while running():
            time.sleep(poll_s)
    finally:
        signal.signal(signal.SIGTERM, previous)
    logger.warning("this Mac's Ray node has stopped")
    return 1


def connect_here(address: str | None, token_file: str | None = None) -> None:
    """Connect this process to the cluster as a driver, with the token (status, jobs): the cluster at address, or
    the one this Mac is a node of; one line within seconds where there is none to connect to."""
    tokens.use_cluster_token(None if token_file is None else _token_path(token_file))
    target = check_address(address, default_port=nodes.DEFAULT_PORT)
    import ray
    from ray.exceptions import AuthenticationError

    try:
        with _stderr_silenced():  # Ray's C++ client logs a failure on stderr too; the one line below says it
            ray.init(address="auto" if address is None else target, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError, AuthenticationError) as e:
        where = "this Mac" if address is None else address
        raise UserError(
            f"no raytrm cluster at {where}: {str(e).splitlines()[0]}; start one with `raytrm cluster head`"
        ) from None


def status(address: str | None = None, token_file: str | None = None, link: bool = False) -> dict[str, Any]:
    """The cluster's nodes (address, tier, CPUs, memory, budget, whether its raytrm machine is busy) and its jobs;
    with link, the rate and latency of a sum between its raytrm machines."""
    connect_here(address, token_file)
    import ray

    try:
        free = _available_per_node()
        rows = []
        for info in sorted(ray.nodes(), key=lambda n: (not n.get("Alive"), n.get("NodeManagerAddress", ""))):
            labels, res = info.get("Labels", {}), info.get("Resources", {})
            node_free = free.get(info["NodeID"], {})
            rows.append(
                {
                    "address": info.get("NodeManagerAddress"),
                    "alive": bool(info.get("Alive")),
                    "head": bool(res.get(HEAD_RESOURCE)),
                    "tier": labels.get(f"{nodes.LABEL_PREFIX}tier"),
                    "cpus": res.get("CPU", 0),
                    "memory_gb": res.get("memory", 0) / 2**30,
                    "budget_mb": int(labels[f"{nodes.LABEL_PREFIX}budget-mb"])
                    if f"{nodes.LABEL_PREFIX}budget-mb" in labels
                    else None,
                    "busy": bool(res.get(nodes.RESOURCE_MACHINE)) and not node_free.get(nodes.RESOURCE_MACHINE),
                    "versions": {k: labels.get(f"{nodes.LABEL_PREFIX}{k}") for k in nodes.VERSION_KEYS},
                    "path": labels.get(nodes.PATH_LABEL),
                }
            )
        report = {"nodes": rows, "jobs": _jobs()}
        if link:
            from raytrm.distributed.cluster_link import link_status

            report["link"] = link_status()
        return report
    finally:
        ray.shutdown()


def _available_per_node() -> dict[str, dict[str, float]]:
    try:
        from raytrm.distributed.ray_internals import available_resources_per_node

        return available_resources_per_node()
    except Exception as e:  # an older or newer Ray without it: the busy column reads as free
        logger.debug("per-node resources unavailable: %s", e)
        return {}


def _jobs() -> list[dict[str, Any]] | None:
    """Jobs submitted to this cluster (newest first), or None where the dashboard is not reachable from here."""
    try:
        from ray.job_submission import JobSubmissionClient

        client = JobSubmissionClient(f"http://127.0.0.1:{nodes.DASHBOARD_PORT}")
        jobs = client.list_jobs()
    except Exception as e:  # the dashboard listens on the head's localhost only, unless asked
        logger.debug("jobs unavailable here: %s", e)
        return None
    submitted = [j for j in jobs if j.submission_id]  # the rest are drivers (this status command among them)
    return [
        {"id": j.submission_id, "status": str(j.status.value if j.status else ""), "entrypoint": j.entrypoint}
        for j in sorted(submitted, key=lambda j: j.start_time or 0, reverse=True)
    ]


def format_status(report: dict[str, Any]) -> str:
    """The status as a table a person reads, then the jobs."""
    lines = [f"{'node':<16} {'tier':<22} {'role':<6} {'CPUs':>4} {'memory':>9} {'budget':>11}  raytrm machine"]
    for n in report["nodes"]:
        state = "lost" if not n["alive"] else ("busy" if n["busy"] else "free")
        budget = f"{n['budget_mb']} MiB" if n["budget_mb"] else "-"
        lines.append(
            f"{n['address']:<16} {n['tier'] or '(not raytrm)':<22} {'head' if n['head'] else 'worker':<6} "
            f"{n['cpus']:>4.0f} {n['memory_gb']:>6.1f} GiB {budget:>11}  {state}"
            + (f"  (joined by the path of {n['path']})" if n.get("path") not in (None, n["address"]) else "")
        )
    versions = {tuple(sorted(n["versions"].items())) for n in report["nodes"] if n["alive"] and n["tier"]}
    if len(versions) == 1:
        lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in next(iter(versions))) + " (every node)")
    if "link" in report:
        from raytrm.distributed.cluster_link import describe_link_status

        lines.append(describe_link_status(report["link"]))
    jobs = report["jobs"]
    if jobs is None:
        lines.append("jobs: run `raytrm cluster status` on the head to see them (its dashboard listens there only)")
    elif not jobs:
        lines.append("jobs: none submitted")
    else:
        lines += [f"job {j['id']}  {j['status']:<9} {j['entrypoint']}" for j in jobs]
    return "\n".join(lines)
