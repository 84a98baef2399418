"""`python -m benchmarks rig --parts paths`: a Studio and a MacBook joined by two paths, the LAN (their Wi-Fi) and a
direct link (their Thunderbolt bridge), as tests.support.rig makes them.

Each trial, with the Studio's `raytrm cluster head` running:
- chosen: the MacBook's `raytrm cluster join HEAD`, which measures every path to the head and binds the gradient
  sync to the fastest, then `raytrm train --address auto` from the Studio;
- bound to the LAN: the same join with `--node-ip` the MacBook's LAN address (the path named by hand, as a user
  who gave the Wi-Fi's address would), then the same run.
The two runs' order alternates between trials. The goal: the direct link chosen in every trial, and the run bound
to the LAN at most as fast as the run on the path chosen (the ratio of their rates, median over trials, <= 1).
"""

from __future__ import annotations

import logging
import re
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.link_models import LinkModel
from benchmarks.rig import HEAD_TIER, join, rig_experiment, train_on
from tests.support.hosts import HostSpec, LinkSpec, Rig

logger = logging.getLogger(__name__)

LAN_RATE, DIRECT_RATE = "20mbit", "1gbit"
HOSTS = (HostSpec("studio", cpu=0.8, lan=LAN_RATE), HostSpec("mba", cpu=0.4, lan=LAN_RATE))
DIRECT = LinkSpec("tb", "studio", "mba", rate=DIRECT_RATE)
BINDINGS = ("chosen", "lan")
_CHOSEN = re.compile(r"the gradient sync takes the fastest: (\S+) ")
_GLOO = re.compile(r"the gradient sync goes through (\S+)")


@dataclass
class PathRun:
    trial: int
    binding: str  # "chosen": the join's own choice; "lan": --node-ip the LAN's address
    path: str = ""  # the path the join recorded for the sync (an interface's name)
    bound: str = ""  # the interface the workers' gloo bound, from their logs
    samples_per_sec: float | None = None
    chosen: str = ""  # the sync mode the run chose
    error: str = ""


def _join(rig: Rig, binding: str) -> str:
    """The MacBook joins; the path recorded for the sync."""
    if binding == "lan":
        join(rig, "mba", "--node-ip", rig.address("mba"))
        return "lan (--node-ip)"
    found = _CHOSEN.search(join(rig, "mba").stdout)
    return found.group(1) if found else "none chosen"


def _bound(run_dir: Path) -> str:
    """The interfaces the workers' gloo bound, as their logs say (one per worker, sorted)."""
    names = set()
    for log in sorted((run_dir / "logs").glob("worker-*.log")):
        found = _GLOO.search(log.read_text())
        names.add(found.group(1) if found else "unbound")
    return ",".join(sorted(names))


def _trial(rig: Rig, trial: int, binding: str, model: LinkModel, mode: str, runs_dir: Path) -> PathRun:
    run = PathRun(trial, binding)
    run_dir = runs_dir / f"paths-{binding}-{trial}"
    try:
        run.path = _join(rig, binding)
        figures = train_on(rig["studio"], rig_experiment(model, mode), model, run_dir, "--address", "auto")
        run.samples_per_sec, run.chosen = figures["samples_per_sec"], figures["chosen"]
        run.bound = _bound(run_dir)
    except (RuntimeError, OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
        run.error = str(e)
    finally:
        rig["mba"].raytrm("cluster", "stop", timeout=300)
    logger.info("%s", _line(run))
    return run


def _line(run: PathRun) -> str:
    where = f"trial {run.trial} {run.binding}"
    if run.error:
        return f"{where}: FAILED: {run.error.splitlines()[0]}"
    return f"{where}: path {run.path}, gloo through {run.bound}, {run.samples_per_sec:.2f} samples/s ({run.chosen})"


def measure(work_dir: Path, model: LinkModel, mode: str, trials: int) -> list[PathRun]:
    """The two-path pair made, the Studio's head started, then `trials` trials (see the module docstring)."""
    runs_dir = work_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    runs: list[PathRun] = []
    with Rig(work_dir / "pair", list(HOSTS), [DIRECT]) as rig:
        rig.share_token()
        rig["studio"].raytrm("cluster", "head", "--tier", HEAD_TIER, check=True, timeout=300)
        try:
            for t in range(trials):
                order = BINDINGS if t % 2 == 0 else BINDINGS[::-1]
                runs += [_trial(rig, t, binding, model, mode, runs_dir) for binding in order]
        finally:  # each trial stopped the MacBook's node
            rig["studio"].raytrm("cluster", "stop", timeout=300)
    return runs


def summary(runs: list[PathRun]) -> dict[str, Any]:
    """The goal's figures: trials whose join chose the direct link, and the LAN-bound run's rate over the chosen's."""
    ok = [r for r in runs if not r.error]
    chosen = [r for r in ok if r.binding == "chosen"]
    ratios = []
    for t in sorted({r.trial for r in ok}):
        pair = {r.binding: r.samples_per_sec for r in ok if r.trial == t}
        if pair.get("chosen") and pair.get("lan"):
            ratios.append(pair["lan"] / pair["chosen"])
    return {
        "trials": len({r.trial for r in runs}),
        "direct_chosen": sum(r.path == DIRECT.name for r in chosen),
        "chosen_runs": len(chosen),
        "lan_over_chosen": statistics.median(ratios) if ratios else None,
        "ratios": ratios,
        "failed": len(runs) - len(ok),
    }


def format_runs(runs: list[PathRun]) -> str:
    s = summary(runs)
    ratio = f"{s['lan_over_chosen']:.3f}" if s["lan_over_chosen"] is not None else "-"
    head = (
        f"two paths (LAN {LAN_RATE}, direct {DIRECT_RATE}): the direct link chosen in {s['direct_chosen']} of "
        f"{s['chosen_runs']} trials; bound to the LAN / chosen: {ratio} (median of {len(s['ratios'])}; goal <= 1)"
    )
    failed = f" ({s['failed']} runs failed)" if s["failed"] else ""
    return "\n".join([head + failed, *(_line(r) for r in runs)])
