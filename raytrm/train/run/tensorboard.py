"""TensorBoard event files beside metrics.jsonl, written when the tensorboard package is installed.

metrics.jsonl stays the record (resume, `raytrm report` and the tests read it); RUN_DIR/tensorboard/ is a view of
the same lines for `tensorboard --logdir RUN_DIR/tensorboard`. Without the package nothing is written or said.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

from raytrm.config import THERMAL_STATES

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
#: Seconds between flushes to disk: short enough to watch a run live, long enough to cost nothing per step.
FLUSH_SECS = 10
#: TensorBoard draws one section per tag prefix; keys not listed here are under train/, eval_* under eval/.
SECTIONS = {
    "samples_per_sec": "throughput",
    "tokens_per_sec": "throughput",
    "rss_mb": "memory",
    "peak_rss_mb": "memory",
    "cpu_percent": "system",
    "temperature_c": "system",
    "thermal_state": "system",
}
#: The numbers of a per-worker row, under worker<rank>/.
WORKER_KEYS = ("share", "samples_per_sec", "compute_s", "sync_s", "sync_overlap", "micro_batch", "share_cap")


def tag(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl key."""
    if key.startswith("eval_"):
        return f"eval/{key.removeprefix('eval_')}"
    return f"{SECTIONS.get(key, 'train')}/{key}"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of one step line by tag: its numbers, the thermal state as its rank (nominal 0 .. critical 3),
    and each worker's row with the share of its step spent in the gradient sync."""
    out = {}
    for key, value in record.items():
        if key == "step":
            continue
        if key == "thermal_state" and value in THERMAL_STATES:
            out[tag(key)] = float(THERMAL_STATES.index(value))
        elif _number(value):
            out[tag(key)] = float(value)
    for row in record.get("workers") or []:
        prefix = f"worker{row.get('rank')}"
        out.update({f"{prefix}/{key}": float(row[key]) for key in WORKER_KEYS if _number(row.get(key))})
        compute, sync = row.get("compute_s"), row.get("sync_s")
        if _number(compute) and _number(sync) and compute + sync > 0:
            out[f"{prefix}/sync_share"] = sync / (compute + sync)
    return out


class TensorBoardSink:
    """Writes each metrics line to TensorBoard: step lines as scalars, events (governor, thermal guard, rebalance)
    as text at their step."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # As metrics.jsonl drops the lines past the resumed step (all of them on a fresh start), TensorBoard hides
        # the events of earlier writers from the purge step on.
        purge = 0 if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(str(Path(run_dir) / TENSORBOARD_DIR), purge_step=purge, flush_secs=FLUSH_SECS)

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        if "event" in record:
            rank = f" (rank {record['rank']})" if "rank" in record else ""
            self.writer.add_text("events", f"{record['event']}{rank}: {record.get('reason', '')}", step)
            return
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


def available() -> bool:
    """Whether the tensorboard package is installed (found without importing it)."""
    return importlib.util.find_spec("tensorboard") is not None


def open_sink(run_dir: str | Path, resume_step: int | None = None) -> TensorBoardSink | None:
    """A sink when tensorboard is installed, else None, quietly: TensorBoard is an optional extra."""
    if not available():
        return None
    try:
        return TensorBoardSink(run_dir, resume_step)
    except ImportError as e:  # installed, but torch cannot use it (a version it does not know)
        logger.warning("tensorboard is installed but unusable (%s); metrics.jsonl only", e)
        return None
