"""`python -m benchmarks rig`: three unequal hosts training as one, against the sum of what each trains alone (the
scaling part; `--parts asleep killed`: a MacBook leaving an elastic run, benchmarks.rig_elastic).

The hosts are tests.support.rig's namespaces on one LAN, a Studio and two MacBooks' worth of this machine's cores
(CPU quotas 0.8, 0.4 and 0.4 of a core, under its two so the sum is measurable). Each round:
- each host's solo rate: `raytrm train` of the model on that host alone, no Ray (samples/s over its steady steps);
- then, at each LAN rate (tc tbf on every host's attachment, both ends), `raytrm cluster head` on the Studio,
  `cluster join` on the MacBooks, and `raytrm train --address auto` from the Studio: one worker a host, shares
  balanced by speed, the sync mode chosen from the measured link (`auto`, or --sync-modes).
A row's figure is the run's samples/s over the sum of the round's solo rates (the issue's goal: 0.90 unshaped,
0.85 at 100 Mbit/s, 0.80 at 20 Mbit/s); with several rounds, the median of the rounds' ratios. Every worker and
every solo run trains on one thread, the quota's worth of one core at most.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import statistics
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.link import RUN_SECONDS, STEP_SECONDS, check_rates
from benchmarks.link_models import LinkModel, mode_settings, trm_model
from benchmarks.link_runs import read_run
from raytrm import config as cfg
from raytrm.errors import UserError
from tests.support.hosts import Host, HostSpec, Rig, cannot_make_hosts

logger = logging.getLogger(__name__)

#: A Mac Studio and two MacBooks: the cores each may use (their quotas' sum stays under this machine's two).
HOSTS = (HostSpec("studio", cpu=0.8), HostSpec("mba", cpu=0.4), HostSpec("mbp", cpu=0.4))
HEAD_TIER, WORKER_TIER = "mac-desktop-16gb", "macbook-air-8gb"
RATES = ("unshaped", "100mbit", "20mbit")
GOALS = {"unshaped": 0.90, "100mbit": 0.85, "20mbit": 0.80}


@dataclass
class RigRun:
    """One run: a host alone (`host` its name) or the three together (`host` "all")."""

    round: int
    host: str
    rate: str
    mode: str
    samples_per_sec: float | None = None
    quality: float | None = None
    chosen: str = ""
    reason: str = ""
    shares: list[int] = field(default_factory=list)
    load: float = 0.0
    error: str = ""


def _experiment(model: LinkModel, mode: str | None) -> dict[str, Any]:
    experiment = copy.deepcopy(model.experiment)
    experiment["training"]["threads"] = 1
    if mode is not None:
        experiment["training"].update(mode_settings(mode))
    return experiment


def _train(host: Host, experiment: dict[str, Any], model: LinkModel, run_dir: Path, *flags: str) -> dict[str, Any]:
    """One `raytrm train` on host (with flags: across the cluster); the run's figures."""
    config = run_dir.with_suffix(".yaml")
    cfg.write_yaml(cfg.from_dict(cfg.ExperimentConfig, experiment, "the rig's run"), config)
    args = ("train", "--config", str(config), *flags, "--out", str(run_dir), "--quiet")
    done = host.raytrm(*args, timeout=RUN_SECONDS + STEP_SECONDS * model.steps)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-20:]
        raise RuntimeError(f"`raytrm {' '.join(args)}` on {host.name} exited {done.returncode}:\n" + "\n".join(tail))
    return read_run(run_dir, model)


