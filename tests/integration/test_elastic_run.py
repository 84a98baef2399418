"""`raytrm train --elastic` on a local Ray: a worker stopped mid-run (a lid closed) costs the other a deadline, not a
restart, and comes back into the run with a live peer's state."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from raytrm.cli import main
from raytrm.distributed.ray_train import train_distributed
from raytrm.train.run.metrics import read_metrics
from tests.integration.test_distributed_train import experiment, puzzles  # noqa: F401 (a fixture)
from tests.support.elastic_training import steps_logged

pytestmark = pytest.mark.slow


def _pid(run_dir, rank: int, timeout: float = 240) -> int:
    """A worker's pid, from the line it logs as it starts."""
    path = run_dir / "logs" / f"worker-{rank}.log"
    end = time.time() + timeout
    while time.time() < end:
        if path.exists():
            found = re.search(r"worker w\d+ \(pid (\d+)\)", path.read_text())
            if found:
                return int(found.group(1))
        time.sleep(0.2)
    raise AssertionError(f"no pid in {path}")


def _deadline(run_dir) -> float | None:
    """The collectives' deadline the run measured (its `deadline` event in metrics.jsonl), None before it."""
    path = run_dir / "metrics.jsonl"
    events = [r for r in read_metrics(path) if r.get("event") == "deadline"] if path.exists() else []
    return events[-1]["deadline_s"] if events else None


def test_a_stopped_worker_costs_a_deadline_and_comes_back(ray_cluster, puzzles, tmp_path, capsys):  # noqa: F811
    config = experiment(puzzles, steps=120)
    run_dir = tmp_path / "run"
    done: dict = {}
    runner = threading.Thread(
        target=lambda: done.update(summary=train_distributed(config, run_dir, workers=2, progress=False, elastic=True))
    )
    runner.start()
    second = _pid(run_dir, 1)
    end = time.time() + 300
    while (_deadline(run_dir) is None or steps_logged(run_dir) < 25) and time.time() < end:  # the deadline measured
        time.sleep(0.2)
    deadline = _deadline(run_dir)
    assert deadline is not None, "the run logged no deadline event in 300 s"
    os.kill(second, signal.SIGSTOP)
    # Stopped for longer than twice the deadline, however long a loaded machine's steps made it: the other worker
    # gives it up at the deadline, then goes on alone for a while before it answers again.
    time.sleep(max(8.0, 2 * deadline + 2))
    os.kill(second, signal.SIGCONT)
    runner.join(timeout=600)
    summary = done["summary"]
    assert summary["steps"] == 120
    changes = summary["membership"]
    left = [c for c in changes if c["left"] == ["w01"]]
    entered = [c for c in changes if c["entered"] == ["w01"]]
    assert left and entered and left[0]["step"] < entered[0]["step"]
    assert left[0]["waited_s"] < left[0]["deadline_s"] + 10  # the measured deadline, not the first 60 s
    # The deadline was measured after the first step (its one-time costs), and again from a steady step past step 10.
    timed = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("event") == "deadline"]
    assert [t["step"] for t in timed][:1] == [1] and timed[0]["from_s"] == 60.0 and timed[0]["deadline_s"] < 60.0
    assert summary["workers"] == 2  # back together at the end
    # `raytrm report` reads the run, its membership events among its lines, and says who left and who came back.
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"  step {left[0]['step']}: w01 left (the others waited " in out, out
    assert f"  step {entered[0]['step']}: w01 entered with a live peer's state; 2 training (w00, w01)" in out, out
