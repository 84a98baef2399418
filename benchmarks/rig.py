"""`python -m benchmarks rig`: three unequal hosts training as one, against the sum of what each trains alone (the
scaling part; `--parts asleep killed`: a MacBook leaving an elastic run, benchmarks.rig_elastic; `--parts paths`:
a pair joined by two paths, benchmarks.rig_paths).

The hosts are tests.support.rig's namespaces on one LAN, a Studio and two MacBooks' worth of this machine's cores
(CPU quotas 0.8, 0.4 and 0.4 of a core, under its two so the sum is measurable). Each round:
- each host's solo rate: `raytrm train` of the model on that host alone, no Ray (samples/s over its steady steps);
- the three solo runs again, side by side: on separate Macs nothing is shared, while the rig's hosts share this
  machine's caches and memory bandwidth, so each trains slower beside the others' compute, cluster or not;
- then, at each LAN rate (tc tbf on every host's attachment, both ends), `raytrm cluster head` on the Studio,
  `cluster join` on the MacBooks, and `raytrm train --address auto` from the Studio: one worker a host, shares
  balanced by speed, the sync mode chosen from the measured link (`auto`, or --sync-modes; a mode with /elastic,
  auto/elastic, runs through raytrm's own actors, `raytrm train --elastic`, rather than Ray Train's; one with
  /apart, auto/elastic/apart, keeps every process but the training workers, Ray's daemons and the driver, outside the
  hosts' quotas, benchmarks.rig_cpu.RayApart: on a Mac of 8 to 24 cores they take a percent of it, on a host of 0.4
  of a core a tenth).
A row's figure is the run's samples/s over the sum of the round's solo rates (the issue's goal: 0.90 unshaped,
0.85 at 100 Mbit/s, 0.80 at 20 Mbit/s), and over the sum side by side (what distribution itself costs: Ray, the
sync, the shares); with several rounds, the medians of the rounds' ratios. A row also gives the fastest worker's
idle share of a round (its wait for the slowest, benchmarks.rig.fastest_idle), and a run's line each host's cores,
its worker's and the rest (benchmarks.rig_cpu). Every worker and every solo run trains on one thread, the quota's
worth of one core at most.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import statistics
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.link import RUN_SECONDS, STEP_SECONDS, check_rates
from benchmarks.link_models import LinkModel, mode_settings, trm_model
from benchmarks.link_runs import read_run
from benchmarks.rig_cpu import CpuWatch, RayApart
from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.train.run.metrics import read_metrics
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
    idle: float | None = None  # the fastest worker's idle share of a round (see fastest_idle)
    sync_share: float | None = None  # the run's share of a step spent in the sync (its wait for the others too)
    #: Each host's cores over the run's steady steps: its worker's, and every other process's (Ray's daemons, Ray
    #: Train's actors, the driver), by host name.
    cores: dict[str, dict[str, float]] = field(default_factory=dict)
    load: float = 0.0
    error: str = ""


#: A mode's suffixes: a run through raytrm's own actors (`raytrm train --elastic`) rather than Ray Train's; every
#: process but the training workers outside the hosts' quotas (benchmarks.rig_cpu.RayApart).
ELASTIC, APART = "elastic", "apart"


def split_mode(mode: str) -> tuple[str, bool, bool]:
    """A bench mode (auto, local:5, auto/elastic, auto/elastic/apart) as the sync mode, whether the run is elastic
    and whether Ray's processes run apart from the quotas."""
    sync, *suffixes = mode.split("/")
    unknown = [s for s in suffixes if s not in (ELASTIC, APART)]
    if unknown or len(set(suffixes)) != len(suffixes):
        raise UserError(f"bench mode {mode!r}: expected a sync mode, then /{ELASTIC} and /{APART} each at most once")
    return sync, ELASTIC in suffixes, APART in suffixes


def rig_experiment(model: LinkModel, mode: str | None) -> dict[str, Any]:
    experiment = copy.deepcopy(model.experiment)
    experiment["training"]["threads"] = 1
    if mode is not None:
        experiment["training"].update(mode_settings(split_mode(mode)[0]))
    return experiment


