"""A failed group on a cluster is restarted by the driver on the machines alive then, up to max_failures times
(raytrm.distributed.ray_train._fit); on one machine Ray Train restarts it itself. No Ray is started: the group's
fit and the cluster's nodes are injected."""

from __future__ import annotations

import logging

import pytest
from ray.train import TrainingFailedError

from raytrm.distributed import ray_train
from raytrm.distributed.ray_train import Node, _fit, _why_failed


class NodeDied(Exception):
    pass


class GroupFailed(TrainingFailedError):
    def __init__(self, message: str, failures: dict) -> None:
        super().__init__(message)
        self.worker_failures = failures


LEFT = NodeDied("The actor died unexpectedly.\n\tThe actor died because its node has died. Node Id: 3ead")


def scripted(monkeypatch, outcomes: list, alive: list[int]) -> list[tuple[int, int]]:
    """_fit_group fails or succeeds as `outcomes` says, and the cluster has alive[i] machines after failure i."""
    calls: list[tuple[int, int]] = []

    def fit_group(job, count, on_cluster, nodes, run_dir, max_failures):
        calls.append((count, max_failures))
        outcome = outcomes[len(calls) - 1]
        if outcome is not None:
            raise outcome

    counts = iter(alive)
    monkeypatch.setattr(ray_train, "_fit_group", fit_group)
    monkeypatch.setattr(ray_train, "raytrm_nodes", lambda: [Node(str(i), "ip", "t", 1.0) for i in range(next(counts))])
    return calls


def test_a_mac_that_left_restarts_the_group_on_the_machines_left(monkeypatch, caplog, tmp_path):
    calls = scripted(monkeypatch, [GroupFailed("Training failed due to worker errors:", {1: LEFT}), None], [1])
    with caplog.at_level(logging.WARNING, logger="raytrm"):
        _fit({}, 2, True, [], tmp_path, max_failures=2)
    assert calls == [(2, 0), (1, 0)]  # Ray Train itself restarts nothing on a cluster: the driver does
    assert "failed (a worker's machine left the cluster); restarting it on the 1 machine(s) left" in caplog.text


def test_restarts_stop_at_max_failures_and_the_last_error_is_raised(monkeypatch, tmp_path):
    failed = GroupFailed("Training failed due to worker errors:", {0: RuntimeError("boom\nmore")})
    calls = scripted(monkeypatch, [failed, failed, failed], [2, 2])
    with pytest.raises(GroupFailed):
        _fit({}, 2, True, [], tmp_path, max_failures=2)
    assert calls == [(2, 0), (2, 0), (2, 0)]  # a worker lost on a machine still there: the same size again


def test_no_machine_left_raises_at_once(monkeypatch, tmp_path):
    calls = scripted(monkeypatch, [GroupFailed("x", {0: LEFT})], [0])
    with pytest.raises(GroupFailed):
        _fit({}, 2, True, [], tmp_path, max_failures=2)
    assert calls == [(2, 0)]


def test_on_one_machine_ray_train_restarts_the_group(monkeypatch, tmp_path):
    calls = scripted(monkeypatch, [None], [])
    _fit({}, 2, False, [], tmp_path, max_failures=2)
    assert calls == [(2, 2)]


def test_the_cause_is_a_few_words():
    assert _why_failed(GroupFailed("x", {0: LEFT})) == "a worker's machine left the cluster"
    assert _why_failed(GroupFailed("x", {0: RuntimeError("\nConnection closed by peer\ndetail")})) == (
        "Connection closed by peer"
    )
    assert _why_failed(TrainingFailedError("the controller failed")) == "the controller failed"
