"""The sync across workers as `raytrm report` tells it: the mode each choice took, when and why, and the share of
the steps the workers spent waiting on each other (summary.json's, else the metrics lines')."""

from __future__ import annotations

import math
from typing import Any

from raytrm.report.runs import RunRecord


def _choice(event: dict[str, Any]) -> str:
    every = f" H={event['every']}" if event.get("every") else ""
    overlap = f", the exchange {event['overlap']} step(s) behind" if event.get("overlap") else ""
    measured = event.get("measured_share")
    drift = f" (measured share {measured:.1%})" if isinstance(measured, (int, float)) else ""
    return f"  step {event['step']}: {event['mode']}{every}{overlap}{drift}: {event.get('reason', '')}"


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