def train_on(host: Host, experiment: dict[str, Any], model: LinkModel, run_dir: Path, *flags: str) -> dict[str, Any]:
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
    flags = ("--address", "auto", *(["--elastic"] if split_mode(mode)[1] else [])) if host == "all" else ()
    driver = rig["studio"] if host == "all" else rig[host]
    run_dir = runs_dir / f"{host}-{rate}-{mode.replace(':', '').replace('/', '-')}-{r}"
    try:
        watch = (
            CpuWatch(list(rig.hosts.values()), run_dir, model.warmup + 1, model.steps - 2) if host == "all" else None
        )
        apart = RayApart(rig) if host == "all" and split_mode(mode)[2] else contextlib.nullcontext()
        with apart, watch or contextlib.nullcontext():
            figures = train_on(driver, rig_experiment(model, mode if host == "all" else None), model, run_dir, *flags)
        cores = watch.cores() if watch is not None else None
        run.cores = {name: asdict(used) for name, used in (cores or {}).items()}
        run.samples_per_sec, run.quality = figures["samples_per_sec"], figures["quality"]
        run.chosen, run.reason = figures["chosen"], figures["reason"]
        run.shares = _shares(run_dir)
        run.idle = fastest_idle(run_dir, model) if host == "all" else None
        run.sync_share = figures["sync_share"]
    except (RuntimeError, OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
        run.error = str(e)
    run.load = os.getloadavg()[0]
    logger.info("%s", _line(run))
    return run


def _shares(run_dir: Path) -> list[int]:
    summary = json.loads((run_dir / "summary.json").read_text())
    shares = summary.get("shares") or []
    return [int(s) for s in shares] if isinstance(shares, list) else []


def fastest_idle(run_dir: Path, model: LinkModel) -> float | None:
    """The fastest worker's (most samples a second) idle share of a round, median over the run's steady rounds: the
    slowest worker's compute less its own, over the round's time (the slowest's compute and sync). A worker's row
    holds its round's steps averaged, so a round and a step give the same share."""
    shares = []
    for row in read_metrics(run_dir / "metrics.jsonl"):
        workers = row.get("workers")
        if "event" in row or not workers or row.get("step", 0) <= model.warmup:
            continue
        fast = max(workers, key=lambda w: w["samples_per_sec"])
        slow = max(workers, key=lambda w: w["compute_s"])
        span = slow["compute_s"] + slow["sync_s"]
        if span > 0:
            shares.append((slow["compute_s"] - fast["compute_s"]) / span)
    return statistics.median(shares) if shares else None


def _line(run: RigRun) -> str:
    where = f"round {run.round} {run.host} {run.rate} {run.mode}"
    if run.error:
        return f"{where}: FAILED: {run.error.splitlines()[0]}"
    chose = f"; chose {run.chosen}: {run.reason}" if run.chosen else ""
    shares = f", shares {run.shares}" if run.shares else ""
    figures = f", the fastest idle {run.idle:.1%} of a round" if run.idle is not None else ""
    figures += f", sync {run.sync_share:.1%} of a step" if run.sync_share is not None else ""
    if run.cores:
        used = (f"{name} {c['worker']:.3f} + {c['others']:.3f}" for name, c in run.cores.items())
        figures += f", cores (its worker + the rest): {', '.join(used)}"
    return (
        f"{where}: {run.samples_per_sec:.2f} samples/s{shares}{figures}, quality {run.quality} (load {run.load:.1f})"
        f"{chose}"
    )


def join(rig: Rig, name: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """A MacBook joins the Studio's cluster (flags: `cluster join`'s own, --node-ip ADDRESS); what it printed."""
    return rig[name].raytrm(
        "cluster", "join", rig.address("studio"), "--tier", WORKER_TIER, *flags, check=True, timeout=300
    )


def _start_cluster(rig: Rig) -> None:
    rig["studio"].raytrm("cluster", "head", "--tier", HEAD_TIER, check=True, timeout=300)
    for name in ("mba", "mbp"):
        join(rig, name)


def _stop_cluster(rig: Rig) -> None:
    for name in ("mbp", "mba", "studio"):
        rig[name].raytrm("cluster", "stop", timeout=300)


def _together(rig: Rig, r: int, together: dict[str, LinkModel], runs_dir: Path) -> list[RigRun]:
    """The three hosts' solo runs side by side, each alone (no Ray, no sync): what each trains while the others'
    compute shares this machine's caches and memory, as the cluster's workers do (separate Macs share nothing)."""
    with ThreadPoolExecutor(len(HOSTS)) as pool:
        started = [pool.submit(_run, rig, r, h.name, "-", "together", together[h.name], runs_dir) for h in HOSTS]
        return [f.result() for f in started]


def measure(
    rig: Rig,
    model: LinkModel,
    solo: LinkModel,
    together: dict[str, LinkModel],
    rates: list[str],
    modes: list[str],
    rounds: int,
    runs_dir: Path,
) -> list[RigRun]:
    """Every round: each host's solo run (of `solo`: the model, fewer steps), the three solo side by side (of
    `together`'s models: steps in proportion to each host's quota, so that they end together), then each (rate,
    mode) across the three, the rates' order reversed every other round."""
    runs: list[RigRun] = []
    for r in range(rounds):
        runs += [_run(rig, r, h.name, "-", "solo", solo, runs_dir) for h in HOSTS]
        runs += _together(rig, r, together, runs_dir)
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
    solo_sum: float | None  # each host alone, one after another
    ratio: float | None
    together_sum: float | None  # the three solo side by side (None: not measured)
    together_ratio: float | None
    goal: float | None
    idle: float | None  # the fastest worker's idle share of a round (median over rounds)
    chosen: list[str]
    runs: int
    failed: int


def _sums(runs: list[RigRun], mode: str) -> dict[int, float]:
    """Each round's sum of the solo rates of `mode` (solo: one after another; together: side by side); NaN where
    one failed."""
    sums: dict[int, float] = {}
    for run in runs:
        if run.host != "all" and run.mode == mode:
            sums[run.round] = sums.get(run.round, 0.0) + (run.samples_per_sec or float("nan"))
    return sums


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def rows_of(runs: list[RigRun]) -> list[RigRow]:
    """One row per (rate, mode): the median over rounds of the run's rate and of its ratios to its round's solo sums
    (the goal is read against the hosts alone; side by side is what the rig's shared machine allows)."""
    solo, together = _sums(runs, "solo"), _sums(runs, "together")
    rows: list[RigRow] = []
    for key in dict.fromkeys((r.rate, r.mode) for r in runs if r.host == "all"):
        mine = [r for r in runs if r.host == "all" and (r.rate, r.mode) == key]
        ok = [r for r in mine if not r.error and r.samples_per_sec and solo.get(r.round) == solo.get(r.round)]
        side = [r for r in ok if together.get(r.round) == together.get(r.round) and r.round in together]
        rows.append(
            RigRow(
                rate=key[0],
                mode=key[1],
                samples_per_sec=_median([r.samples_per_sec for r in ok]),
                solo_sum=_median([solo[r.round] for r in ok]),
                ratio=_median([r.samples_per_sec / solo[r.round] for r in ok]),
                together_sum=_median([together[r.round] for r in side]),
                together_ratio=_median([r.samples_per_sec / together[r.round] for r in side]),
                goal=GOALS.get(key[0]),
                idle=_median([r.idle for r in ok if r.idle is not None]),
                chosen=sorted({r.chosen for r in ok if r.chosen}),
                runs=len(mine),
                failed=len(mine) - len(ok),
            )
        )
    return rows


def _figure(value: float | None, form: str) -> str:
    return format(value, form) if value is not None else "-"


def format_rows(rows: list[RigRow], runs: list[RigRun]) -> str:
    lines = [
        f"solo rates ({mode}, samples/s): " + ", ".join(f"{r.host} {r.samples_per_sec}" for r in runs if r.mode == mode)
        for mode in ("solo", "together")
        if any(r.mode == mode for r in runs)
    ]
    lines.append(
        f"{'rate':<10} {'mode':<12} {'samples/s':>9} {'solo sum':>9} {'ratio':>6} {'side by side':>12} {'ratio':>6} "
        f"{'goal':>5} {'idle':>6}  chosen"
    )
    for row in rows:
        failed = f"  ({row.failed} of {row.runs} failed)" if row.failed else ""
        figures = [
            f"{_figure(row.samples_per_sec, '.2f'):>9}",
            f"{_figure(row.solo_sum, '.2f'):>9}",
            f"{_figure(row.ratio, '.3f'):>6}",
            f"{_figure(row.together_sum, '.2f'):>12}",
            f"{_figure(row.together_ratio, '.3f'):>6}",
            f"{_figure(row.goal, '.2f'):>5}",
            f"{_figure(row.idle, '.1%'):>6}",
        ]
        lines.append(f"{row.rate:<10} {row.mode:<12} {' '.join(figures)}  {'; '.join(row.chosen)}{failed}")
    return "\n".join(lines)


PARTS = ("scaling", "asleep", "killed", "paths")


def run(
    parts: list[str], rates: list[str], modes: list[str], steps: int, solo_steps: int, rounds: int, work_dir: Path
) -> dict[str, Any]:
    """The bench as `python -m benchmarks rig` runs it: the rig made once (and removed whatever happens), the
    scaling part, then the elastic parts (benchmarks.rig_elastic) after an undisturbed elastic run; then the
    two-path pair (benchmarks.rig_paths, a rig of its own, `rounds` trials); prints the tables, returns the rows and
    runs."""
    from benchmarks import rig_elastic, rig_paths  # they use this module's runs and joins

    reason = cannot_make_hosts(cpu=True)
    if reason:
        raise UserError(f"the rig's three hosts are network namespaces with CPU quotas, not possible here: {reason}")
    check_rates(rates)
    for mode in modes:
        mode_settings(split_mode(mode)[0])
    model, solo = trm_model(work_dir, steps=steps), trm_model(work_dir, steps=solo_steps)
    least = min(h.cpu or 1.0 for h in HOSTS)
    together = {h.name: trm_model(work_dir, steps=round(solo_steps * (h.cpu or 1.0) / least)) for h in HOSTS}
    out: dict[str, Any] = {"model": model.description, "steps": steps, "solo_steps": solo_steps}
    runs_dir = work_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    elastic_parts = [p for p in parts if p in rig_elastic.DISTURB]
    if "scaling" in parts or elastic_parts:
        with Rig(work_dir / "hosts", list(HOSTS)) as rig:
            rig.share_token()
            if "scaling" in parts:
                runs = measure(rig, model, solo, together, rates, modes, rounds, runs_dir)
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
    if "paths" in parts:
        pair = rig_paths.measure(work_dir / "paths", model, modes[0], rounds)
        print(rig_paths.format_runs(pair))
        out["paths"] = {**rig_paths.summary(pair), "runs": [asdict(r) for r in pair]}
    return out
