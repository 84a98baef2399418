"""Which Ray a raytrm driver joins: a job's cluster, an address, or a local one; and the job line the head prints."""

from __future__ import annotations

import subprocess
import sys

import pytest
import ray

from raytrm.cli import job_command
from raytrm.distributed import cluster, tokens


def joined(monkeypatch, address: str | None) -> tuple[dict, list]:
    """The arguments connect() gives ray.init, and the addresses it checked first (no Ray is started, no token
    file of this machine's is read or made, nothing is sent on the network)."""
    calls: dict = {}
    checked: list = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.update(kw))
    monkeypatch.setattr(tokens, "use_cluster_token", lambda: None)
    monkeypatch.setattr(tokens, "ensure_local_token", lambda: None)
    monkeypatch.setattr(cluster, "check_address", checked.append)
    assert cluster.connect(address) is True
    return calls, checked


def test_a_ray_jobs_driver_joins_the_cluster_it_was_submitted_to(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # what Ray sets for a job's driver
    assert joined(monkeypatch, None) == ({"address": "auto", "log_to_driver": True}, ["auto"])


def test_without_a_job_or_an_address_a_local_ray_is_started(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    calls, checked = joined(monkeypatch, None)
    assert calls["address"] == "local" and checked == []


def test_the_head_prints_a_job_line_that_runs_raytrm_tune_on_the_cluster():
    line = job_command("http://192.168.1.10:8265")
    assert line == (
        "RAY_AUTH_MODE=token ray job submit --address http://192.168.1.10:8265 --working-dir . -- raytrm tune"
    )


@pytest.mark.slow
def test_the_commands_that_connect_leave_ray_unimported_until_they_do():
    """Ray reads its auth mode once, when imported: a module that imports it before connect() turns the cluster token
    off, and a driver on the head is refused by its own cluster."""
    drivers = [
        "raytrm.cli",
        "raytrm.tune.tuner",
        "raytrm.distributed.ray_train",
        "raytrm.distributed.cluster_commands",
        "benchmarks.distributed",
    ]
    probe = f"import sys, {', '.join(drivers)}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
