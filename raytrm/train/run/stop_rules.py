"""When a run ends: the loop's stop rules, by steps, samples, time or a signal (Ctrl-C, SIGTERM); a trial's warm-up
and window (raytrm.tune.window) is one more. When it evaluates is raytrm.train.run.evaluations."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

from raytrm.train.loop import Hook, Loop

logger = logging.getLogger(__name__)


class StepLimit(Hook):
    """Ends the run at a step count (the same step on every worker: no exchange needed)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def stop(self, loop: Loop) -> str | None:
        return "steps reached" if loop.trainer.step >= self.steps else None


class SampleLimit(Hook):
    """Ends the run once it has trained on a number of samples (counted from the first step of the run's data)."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def stop(self, loop: Loop) -> str | None:
        return "samples reached" if loop.trainer.samples_seen >= self.samples else None


class TimeBudget(Hook):
    """Ends the run once its clock passes a budget; each worker reads its own clock and any worker's end is all's."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def stop(self, loop: Loop) -> str | None:
        if not loop.exchanging:  # inside a local round: the workers agree at its end
            return None
        return "time budget" if loop.agreed(loop.t >= self.seconds) else None


class Interrupts(Hook):
    """Ctrl-C or SIGTERM ends a run alone at the next step boundary, so it ends as any run does: its final
    evaluation, checkpoint and summary. A second signal interrupts at once. Handlers are installed only in the main
    thread (signal's rule) and only while `installed` holds; with several workers, Ray ends the workers itself.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: str | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.getsignal(sig) for sig in self.SIGNALS}

        def handle(number: int, frame: object) -> None:
            if self.received is not None:  # asked twice: stop now
                raise KeyboardInterrupt
            self.received = signal.Signals(number).name
            logger.warning(
                "%s: stopping after this step (final evaluation and checkpoint); again to stop now", self.received
            )

        for sig in self.SIGNALS:
            signal.signal(sig, handle)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop(self, loop: Loop) -> str | None:
        return f"interrupted ({self.received})" if self.received is not None else None
