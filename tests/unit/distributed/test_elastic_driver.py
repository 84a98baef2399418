"""The elastic driver (raytrm.distributed.elastic_run): its line for a worker that left (the worker's own error, not
Ray's wrapper around it), and the machines it starts workers on."""

from __future__ import annotations

from raytrm.distributed.elastic_run import LEFT_HOLD_S, failure_line, without_worker
from raytrm.distributed.workers import Node


class TaskError(Exception):
    """Ray's shape of a task's failure: a multi-line wrapper, the worker's exception as `cause`."""

    def __init__(self, cause: object) -> None:
        super().__init__("ray::ElasticWorker.run() (pid=135, ip=10.0.0.3, actor_id=5ae4)\n  File ...")
        self.cause = cause


def test_a_workers_own_exception_is_named_with_itsfailure_line():
    error = TaskError(RuntimeError("Connection closed by peer [10.0.0.2]:15052\nThis is typically caused by"))
    assert failure_line(error) == "RuntimeError: Connection closed by peer [10.0.0.2]:15052"


def test_a_cause_that_is_no_exception_leaves_the_errors_own_line():
    error = TaskError({"error_message": "died"})
    assert failure_line(error) == "TaskError: ray::ElasticWorker.run() (pid=135, ip=10.0.0.3, actor_id=5ae4)"
    assert failure_line(ValueError()) == "ValueError"


def test_a_mac_whose_worker_left_gets_none_while_ray_still_lists_it():
    studio, mini, fresh = (Node(node_id, "10.0.0.2", None, 12.0) for node_id in ("studio", "mini", "new"))
    busy = {"studio"}
    left = {"mini": 100.0}  # its worker left at t = 100 s (the Mac killed); Ray lists the node until its checks fail
    assert without_worker([studio, mini, fresh], busy, left, now=110.0) == [fresh]  # the Mac that came back
    # A node still listed past the hold is up (its worker failed, the Mac stayed): it gets a worker again.
    assert without_worker([studio, mini], busy, left, now=100.0 + LEFT_HOLD_S) == [mini]
    assert without_worker([studio, mini], busy, {}, now=0.0) == [mini]
