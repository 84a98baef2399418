"""`python -m benchmarks rig --parts asleep killed`: the three hosts of benchmarks.rig train with `raytrm train
--elastic` while a MacBook leaves, against the same run undisturbed.

- asleep: past step STOP_AT the MacBook's whole host is stopped (SIGSTOP: every process, Ray's too) for ASLEEP_S,
  long past Ray's health checks, so Ray declares its node dead; continued, its Ray is gone, and the user's
  `raytrm cluster join` (after `cluster stop`) makes it a new node, where the driver starts a worker that asks to
  join and enters at the next boundary with a live peer's state.
- killed: past step STOP_AT the MacBook's host is killed (every process) and a fresh host takes its place (a new
  HOME and /tmp/ray, the same addresses), which joins the cluster.

Every run trains the same steps (the global batch stays, so the same samples) with exact sync, one thread a worker.
A row gives what the change cost the others (the wait at the lost collective against its deadline, the slowest
step), when the MacBook came back (steps and seconds from its `cluster join` to its entry), whether any step was
trained twice or the group restarted, and the final quality against the undisturbed run's (the goal: within 0.01).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.link_models import QUALITY, LinkModel, mode_settings
from benchmarks.rig import join
from raytrm import config as cfg
from raytrm.train.loop import ADMIT_EVERY
from raytrm.train.run.metrics import read_metrics
from tests.support.elastic_training import steps_logged
from tests.support.hosts import Rig

#: Steps before the MacBook leaves: past step ADMIT_EVERY, where the run's deadline is taken from measured steps.
STOP_AT = ADMIT_EVERY + 5
#: How long the MacBook sleeps: past Ray's health checks, which declare its node dead.
ASLEEP_S = 60.0
LEAVER = "mbp"
RUN_TIMEOUT_S = 1800


@dataclass
class ElasticRun:
    part: str  # undisturbed, asleep or killed
    steps: int = 0
    seconds: float = 0.0
    quality: float | None = None
    left_step: int | None = None
    waited_s: float | None = None  # the others' wait at the collective the MacBook missed
    deadline_s: float | None = None
    change_s: float | None = None  # the next membership, once the wait was over
    back_at_step: int | None = None  # the step when its `cluster join` returned
    entered_step: int | None = None
    back_to_entry_s: float | None = None  # the steps' time from its join's return to its entry
    median_step_s: float | None = None
    slowest_step_s: float | None = None  # the others' slowest step while it was away, the change's included
    steps_twice: int = 0  # steps logged more than once (work redone)
    steps_missing: int = 0
    changes: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""


def _config(model: LinkModel, run_dir: Path) -> Path:
    experiment = json.loads(json.dumps(model.experiment))
    experiment["training"].update(threads=1, log_interval=1, **mode_settings("exact"))
    config = run_dir.with_suffix(".yaml")
    cfg.write_yaml(cfg.from_dict(cfg.ExperimentConfig, experiment, "the rig's elastic run"), config)
    return config


def _step_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r and r.get("samples_per_sec")]


def _rejoin(rig: Rig) -> None:
    """The MacBook joins the cluster again, as its user would: its own Ray stopped first (`cluster stop`)."""
    rig[LEAVER].raytrm("cluster", "stop", timeout=300)
    join(rig, LEAVER)


def asleep(rig: Rig) -> None:
    rig[LEAVER].stop()
    time.sleep(ASLEEP_S)
    rig[LEAVER].cont()
    _rejoin(rig)


def killed(rig: Rig) -> None:
    token = (rig["studio"].home / ".ray" / "auth_token").read_text()
    rig.restart(LEAVER)
    rig.share_token(token)
    _rejoin(rig)


DISTURB = {"asleep": asleep, "killed": killed}


def elastic_run(rig: Rig, model: LinkModel, part: str, run_dir: Path) -> ElasticRun:
    """One `raytrm train --address auto --elastic` from the Studio, disturbed as `part` says past STOP_AT."""
    out = ElasticRun(part)
    argv = ("train", "--config", str(_config(model, run_dir)), "--address", "auto", "--elastic")
    log = run_dir.with_suffix(".log")
    start = time.monotonic()
    driver = rig["studio"].popen(sys.executable, "-m", "raytrm.cli", *argv, "--out", str(run_dir), "--quiet", log=log)
    try:
        if part in DISTURB:
            while steps_logged(run_dir) < STOP_AT and driver.poll() is None:
                time.sleep(0.5)
            if driver.poll() is not None:
                raise RuntimeError(f"the run ended before step {STOP_AT}: {log.read_text()[-2000:]}")
            DISTURB[part](rig)
            out.back_at_step = steps_logged(run_dir)
        if driver.wait(timeout=RUN_TIMEOUT_S) != 0:
            raise RuntimeError(f"the run exited {driver.returncode}: {log.read_text()[-2000:]}")
        out.seconds = time.monotonic() - start
        _read(out, run_dir, model)
    except (RuntimeError, OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
        out.error = str(e)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    return out


def _read(out: ElasticRun, run_dir: Path, model: LinkModel) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = _step_rows(run_dir)
    counts = Counter(r["step"] for r in rows)
    out.steps, out.quality = summary["steps"], summary.get(QUALITY[model.name][0])
    out.steps_twice = sum(1 for c in counts.values() if c > 1)
    out.steps_missing = sum(1 for s in range(1, out.steps + 1) if s not in counts)
    out.changes = summary.get("membership") or []
    seconds = {r["step"]: model.global_batch / r["samples_per_sec"] for r in rows}
    timed = [s for step, s in seconds.items() if step > model.warmup]
    out.median_step_s = statistics.median(timed) if timed else None
    left = next((c for c in out.changes if c.get("left")), None)
    if left is None:
        return
    out.left_step, out.waited_s = left["step"], left.get("waited_s")
    out.deadline_s, out.change_s = left.get("deadline_s"), left.get("seconds")
    entered = next((c for c in out.changes if c.get("entered") and c["step"] >= left["step"]), None)
    out.entered_step = entered["step"] if entered else None
    away = [s for step, s in seconds.items() if left["step"] <= step <= (out.entered_step or out.steps)]
    out.slowest_step_s = max(away) if away else None
    if entered and out.back_at_step is not None:  # the steps trained between its join and its entry
        between = range(out.back_at_step + 1, entered["step"] + 1)
        out.back_to_entry_s = sum(seconds.get(step, 0.0) for step in between)


def format_runs(runs: list[ElasticRun]) -> str:
    base = next((r.quality for r in runs if r.part == "undisturbed" and not r.error), None)
    lines = []
    for r in runs:
        if r.error:
            lines.append(f"{r.part}: FAILED: {r.error.splitlines()[0]}")
            continue
        median = f"median step {r.median_step_s or 0:.2f} s"
        line = f"{r.part}: {r.steps} steps in {r.seconds:.0f} s, {median}, quality {r.quality}"
        if base is not None and r.quality is not None and r.part != "undisturbed":
            line += f" ({r.quality - base:+.4f} against undisturbed)"
        if r.left_step is not None:
            line += (
                f"; left at step {r.left_step}: the others waited {r.waited_s} s (deadline {r.deadline_s} s), the next "
                f"membership {r.change_s} s, slowest step while away {r.slowest_step_s or 0:.2f} s"
            )
        if r.back_at_step is not None:
            entry = f"entered at step {r.entered_step}" if r.entered_step else "never entered"
            line += f"; joined again at step {r.back_at_step}, {entry} ({r.back_to_entry_s or 0:.1f} s of steps later)"
        line += f"; steps trained twice {r.steps_twice}, missing {r.steps_missing}"
        lines.append(line)
    return "\n".join(lines)