def _run(rig: Rig, r: int, host: str, rate: str, mode: str, model: LinkModel, runs_dir: Path) -> RigRun:
    """One solo run (host a host's name, mode "solo") or the cluster's (host "all", driven from the Studio)."""
    run = RigRun(r, host, rate, mode)
    flags = ("--address", "auto") if host == "all" else ()
    driver = rig["studio"] if host == "all" else rig[host]
    run_dir = runs_dir / f"{host}-{rate}-{mode.replace(':', '')}-{r}"
    try:
        figures = _train(driver, _experiment(model, mode if host == "all" else None), model, run_dir, *flags)
        run.samples_per_sec, run.quality = figures["samples_per_sec"], figures["quality"]
        run.chosen, run.reason = figures["chosen"], figures["reason"]
        run.shares = _shares(run_dir)
    except (RuntimeError, OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
        run.error = str(e)
    run.load = os.getloadavg()[0]
    logger.info("%s", _line(run))
    return run


def _shares(run_dir: Path) -> list[int]:
    summary = json.loads((run_dir / "summary.json").read_text())
    shares = summary.get("shares") or []
    return [int(s) for s in shares] if isinstance(shares, list) else []


def _line(run: RigRun) -> str:
    where = f"round {run.round} {run.host} {run.rate} {run.mode}"
    if run.error:
        return f"{where}: FAILED: {run.error.splitlines()[0]}"
    chose = f"; chose {run.chosen}: {run.reason}" if run.chosen else ""
    shares = f", shares {run.shares}" if run.shares else ""
    return f"{where}: {run.samples_per_sec:.2f} samples/s{shares}, quality {run.quality} (load {run.load:.1f}){chose}"


def join(rig: Rig, name: str) -> None:
    """A MacBook joins the Studio's cluster."""
    rig[name].raytrm("cluster", "join", rig.address("studio"), "--tier", WORKER_TIER, check=True, timeout=300)


def _start_cluster(rig: Rig) -> None:
    rig["studio"].raytrm("cluster", "head", "--tier", HEAD_TIER, check=True, timeout=300)
    for name in ("mba", "mbp"):
        join(rig, name)


def _stop_cluster(rig: Rig) -> None:
    for name in ("mbp", "mba", "studio"):
        rig[name].raytrm("cluster", "stop", timeout=300)


def measure(
    rig: Rig, model: LinkModel, solo: LinkModel, rates: list[str], modes: list[str], rounds: int, runs_dir: Path
) -> list[RigRun]:
    """Every round: each host's solo run (of `solo`: the model, fewer steps), then each (rate, mode) across the
    three, the rates' order reversed every other round."""
    runs: list[RigRun] = []
    for r in range(rounds):
        runs += [_run(rig, r, h.name, "-", "solo", solo, runs_dir) for h in HOSTS]
        _start_cluster(rig)
        try:
            for rate in rates if r % 2 == 0 else rates[::-1]:
                rig.set_rate("lan", rate)
                runs += [_run(rig, r, "all", rate, mode, model, runs_dir) for mode in modes]
        finally:
            _stop_cluster(rig)
            rig.set_rate("lan", "unshaped")
    return runs


@dataclass
class RigRow:
    rate: str
    mode: str
    samples_per_sec: float | None
    solo_sum: float | None
    ratio: float | None
    goal: float | None
    chosen: list[str]
    runs: int
    failed: int


def rows_of(runs: list[RigRun]) -> list[RigRow]:
    """One row per (rate, mode): the median over rounds of the run's rate and of its ratio to its round's solo sum."""
    solo: dict[int, float] = {}
    for run in runs:
        if run.host != "all":
            solo[run.round] = solo.get(run.round, 0.0) + (run.samples_per_sec or float("nan"))
    rows: list[RigRow] = []
    for key in dict.fromkeys((r.rate, r.mode) for r in runs if r.host == "all"):
        mine = [r for r in runs if r.host == "all" and (r.rate, r.mode) == key]
        ok = [r for r in mine if not r.error and r.samples_per_sec and solo.get(r.round) == solo.get(r.round)]
        rows.append(
            RigRow(
                rate=key[0],
                mode=key[1],
                samples_per_sec=statistics.median(r.samples_per_sec for r in ok) if ok else None,
                solo_sum=statistics.median(solo[r.round] for r in ok) if ok else None,
                ratio=statistics.median(r.samples_per_sec / solo[r.round] for r in ok) if ok else None,
                goal=GOALS.get(key[0]),
                chosen=sorted({r.chosen for r in ok if r.chosen}),
                runs=len(mine),
                failed=len(mine) - len(ok),
            )
        )
    return rows


def format_rows(rows: list[RigRow], runs: list[RigRun]) -> str:
    lines = ["solo rates (samples/s): " + ", ".join(f"{r.host} {r.samples_per_sec}" for r in runs if r.host != "all")]
    lines.append(f"{'rate':<10} {'mode':<8} {'samples/s':>9} {'solo sum':>9} {'ratio':>6} {'goal':>5}  chosen")
    for row in rows:
        rate = f"{row.samples_per_sec:.2f}" if row.samples_per_sec else "-"
        total = f"{row.solo_sum:.2f}" if row.solo_sum else "-"
        ratio = f"{row.ratio:.3f}" if row.ratio else "-"
        goal = f"{row.goal:.2f}" if row.goal else "-"
        failed = f"  ({row.failed} of {row.runs} failed)" if row.failed else ""
        chosen = "; ".join(row.chosen)
        lines.append(f"{row.rate:<10} {row.mode:<8} {rate:>9} {total:>9} {ratio:>6} {goal:>5}  {chosen}{failed}")
    return "\n".join(lines)


PARTS = ("scaling", "asleep", "killed")


def run(
    parts: list[str], rates: list[str], modes: list[str], steps: int, solo_steps: int, rounds: int, work_dir: Path
) -> dict[str, Any]:
    """The bench as `python -m benchmarks rig` runs it: the rig made once (and removed whatever happens), the
    scaling part, then the elastic parts (benchmarks.rig_elastic) after an undisturbed elastic run; prints the
    tables, returns the rows and runs."""
    from benchmarks import rig_elastic  # it joins hosts with this module's `join`

    reason = cannot_make_hosts(cpu=True)
    if reason:
        raise UserError(f"the rig's three hosts are network namespaces with CPU quotas, not possible here: {reason}")
    check_rates(rates)
    for mode in modes:
        mode_settings(mode)
    model, solo = trm_model(work_dir, steps=steps), trm_model(work_dir, steps=solo_steps)
    out: dict[str, Any] = {"model": model.description, "steps": steps, "solo_steps": solo_steps}
    runs_dir = work_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    elastic_parts = [p for p in parts if p in rig_elastic.DISTURB]
    with Rig(work_dir / "hosts", list(HOSTS)) as rig:
        rig.share_token()
        if "scaling" in parts:
            runs = measure(rig, model, solo, rates, modes, rounds, runs_dir)
            rows = rows_of(runs)
            print(format_rows(rows, runs))
            out.update(rows=[asdict(r) for r in rows], runs=[asdict(r) for r in runs])
        if elastic_parts:
            _start_cluster(rig)
            try:
                done = [
                    rig_elastic.elastic_run(rig, model, part, runs_dir / part)
                    for part in ["undisturbed", *elastic_parts]
                ]
            finally:
                _stop_cluster(rig)
            print(rig_elastic.format_runs(done))
            out["elastic"] = [asdict(r) for r in done]
    return out
