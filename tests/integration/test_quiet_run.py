"""`raytrm train --workers 2 --quiet` as a person runs it, on a local Ray of its own: the terminal shows the
workers' warnings (a health finding on rank 0) and the summary, none of Ray's lines nor the workers' INFO lines; the
run's logs/ hold those, and `raytrm report` names the files."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from raytrm.constants import CACHE_DIR_ENV, RAY_ADDRESS_ENV
from raytrm.data.build import build_dataset

pytestmark = pytest.mark.slow

#: A worker's warning as the driver shows it (raytrm.distributed.run_logs.WORKER_FORMAT).
WORKER_WARNING = re.compile(r"^\d\d:\d\d:\d\d WARNING raytrm(\.\w+)+ \[worker \d+\]: ")


def raytrm(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "raytrm.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=540, check=False)


def test_a_quiet_run_on_two_workers_shows_its_warnings_and_summary_and_logs_the_rest(tmp_path):
    data = build_dataset("sudoku", tmp_path / "sudoku", count=200, test_count=16, seed=3)
    env = {**os.environ, "HOME": str(tmp_path / "home"), CACHE_DIR_ENV: str(tmp_path / "cache")}
    env.pop(RAY_ADDRESS_ENV, None)  # a Ray of its own, not the session's
    run = tmp_path / "run"
    # lr 1e-12 and a row every step: the weights are frozen at step 3, a warning of rank 0's at the last step
    args = ["--workers", "2", "--steps", "3", "--lr", "1e-12", "--log-interval", "1", "--data", str(data)]
    done = raytrm("train", *args, "--quiet", "--out", str(run), env=env)
    assert done.returncode == 0, done.stderr
    out, err = done.stdout.splitlines(), done.stderr.splitlines()
    assert len(out) == 4 and out[0].startswith("trained 3 steps on 2 workers"), out
    assert out[-1].startswith(f"run directory {run}: ")
    assert err and all(WORKER_WARNING.match(line) for line in err), err
    (frozen,) = [line for line in err if "raytrm.train.run.health [worker 0]: step 3: the updates moved" in line]
    assert frozen.endswith("raise training.lr (--lr): 1e-12 is far below the size rule's 0.003 for this model")

    logs = run / "logs"
    driver = (logs / "driver.log").read_text()
    assert "INFO ray._private.worker: Started a local Ray instance" in driver
    assert "INFO raytrm.distributed.cluster: started a local Ray" in driver
    for rank in (0, 1):
        worker = (logs / f"worker-{rank}.log").read_text()
        assert f"INFO raytrm.distributed.ray_train: worker {rank} on tier " in worker
    assert "WARNING raytrm.train.run.health: step 3: the updates moved" in (logs / "worker-0.log").read_text()

    report = raytrm("report", str(run), env=env)
    assert report.returncode == 0, report.stderr
    assert f"logs in {logs}: driver.log, worker-0.log, worker-1.log" in report.stdout
    assert "- weights frozen: the updates moved the weights" in report.stdout
