"""Where a distributed run's lines go (raytrm.distributed.run_logs), without Ray running: a worker writes to its
stderr only the raytrm lines it should show, in the format the driver shows; the driver keeps raytrm's lines and
Ray's errors on the terminal and every line in RUN_DIR/logs/driver.log, and a run refused before its directory is
checked leaves no logs/ behind."""

from __future__ import annotations

import logging
import sys

import pytest

from raytrm.distributed import run_logs
from raytrm.distributed.run_logs import TERMINAL, DriverLogs, _Threshold, worker_logs
from raytrm.errors import UserError

#: Lines Ray forwards from its own processes: the controller's C++ error about its actor, a Ray Train INFO line, a
#: Python warning of a library, a traceback's last line.
RAY_LINES = [
    "[2026-12-01 22:18:06,163 E 14545 14628] core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' and "
    "ID: '3d39' has constructor arguments in the object store and max_restarts > 0.",
    "2026-12-01 22:18:06,163\tINFO context.py:120 -- Reporting training result 1",
    "/venv/torch/nn/modules/module.py:1: UserWarning: a deprecated call",
    "RuntimeError: something in Ray",
]


@pytest.fixture
def logging_state():
    """Leave the process's loggers as they were: these tests set up a worker's and a driver's logging."""
    root, raytrm, ray = logging.getLogger(), logging.getLogger("raytrm"), logging.getLogger("ray")
    saved = [
        (log, log.level, list(log.handlers), {h: list(h.filters) for h in log.handlers}) for log in (root, raytrm, ray)
    ]
    yield
    for log, level, handlers, filters in saved:
        for handler in [h for h in log.handlers if h not in handlers]:
            log.removeHandler(handler)
            handler.close()
        for handler, kept in filters.items():
            handler.filters[:] = kept
        log.setLevel(level)


def test_a_workers_raytrm_line_and_the_progress_line_read_as_the_terminals_and_rays_lines_do_not():
    formatter = logging.Formatter(run_logs.WORKER_FORMAT.format(rank=3), run_logs.TIME_FORMAT)
    name = "raytrm.train.run.health"
    record = logging.LogRecord(name, logging.WARNING, __file__, 1, "step 2: loss is 367", None, None)
    line = formatter.format(record)
    assert line.endswith(" WARNING raytrm.train.run.health [worker 3]: step 2: loss is 367") and TERMINAL.search(line)
    assert TERMINAL.search("step 3/4  75% | samples/s 64.37 loss 2.559")
    assert not any(TERMINAL.search(line) for line in RAY_LINES)
    ray_record = logging.LogRecord("ray.train", logging.WARNING, __file__, 1, "a Ray warning", None, None)
    assert not TERMINAL.search(formatter.format(ray_record))  # a worker console line, but not raytrm's


def test_a_quiet_worker_writes_its_info_lines_to_its_file_and_only_warnings_to_its_stderr(
    tmp_path, capsys, logging_state
):
    path = worker_logs(tmp_path, 1, quiet=True, level="INFO")
    assert path == tmp_path / "logs" / "worker-1.log"
    logging.getLogger("raytrm.train.memory.governor").info("step 3: choose micro-batch 16 -> 32")
    logging.getLogger("raytrm.train.run.health").warning("step 3: the loss cannot move")
    logging.getLogger("somelib").info("a library's info line")
    err = capsys.readouterr().err.splitlines()
    line = " WARNING raytrm.train.run.health [worker 1]: step 3: the loss cannot move"
    assert len(err) == 1 and err[0].endswith(line)
    assert TERMINAL.search(err[0])
    written = path.read_text()
    assert "INFO raytrm.train.memory.governor: step 3: choose micro-batch 16 -> 32" in written
    assert "WARNING raytrm.train.run.health: step 3: the loss cannot move" in written
    assert "INFO somelib: a library's info line" in written


def test_rank_0_without_quiet_shows_its_info_lines_and_a_second_setup_replaces_the_first(
    tmp_path, capsys, logging_state
):
    worker_logs(tmp_path, 0, quiet=True, level="INFO")
    worker_logs(tmp_path, 0, quiet=False, level="INFO")  # a restarted worker in the same process: once, not twice
    logging.getLogger("raytrm.distributed.ray_train").info("worker 0 on tier t: share 32 of 64")
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(" INFO raytrm.distributed.ray_train [worker 0]: worker 0 on tier t: share 32 of 64")
    assert (tmp_path / "logs" / "worker-0.log").read_text().count("share 32 of 64") == 1


def test_rays_handlers_on_a_worker_keep_rays_warnings_and_leave_raytrms_lines_and_rays_info_to_the_files(
    tmp_path, logging_state
):
    rays = logging.StreamHandler(sys.stderr)  # as Ray gives a worker's root
    logging.getLogger().addHandler(rays)
    worker_logs(tmp_path, 1, quiet=True, level="INFO")

    def passes(name: str, level: int) -> bool:
        return all(f.filter(logging.LogRecord(name, level, __file__, 1, "m", None, None)) for f in rays.filters)

    assert passes("ray.train._internal.context", logging.WARNING)
    assert not passes("ray.train._internal.context", logging.INFO)
    assert not passes("raytrm.train.run.health", logging.WARNING)  # the worker's own console writes it, in its format


