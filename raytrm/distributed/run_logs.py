"""Where a distributed run's lines go: raytrm's to the terminal, every line to the run directory's logs/.

On the terminal a run with --workers or --address shows what a run on one machine shows: rank 0's progress line and
raytrm's INFO lines (the driver's and rank 0's), warnings from the driver and from any worker, then the summary;
with --quiet (no progress) only the warnings and the summary. The rest goes to files, where `raytrm report` names
them:

- RUN_DIR/logs/driver.log: the driver's log records, raytrm's and Ray's (the connection, the dashboard, its token),
  and every line Ray forwards from the job's processes (the workers, Ray Train's controller, the C++ core workers'
  own error lines about Ray's actors), each with its source;
- RUN_DIR/logs/worker-<rank>.log: each worker's log records from INFO up, raytrm's and Ray's.

Ray's errors still reach the terminal, and so do its autoscaler's lines (a request that no node can take: the reason
a run would wait). The workers' own lines reach the terminal through Ray's forwarding of their stderr: a worker
writes there only raytrm's lines it should show, in WORKER_FORMAT, and the driver shows a forwarded line only when it
reads as one of those (TERMINAL) or as the progress line, so the worker's format and the driver's filter are one
contract, kept here.

Lines logged before the run directory is checked (connecting to Ray) wait in memory: a run refused before it starts
leaves no logs/ behind, only its one line.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from raytrm.errors import UserError

logger = logging.getLogger(__name__)

LOGS_DIR, DRIVER_LOG = "logs", "driver.log"
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
TIME_FORMAT = "%H:%M:%S"
#: A worker's lines on its stderr, which Ray forwards to the driver: `raytrm`'s logger name and the worker's rank.
WORKER_FORMAT = "%(asctime)s %(levelname)s %(name)s [worker {rank}]: %(message)s"
#: A forwarded line the driver shows: a worker's raytrm line in WORKER_FORMAT, or rank 0's progress line.
TERMINAL = re.compile(
    r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) raytrm(\.\w+)* \[worker \d+\]: |^step \d+(/\d+)? "
)
#: Ray's dispatcher of forwarded lines names Ray's own printer so (raytrm.distributed.ray_internals).
RAY_PRINTER = "ray_print_logs"
_MINE = "_raytrm_run_logs"  # marks the handlers and filters put here, so a second setup replaces them


def worker_log(rank: int | str) -> str:
    return f"worker-{rank}.log"


def _raytrm(record: logging.LogRecord) -> bool:
    return record.name == "raytrm" or record.name.startswith("raytrm.")


def _terminal_handlers(log: logging.Logger) -> list[logging.Handler]:
    """The handlers of a logger that write to this process's stdout or stderr (not files, not a test's capture)."""
    streams = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
    return [
        h
        for h in log.handlers
        if isinstance(h, logging.StreamHandler)
        and not isinstance(h, logging.FileHandler)
        and id(getattr(h, "stream", None)) in streams
    ]


def _mark(thing: Any) -> Any:
    setattr(thing, _MINE, True)
    return thing


def _unmark(log: logging.Logger) -> None:
    """Take off what an earlier setup of this process put on a logger and its handlers."""
    for handler in [h for h in log.handlers if getattr(h, _MINE, False)]:
        log.removeHandler(handler)
        handler.close()
    for handler in log.handlers:
        for old in [f for f in handler.filters if getattr(f, _MINE, False)]:
            handler.removeFilter(old)


class _Threshold(logging.Filter):
    """Passes raytrm's records from one level, Ray's from ERROR, the rest from WARNING."""

    def __init__(self, raytrm_level: int, others: Callable[[logging.LogRecord], bool] | None = None) -> None:
        super().__init__()
        self.raytrm_level, self.others = raytrm_level, others

    def filter(self, record: logging.LogRecord) -> bool:
        if _raytrm(record):
            return record.levelno >= self.raytrm_level
        if self.others is not None:
            return self.others(record)
        ray = record.name == "ray" or record.name.startswith("ray.")
        return record.levelno >= (logging.ERROR if ray else logging.WARNING)


class _Later(logging.Handler):
    """A file handler that holds its records until it is given its file (`open`), in its own format."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.held: list[logging.LogRecord] = []
        self.target: logging.FileHandler | None = None

    def setFormatter(self, fmt: logging.Formatter | None) -> None:
        """Kept as FILE_FORMAT: ray.init sets its format on every handler of Ray's logger, this one included."""

    def open(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.target = logging.FileHandler(path, encoding="utf-8")
        self.target.setFormatter(logging.Formatter(FILE_FORMAT, TIME_FORMAT))
        for record in self.held:
            self.target.handle(record)
        self.held = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.target is None:
            self.held.append(record)
        else:
            self.target.handle(record)

    def close(self) -> None:
        if self.target is not None:
            self.target.close()
        super().close()


class DriverLogs:
    """The driver's side, from before Ray is joined to after it is left: see the module docstring.

    quiet: the terminal shows warnings and errors only (the summary is printed by the caller).
    """

    def __init__(self, run_dir: Path, quiet: bool) -> None:
        self.path = run_dir / LOGS_DIR / DRIVER_LOG
        self.quiet = quiet
        self.file = _mark(_Later())
        self._undo: list[Callable[[], None]] = []
        self.terminal = _Threshold(logging.WARNING)
        self.autoscaler_events: Callable[[list[str]], Iterable[str]] = lambda lines: ()

    def start(self) -> DriverLogs:
        """Before Ray is joined: the driver's and Ray's records go to the (held) file, the terminal keeps its share."""
        asked = logging.getLogger("raytrm").getEffectiveLevel()  # what RAYTRM_LOG_LEVEL asked for the terminal
        self.file.setLevel(min(asked, logging.INFO))
        self.terminal = _Threshold(logging.WARNING if self.quiet else asked)
        self._route(logging.getLogger(), _terminal_handlers(logging.getLogger()))
        raytrm = logging.getLogger("raytrm")
        level = raytrm.level
        raytrm.setLevel(min(asked, logging.INFO))  # INFO reaches the file whatever the terminal shows
        self._undo.append(lambda: raytrm.setLevel(level))
        return self

    def _route(self, log: logging.Logger, terminal: list[logging.Handler]) -> None:
        log.addHandler(self.file)
        self._undo.append(lambda: log.removeHandler(self.file))
        for handler in terminal:
            handler.addFilter(self.terminal)
            self._undo.append(lambda handler=handler: handler.removeFilter(self.terminal))

    def ray_imported(self) -> None:
        """Once Ray is imported (its logger made, with its own handler: its records do not reach the root) and before
        it is joined, which is when Ray speaks of its token, its dashboard and its start."""
        ray = logging.getLogger("ray")
        if any(h is self.file for h in ray.handlers):
            return
        streams = [h for h in ray.handlers if isinstance(h, logging.StreamHandler)]
        self._route(ray, [h for h in streams if not isinstance(h, logging.FileHandler)])

    def keep(self) -> None:
        """The run directory is checked: what was held, and all that follows, goes to RUN_DIR/logs/driver.log."""
        try:
            self.file.open(self.path)
        except OSError as e:
            raise UserError(
                f"{self.path}: cannot write the run's log ({e.strerror or e}); give --out a directory this machine "
                "can write"
            ) from None
        logger.info("Ray's lines and each worker's: %s (%s, %s)", self.path.parent, DRIVER_LOG, worker_log("<rank>"))

    def forward(self) -> None:
        """Take the lines Ray forwards from the job's processes in place of Ray's printer (once Ray is joined)."""
        try:
            from raytrm.distributed.ray_internals import stdstream_dispatcher

            dispatcher, filter_autoscaler_events = stdstream_dispatcher()
        except ImportError:  # another Ray: its printer stays, and the terminal shows Ray's lines too
            logger.debug("Ray's forwarded lines stay on the terminal: no dispatcher in this Ray")
            return
        self.autoscaler_events = filter_autoscaler_events
        printers = [pair for pair in getattr(dispatcher, "handlers", []) if pair[0] == RAY_PRINTER]
        if not printers:  # Ray joined without forwarding (log_to_driver off): nothing comes
            return
        dispatcher.remove_handler(RAY_PRINTER)
        dispatcher.add_handler(_MINE, self.forwarded)

        def restore() -> None:
            dispatcher.remove_handler(_MINE)
            for name, printer in printers:
                dispatcher.add_handler(name, printer)

        self._undo.append(restore)

    def forwarded(self, data: dict[str, Any]) -> None:
        """One batch of lines from one process: all to driver.log, raytrm's to the terminal; of the autoscaler's
        (its status every few seconds), its events alone, to both, as Ray's printer picks them."""
        autoscaler = data.get("pid") == "autoscaler"
        lines = list(data.get("lines", []))
        if autoscaler:
            lines = list(self.autoscaler_events(lines))
        source = f"{data.get('actor_name') or data.get('task_name') or ''} pid={data.get('pid')} ip={data.get('ip')}"
        stream = "stderr" if data.get("is_err") else "stdout"
        shown = []
        for line in lines:
            record = logging.makeLogRecord({"name": source.strip(), "levelno": logging.INFO, "msg": line})
            record.levelname = stream
            self.file.handle(record)
            if autoscaler or TERMINAL.search(line):
                shown.append(line)
        if shown:
            sys.stderr.write("".join(line + "\n" for line in shown))
            sys.stderr.flush()

    def close(self) -> None:
        """Everything as it was before `start`: Ray's printer back, the file closed."""
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        self.file.close()

    def __enter__(self) -> DriverLogs:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def worker_logs(run_dir: Path, rank: int, quiet: bool, level: str) -> Path:
    """On a worker: its records from INFO up to RUN_DIR/logs/worker-<rank>.log; to its stderr (forwarded to the
    driver) raytrm's warnings, and on rank 0 without quiet raytrm's lines from `level`; Ray's own records there
    from WARNING (its INFO lines, one per report on every worker, stay in the file and Ray's own logs)."""
    path = run_dir / LOGS_DIR / worker_log(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    asked = logging.getLevelName(level.upper())
    asked = asked if isinstance(asked, int) else logging.INFO
    root, raytrm = logging.getLogger(), logging.getLogger("raytrm")
    for log in (root, logging.getLogger("ray")):
        _unmark(log)
    file = _mark(logging.FileHandler(path, encoding="utf-8"))
    file.setFormatter(logging.Formatter(FILE_FORMAT, TIME_FORMAT))
    file.setLevel(min(asked, logging.INFO))
    console = _mark(logging.StreamHandler(sys.stderr))
    console.setFormatter(logging.Formatter(WORKER_FORMAT.format(rank=rank), TIME_FORMAT))
    console.setLevel(asked if rank == 0 and not quiet else max(asked, logging.WARNING))
    console.addFilter(_mark(_Threshold(logging.NOTSET, others=lambda record: False)))
    # Ray's handlers keep Ray's warnings and errors, not raytrm's (the console above writes those, in its format).
    rays = _mark(_Threshold(logging.CRITICAL + 1, others=lambda record: record.levelno >= logging.WARNING))
    for handler in root.handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.addFilter(rays)
    root.addHandler(file)
    root.addHandler(console)
    logging.getLogger("ray").addHandler(file)  # Ray's records do not reach the root
    raytrm.setLevel(min(asked, logging.INFO))
    if root.level > logging.INFO:  # Ray's INFO records (Ray Train's, under loggers named by file) reach the file
        root.setLevel(logging.INFO)
    return path
