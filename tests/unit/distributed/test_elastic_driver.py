"""The elastic driver's line for a worker that left (raytrm.distributed.elastic_run): the worker's own error, not
Ray's wrapper around it."""

from __future__ import annotations

from raytrm.distributed.elastic_run import failure_line


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