def test_the_drivers_terminal_keeps_raytrms_lines_from_its_level_rays_from_error_the_rest_from_warning():
    terminal = _Threshold(logging.WARNING)

    def passes(name: str, level: int) -> bool:
        return terminal.filter(logging.LogRecord(name, level, __file__, 1, "m", None, None))

    assert passes("raytrm.train.run.health", logging.WARNING) and not passes("raytrm.distributed.cluster", logging.INFO)
    assert not passes("ray._private.authentication.authentication_token_setup", logging.WARNING)
    assert passes("ray.train", logging.ERROR)
    assert passes("somelib", logging.WARNING) and not passes("somelib", logging.INFO)


def _driver(tmp_path, quiet: bool) -> tuple[DriverLogs, logging.Handler]:
    """A driver's logging as `raytrm`'s main sets it (a handler on stderr), then the run's routing of it."""
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(console)
    logging.getLogger("raytrm").setLevel(logging.INFO)
    return DriverLogs(tmp_path / "run", quiet=quiet).start(), console


def test_a_quiet_driver_holds_its_lines_until_the_run_directory_is_checked_then_writes_them_all(
    tmp_path, capsys, logging_state
):
    logs, _ = _driver(tmp_path, quiet=True)
    logging.getLogger("raytrm.distributed.cluster").info("started a local Ray: one machine of tier t")
    logging.getLogger("raytrm.distributed.ray_train").warning("a warning before the run starts")
    assert not (tmp_path / "run").exists()  # nothing written yet
    logs.keep()
    logging.getLogger("raytrm.hardware.device").info("device cpu: asked for")
    logs.forwarded(
        {"pid": 14545, "ip": "10.0.0.2", "actor_name": "TrainController", "is_err": True, "lines": RAY_LINES}
    )
    worker = "22:40:21 WARNING raytrm.train.run.health [worker 0]: step 2: loss is 367"
    logs.forwarded({"pid": 14724, "ip": "10.0.0.2", "actor_name": "RayTrainWorker", "is_err": True, "lines": [worker]})
    logs.close()
    err = capsys.readouterr().err.splitlines()
    assert err == ["WARNING raytrm.distributed.ray_train: a warning before the run starts", worker]
    written = (tmp_path / "run" / "logs" / "driver.log").read_text().splitlines()
    assert [w.split(" ", 1)[1] for w in written[:2]] == [
        "INFO raytrm.distributed.cluster: started a local Ray: one machine of tier t",
        "WARNING raytrm.distributed.ray_train: a warning before the run starts",
    ]
    assert any(w.endswith("INFO raytrm.hardware.device: device cpu: asked for") for w in written)
    controller = [w for w in written if " stderr TrainController pid=14545 ip=10.0.0.2: " in w]
    assert [w.split(": ", 1)[1] for w in controller] == RAY_LINES
    assert written[-1].endswith(f"stderr RayTrainWorker pid=14724 ip=10.0.0.2: {worker}")


def test_without_quiet_the_drivers_info_lines_show_and_close_leaves_the_loggers_as_they_were(
    tmp_path, capsys, logging_state
):
    logs, console = _driver(tmp_path, quiet=False)
    logging.getLogger("raytrm.distributed.cluster").info("started a local Ray")
    logs.close()
    assert capsys.readouterr().err.splitlines() == ["INFO raytrm.distributed.cluster: started a local Ray"]
    assert console.filters == [] and all(
        not getattr(h, "_raytrm_run_logs", False) for h in logging.getLogger().handlers
    )
    assert not (tmp_path / "run").exists()  # refused before its directory was checked: no logs/ left behind


def test_the_autoscalers_status_stays_out_and_its_events_show(tmp_path, capsys, logging_state):
    logs, _ = _driver(tmp_path, quiet=True)
    logs.keep()
    logs.autoscaler_events = lambda lines: [
        line.split(":event_summary:")[1] for line in lines if ":event_summary:" in line
    ]
    status = ["======== Autoscaler status ========", " 0.0/2.0 CPU"]
    event = ":event_summary:Warning: The following resource request cannot be scheduled right now: {'CPU': 4.0}"
    logs.forwarded({"pid": "autoscaler", "ip": "10.0.0.2", "is_err": False, "lines": [*status, event]})
    logs.close()
    shown = "Warning: The following resource request cannot be scheduled right now: {'CPU': 4.0}"
    assert capsys.readouterr().err.splitlines() == [shown]
    written = (tmp_path / "run" / "logs" / "driver.log").read_text()
    assert shown in written and "Autoscaler status" not in written


def test_forward_takes_rays_printer_and_close_gives_it_back(tmp_path, logging_state):
    pytest.importorskip("ray")
    from ray._private.worker import global_worker_stdstream_dispatcher as dispatcher

    def printer(data):
        pass

    dispatcher.add_handler(run_logs.RAY_PRINTER, printer)
    try:
        logs, _ = _driver(tmp_path, quiet=True)
        logs.forward()
        names = [name for name, _ in dispatcher.handlers]
        assert run_logs.RAY_PRINTER not in names and "_raytrm_run_logs" in names
        logs.close()
        assert (run_logs.RAY_PRINTER, printer) in dispatcher.handlers
        assert "_raytrm_run_logs" not in [name for name, _ in dispatcher.handlers]
    finally:
        dispatcher.remove_handler(run_logs.RAY_PRINTER)


def test_a_run_directory_the_driver_cannot_write_is_one_line(tmp_path, logging_state):
    (tmp_path / "file").write_text("not a directory")
    logs = DriverLogs(tmp_path / "file" / "run", quiet=True).start()
    with pytest.raises(UserError) as refused:
        logs.keep()
    logs.close()
    assert str(refused.value) == (
        f"{tmp_path}/file/run/logs/driver.log: cannot write the run's log (Not a directory); give --out a directory "
        "this machine can write"
    )
