"""The sync across workers as `raytrm report` tells it: the mode each choice took, when and why, the share of the
steps the workers spent waiting on each other, and in an `--elastic` run who left and who entered (summary.json's,
else the metrics lines')."""

from __future__ import annotations

import math
from typing import Any

from raytrm.report.runs import RunRecord
from raytrm.sync.link import mbit_text


def _choice(event: dict[str, Any]) -> str:
    every = f" H={event['every']}" if event.get("every") else ""
    overlap = f", the exchange {event['overlap']} step(s) behind" if event.get("overlap") else ""
    measured = event.get("measured_share")
    drift = f" (measured share {measured:.1%}{_link_change(event)})" if isinstance(measured, (int, float)) else ""
    return f"  step {event['step']}: {event['mode']}{every}{overlap}{drift}: {event.get('reason', '')}"


def _link_change(event: dict[str, Any]) -> str:
    """A choice made again on drift: the link measured again, through which interface, against the one before."""
    now, before = event.get("link"), event.get("link_before")
    if not now or not before:
        return ""
    through = f" through {event['interface']}" if event.get("interface") else ""
    rates = f"{mbit_text(now['mbit_s'])} Mbit/s, {mbit_text(before['mbit_s'])}"
    return f"; the link{through} {rates} at step {before['step']}"


def sync_lines(record: RunRecord) -> list[str]:
    """The report's lines on sync: the share of waiting (the run's and each worker's), then every choice."""
    choices = [e for e in record.events if e.get("event") == "sync-choice"]
    summary = record.summary or {}
    shares = summary.get("sync_share") or {}
    if not choices and not shares:
        return []
    if shares:
        workers = ", ".join(f"{s:.1%}" for s in shares.get("workers", []))
        share = f"{shares.get('run', math.nan):.1%} of step time waiting on sync (workers {workers})"
    else:
        _, values = record.series("sync_share")
        share = f"{float(values.mean()):.1%} of step time waiting on sync (rank 0)" if len(values) else "share unknown"
    mode = summary.get("sync_mode") or (choices[-1]["mode"] if choices else "?")
    every = f" H={summary['sync_every']}" if summary.get("sync_every") else ""
    return [f"sync: {mode}{every}, {share}; its choices:", *(_choice(e) for e in choices)]


def membership_lines(record: RunRecord) -> list[str]:
    """The report's lines on the workers of a run whose Macs came and went (`--elastic`): every change of who trains
    together, at its step: who left and what the others waited, who entered, and the seconds the change took."""
    changes = (record.summary or {}).get("membership")
    if changes is None:
        changes = [e for e in record.events if e.get("event") == "membership" and "workers" in e]
    if not changes:
        return []
    return [
        f"workers: {len(changes)} change(s) of who trains together, none restarting the run:",
        *map(_change, changes),
    ]


def _change(change: dict[str, Any]) -> str:
    moves = []
    if change.get("left"):
        waited = (
            f"{change.get('waited_s', math.nan):.1f} s against a deadline of {change.get('deadline_s', math.nan):.1f} s"
        )
        moves.append(f"{', '.join(change['left'])} left (the others waited {waited})")
    if change.get("entered"):
        moves.append(f"{', '.join(change['entered'])} entered with a live peer's state")
    if not moves:
        moves.append("the same workers again, after a collective failed")
    workers = change.get("workers") or []
    took = f", the change {change['seconds']:.1f} s" if isinstance(change.get("seconds"), (int, float)) else ""
    return f"  step {change['step']}: {'; '.join(moves)}; {len(workers)} training ({', '.join(workers)}){took}"
