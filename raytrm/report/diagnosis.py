"""What limited a training run, read from what it recorded, each finding with its fix.

Every rule reads only fields a run writes (raytrm/report/runs.py lists them) and stays silent where they are
missing: a run without a memory budget gets no memory finding, one without workers no sync finding. Data loading
time and the machine's core count are not recorded, so nothing is said about them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raytrm.config import THERMAL_STATES
from raytrm.distributed.run_logs import DRIVER_LOG, LOGS_DIR
from raytrm.report.runs import RunRecord
from raytrm.train.run import health
from raytrm.train.run.thermal_guard import GuardSettings

#: A peak under half the budget leaves as much memory unused as the step uses: the micro-batch could at least double
#: before the governor's own target (90% of the budget), which is what a tuned profile would spend.
HEADROOM_FRACTION = 0.5
#: Apple documents "fair" as slightly elevated with no action taken, "serious" as the system reducing performance.
THROTTLED_STATE = "serious"
#: The thermal guard's own reading of a throughput fall as throttling, at constant work.
THROUGHPUT_DECAY = GuardSettings().decline
#: Under this many steady lines, the median of a quarter is one or two lines: noise, not a trend.
MIN_TREND_LINES = 8
#: psutil's cpu_percent counts 100 per busy core; a compute-bound step keeps its threads busy most of the time, so
#: under 60% of (threads x 100) the threads mostly wait.
CPU_BUSY_FRACTION = 0.6
#: A fifth of each step spent summing gradients: a larger batch per all-reduce would buy most of it back.
SYNC_SHARE = 0.2
#: Workers idle a mean 15% of the step waiting for the slowest: three times the gain (5%) at which the balancer
#: moves shares, so a gap it would have closed had it been allowed to.
STRAGGLER_IDLE = 0.15
#: A fifth of the wall time outside training steps (evaluation, checkpoints, pauses) is a fifth fewer samples in a
#: time budget.
OUTSIDE_SHARE = 0.2

NOT_RECORDED = ("data loading time (it is inside each step's time)", "the machine's core count (threads vs cores)")


@dataclass
class Finding:
    """One limit of the run: what the record shows, and what to change."""

    name: str
    measured: str
    fix: str

    def format(self) -> str:
        return f"- {self.name}: {self.measured}\n  fix: {self.fix}"


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v == v]  # NaN-free
    return statistics.median(values) if values else None


def _settled(values: list[Any]) -> list[Any]:
    """Values past the first one, which carries warm-up (first allocations, thread pools) when there are more."""
    return values[1:] if len(values) > 1 else values


def peak_memory(record: RunRecord) -> tuple[float, str] | None:
    """The highest memory the run's training steps reached, and where it was read: the steps' own measured peak
    when the run finished, else the process's peak RSS from metrics.jsonl (which also counts whatever the process
    held before training, e.g. another run in the same Python process)."""
    summary = record.summary or {}
    if summary.get("peak_step_mb"):
        return float(summary["peak_step_mb"]), f"step peak ({summary.get('peak_method') or 'measured'})"
    _, peaks = record.series("peak_rss_mb")
    return (float(peaks.max()), "peak RSS") if len(peaks) else None


def memory_findings(record: RunRecord) -> list[Finding]:
    found = []
    budget, peak = record.budget_mb, peak_memory(record)
    worker = " of rank 0" if record.worker_rows else ""
    if budget and peak:
        mb, source = peak
        share = mb / budget
        if share > 1:
            found.append(
                Finding(
                    "over the memory budget",
                    f"{source}{worker} {mb:.0f} MiB is {share:.0%} of the {budget:.0f} MiB budget",
                    "lower --micro-batch, or raise --memory-budget-mb if the machine has the memory free",
                )
            )
        elif share < HEADROOM_FRACTION:
            local, micro = _batch_cut(record)
            if micro is not None and micro < local:
                fix = (
                    f"raise --micro-batch towards {local} (fewer accumulation passes over the same samples, the same "
                    "gradient), or run `raytrm tune` to pick it for this machine"
                )
            else:
                whole = "this worker's whole share" if record.worker_rows else "the whole batch"
                fix = (
                    f"{whole} ({local} samples) already runs as one micro-batch: the budget has room for a larger "
                    "--global-batch (retune --lr with it) or a larger model; `raytrm tune` searches both"
                )
            found.append(
                Finding(
                    "memory headroom unused",
                    f"{source}{worker} {mb:.0f} MiB is {share:.0%} of the {budget:.0f} MiB budget"
                    + (f", at micro-batch {micro}" if micro else ""),
                    fix,
                )
            )
    pressure = [e for e in record.events if e["event"] == "shrink" and "pressure" in str(e.get("reason"))]
    if pressure:
        found.append(
            Finding(
                "memory pressure",
                f"the system ran short of memory: the governor shrank the micro-batch {len(pressure)} time(s) "
                f"(first at step {pressure[0]['step']})",
                "close other memory-hungry processes, or lower --memory-budget-mb so the run starts at a cut the "
                "machine can keep",
            )
        )
    oom = [e for e in record.events if e["event"] == "out-of-memory"]
    if oom:
        found.append(
            Finding(
                "out of memory",
                f"the allocator refused {len(oom)} step(s) (first at step {oom[0]['step']}); each was redone smaller",
                "lower --memory-budget-mb to what the device has free, so the governor's fit starts below it",
            )
        )
    return found


def _batch_cut(record: RunRecord) -> tuple[int, int | None]:
    """(samples this worker holds per step, its largest micro-batch), from the last record of them."""
    rows = record.worker_rows
    if rows:
        mine = next((w for w in rows[-1][1] if w.get("rank") == 0), rows[-1][1][0])
        return int(mine.get("share") or record.config.training.global_batch_size), mine.get("micro_batch")
    cuts = (record.summary or {}).get("micro_batches")
    if cuts:
        return record.config.training.global_batch_size, max(cuts)
    chosen = [e["micro_batch_to"] for e in record.events if "micro_batch_to" in e and not e.get("rank")]
    return record.config.training.global_batch_size, chosen[-1] if chosen else record.config.training.micro_batch


def throughput_decay(record: RunRecord) -> tuple[float, int, int] | None:
    """(fall of samples/s from the first to the last quarter, first step, last step) of the stretch after the last
    event, when it is long enough to read a trend: events change the work of a step, so only a stretch free of them
    compares like with like."""
    last_event = max((e["step"] for e in record.events), default=0)
    lines = _settled([line for line in record.steps if line["step"] > last_event])
    rates = [(line["step"], line.get("samples_per_sec")) for line in lines]
    rates = [(s, r) for s, r in rates if isinstance(r, (int, float)) and r > 0]
    if len(rates) < MIN_TREND_LINES:
        return None
    quarter = len(rates) // 4
    head = statistics.median(r for _, r in rates[:quarter])
    tail = statistics.median(r for _, r in rates[-quarter:])
    return 1 - tail / head, rates[0][0], rates[-1][0]


def thermal_findings(record: RunRecord) -> list[Finding]:
    seen = [line["thermal_state"] for line in record.steps if line.get("thermal_state") in THERMAL_STATES]
    hot = [s for s in seen if THERMAL_STATES.index(s) >= THERMAL_STATES.index(THROTTLED_STATE)]
    guard = [e["event"] for e in record.events if str(e["event"]).startswith("thermal-")]
    lowered, paused = guard.count("thermal-lower-load"), guard.count("thermal-pause")
    decay = throughput_decay(record)
    evidence = []
    if hot:
        hottest = max(hot, key=THERMAL_STATES.index)
        evidence.append(
            f"thermal state {THROTTLED_STATE} or hotter in {len(hot)} of {len(seen)} readings (hottest {hottest})"
        )
    acted = [f"lowered the load {lowered} time(s)" if lowered else "", f"paused {paused} time(s)" if paused else ""]
    if lowered or paused:
        evidence.append(f"the thermal guard {' and '.join(a for a in acted if a)}")
    if decay and decay[0] >= THROUGHPUT_DECAY:
        sensed = seen or len(record.series("temperature_c")[0])
        cause = "" if sensed else " (no sensor answered: this is how heat shows, and so does other load on the machine)"
        evidence.append(f"samples/s fell {decay[0]:.0%} over steps {decay[1]}-{decay[2]} at unchanged settings{cause}")
    if not evidence:
        return []
    return [
        Finding(
            "throttled",
            "; ".join(evidence),
            "cool the machine (a stand, lid open, nothing else heavy running) or give it less at once (--threads); "
            "plan with the sustained rate: `raytrm tune` measures over a window long enough to see the decline",
        )
    ]


def cpu_findings(record: RunRecord) -> list[Finding]:
    threads = record.threads
    _, cpu = record.series("cpu_percent")
    busy = _median(_settled(list(cpu)))
    if not threads or busy is None or busy >= CPU_BUSY_FRACTION * 100 * threads:
        return []
    return [
        Finding(
            "CPU under-used",
            f"{threads} torch thread(s) kept {busy / 100:.1f} cores busy on median (cpu_percent {busy:.0f}%)",
            "the threads wait: on other processes sharing the cores (check `top`), on data loading or on the "
            "gradient sync; fewer --threads may run as fast, and `raytrm tune` measures which count pays",
        )
    ]


def worker_findings(record: RunRecord) -> list[Finding]:
    """Sync and stragglers. A worker's sync_s holds its wait for slower workers too, so the all-reduce itself is
    read off the slowest worker, which waits for no one."""
    sync_shares, idle_shares, overlaps = [], [], []
    for _, rows in _settled(record.worker_rows):
        compute = [float(w.get("compute_s") or 0) for w in rows]
        slow = compute.index(max(compute))
        pure = float(rows[slow].get("sync_s") or 0)
        step = compute[slow] + pure
        if step <= 0:
            continue
        sync_shares.append(pure / step)
        idle_shares.append(statistics.mean(compute[slow] - c for c in compute) / step)
        overlaps += [w["sync_overlap"] for w in rows if isinstance(w.get("sync_overlap"), (int, float))]
    found = []
    sync, idle, overlap = _median(sync_shares), _median(idle_shares), _median(overlaps)
    if sync is not None and sync >= SYNC_SHARE:
        overlapped = f"; {overlap:.0%} of the gradient was summed while the backward still ran" if overlap else ""
        found.append(
            Finding(
                "gradient sync",
                f"the all-reduce took {sync:.0%} of each step on median{overlapped}",
                "exchange less often: local rounds (--sync-mode local, or auto to choose from the link) sum once per "
                "--sync-every steps; or a larger --global-batch (retune --lr), or a faster link (Thunderbolt, 10 GbE)",
            )
        )
    if idle is not None and idle >= STRAGGLER_IDLE:
        found.append(
            Finding(
                "workers wait for the slowest",
                f"the workers idled {idle:.0%} of each step on median waiting for the slowest one",
                "drop --equal-shares so the balancer moves samples to the faster workers, and give each tier its "
                "tuned profile (--profile per tier) so each machine's micro-batch fits it",
            )
        )
    return found


def time_findings(record: RunRecord) -> list[Finding]:
    summary = record.summary or {}
    wall, trained = summary.get("wall_seconds"), summary.get("train_seconds")
    if not wall or trained is None:
        return []
    outside = 1 - trained / wall
    if outside < OUTSIDE_SHARE:
        return []
    train = record.config.training
    evals = sum(1 for line in record.steps if any(k.startswith("eval_") for k in line))
    pauses = sum(1 for e in record.events if e["event"] == "thermal-pause")
    every = "every {} steps and at the end"
    parts = [
        f"{evals + 1} evaluation(s) ({every.format(train.eval_interval) if train.eval_interval else 'at the end'})",
        f"checkpoints ({every.format(train.checkpoint_interval) if train.checkpoint_interval else 'at the end'})",
    ]
    if pauses:
        parts.append(f"{pauses} thermal pause(s)")
    short = "" if train.eval_interval or train.checkpoint_interval else "; in a run this short, the final ones alone"
    return [
        Finding(
            "time outside training steps",
            f"{outside:.0%} of the {wall:.1f} s wall time went to {', '.join(parts)}{short}",
            "raise --eval-interval and --checkpoint-interval (the final evaluation and checkpoint always run)",
        )
    ]


def health_findings(record: RunRecord) -> list[Finding]:
    """What the run's health checks found as it trained, in their own words (the warning line's reason and fix)."""
    found = [health.Finding.from_event(event) for event in record.events]
    return [Finding(f.name, f"{f.reason} (step {f.step})", f.fix) for f in found if f is not None]


def log_lines(record: RunRecord) -> list[str]:
    """Where the lines the terminal did not show are: a distributed run's log files (RUN_DIR/logs)."""
    logs = record.run_dir / LOGS_DIR
    found = sorted(
        logs.glob("*.log"), key=lambda p: (p.name != DRIVER_LOG, int("".join(filter(str.isdigit, p.name)) or 0))
    )
    if not found:
        return []
    return [
        f"logs in {logs}: {', '.join(p.name for p in found)} (the driver's and Ray's lines, each worker's INFO lines)"
    ]


def stop_findings(record: RunRecord) -> list[Finding]:
    """A run that stopped early (interrupted, early stop) says so; steps reached and time budgets are its plan."""
    reason = str((record.summary or {}).get("stop_reason") or "")
    if not reason.startswith(("interrupted", "early stop")):
        return []
    fix = (
        "continue it with `raytrm train --out RUN_DIR --resume` (its last checkpoint was saved at the stop)"
        if reason.startswith("interrupted")
        else "the finding above says why; fix it and start a new run"
    )
    return [Finding("stopped early", reason, fix)]


RULES: tuple[Callable[[RunRecord], list[Finding]], ...] = (
    health_findings,
    stop_findings,
    memory_findings,
    thermal_findings,
    cpu_findings,
    worker_findings,
    time_findings,
)


def diagnose(record: RunRecord) -> list[Finding]:
    """Every finding of every rule, in the order of RULES."""
    return [finding for rule in RULES for finding in rule(record)]
