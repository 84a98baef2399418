"""The one training loop: it drives `Trainer.train_step` and asks its hooks around each step.

`raytrm train` (raytrm.train.run.training), a tuning trial (raytrm.tune.trial) and a learning curve
(raytrm.tune.curves) each build a Trainer, pick hooks and run this loop; what differs between them is the hooks. One
iteration:

1. stop: the run ends when a hook halted it during the last step, or when a hook's stop rule gives a reason;
2. `before_step`: hooks act before the step (a trial's window opens, due evaluations are taken);
3. the step, its peak memory measured around it, then the Trainer's sync strategy (raytrm.sync.strategy) after it:
   a local round's exchange when due, the sync mode's choice; its wait counts in the step, and it says whether the
   workers may exchange after this step (`exchanging`);
4. `after_step`: hooks observe the step and return their decisions (`Decision`: the memory governor's cut, the
   heat's threads, share of the micro-batch and pause, a stop), which the loop applies in the order of `ORDER`,
   whatever the order of the hooks;
5. the global batch is re-cut once if the decisions moved the micro-batch, and the hooks are told (`on_recut`);
6. `end_step`: hooks exchange and record (peers, metrics rows, checkpoints), in list order; a stop they return is
   applied after them.

After the last step, the sync strategy lands what it holds, then `finish` (final evaluation, last checkpoint). In a
run whose workers may come and go (`regroup`: raytrm.train.elastic), a peer lost in any collective of an iteration
sends the loop to the next membership, after which the iteration runs again (the step redone, or skipped by a worker
that takes a peer's state past it), or the next one where the step ran and only its sync after it failed (a local
round's sum): that step stands, and the hooks that record it do so at the regroup (`on_regroup`); after step 1
(where the workers exchange after it) and at the first boundary where they exchange past each multiple of
ADMIT_EVERY steps, the members agree whether a worker waits to join, and admit it. Any other failure ends the run
with the exception; what the hooks hold (a metrics file) is closed by whoever built them. A new behaviour (a health
check, another stop rule) is one more hook, picked by the runs that need it; `stop_reason` says why a run ended. A
hook reads the loop's state (`probing`, `exchanging`, the clock) but never writes it: what it decides, it returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, Union

from raytrm.train.memory.peak import PeakMemory, trim_heap
from raytrm.train.torch_threads import apply_threads
from raytrm.train.trainer import StepResult, Trainer


@dataclasses.dataclass
class Step:
    """One step as the hooks see it; hooks of the after-step phase add what they decided, for those after them."""

    result: StepResult
    peak_bytes: int = 0
    #: A metrics row is written for this step: the hooks that feed the row (heat, evaluation) act on it.
    logged: bool = False
    #: This worker's adaptations (memory, heat); once the peers have exchanged them, every worker's, each tagged with
    #: its rank, and the rebalance: what the metrics log writes.
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    heat: dict[str, Any] = dataclasses.field(default_factory=dict)  # the thermal reading of this step, if read
    share_cap: int | None = None  # the most samples this worker's memory lets it hold (with peers only)
    workers: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # every worker's row, with peers


@dataclasses.dataclass(frozen=True)
class Cut:
    """The memory governor's micro-batch for the following steps (None: the config's), whether it still probes the
    cut (its first steps, part of the warm-up), whether those steps run their batches at their widest (every
    record at the most tokens it may hold: steps whose peaks the governor fits, so the fit holds for any records),
    and whether to give the heap's freed blocks back first (raytrm.train.memory.peak.trim_heap: steps of varied
    widths leave blocks behind that a later step's peak would count)."""

    micro_batch: int | None
    probing: bool = False
    widest: bool = False
    release: bool = False


@dataclasses.dataclass(frozen=True)
class Threads:
    """Torch's intra-op threads from the next step on (the heat shedding or restoring load)."""

    count: int


@dataclasses.dataclass(frozen=True)
class Scale:
    """Multiply the heat's share of the micro-batch by this (the share never exceeds 1)."""

    factor: float


@dataclasses.dataclass(frozen=True)
class Pause:
    """Sleep before the next step (the heat cooling)."""

    seconds: float


@dataclasses.dataclass(frozen=True)
class Stop:
    """End the run before the next step, with its reason (a broken constraint: what was planned for its end is
    skipped)."""

    reason: str


Decision = Union[Cut, Threads, Scale, Pause, Stop]  # noqa: UP007 (a runtime alias, also for isinstance's order)
#: The order the loop applies a step's decisions in: the cut from the step's memory first, then the heat (its threads,
#: its share of that cut, its pause), and a stop last, so that the next step, if any, runs as every hook decided.
ORDER: tuple[type, ...] = (Cut, Threads, Scale, Pause, Stop)
Decisions = Union[Decision, Iterable[Decision], None]  # noqa: UP007


class Hook:
    """A part of a run that the loop asks around each step; every method is optional.

    on_out_of_memory: told of a step the allocator refused, returns the smaller micro-batch to redo it at (the memory
    governor's; the loop hands the first hook's that has one to the Trainer).
    """

    on_out_of_memory: Callable[[int], int] | None = None

    def start(self, loop: Loop) -> Decisions:
        """Before the first step."""

    def stop(self, loop: Loop) -> str | None:
        """Why the run ends now (asked before each step, in list order; the first reason ends it), or None."""
        return None

    def before_step(self, loop: Loop) -> None:
        """Before each step that runs."""

    def after_step(self, loop: Loop, step: Step) -> Decisions:
        """Observe the step; return what this hook decided (a cut, threads, a pause, a stop), or None."""

    def on_recut(self, loop: Loop) -> None:
        """The loop re-cut the global batch after the hooks' decisions."""

    def end_step(self, loop: Loop, step: Step) -> Decisions:
        """Exchange and record what the step did; a stop may be returned."""

    def finish(self, loop: Loop) -> None:
        """After the last step (not after a failure)."""

    def on_regroup(self, loop: Loop) -> None:
        """The run's workers changed (raytrm.train.elastic): per-worker state is made again for the new set."""


class Regroup(Protocol):
    """What the loop asks of a run whose workers come and go (raytrm.train.elastic.Elastic)."""

    def lost(self, error: BaseException) -> bool: ...
    def boundary(self, loop: Loop) -> list[dict[str, Any]]: ...
    def recover(self, loop: Loop) -> list[dict[str, Any]]: ...


#: Steps between two checks for workers waiting to join (at a boundary where the workers exchange).
ADMIT_EVERY = 10


class Loop:
    """Runs a Trainer under its hooks until one ends the run; holds what the hooks share.

    clock: the run's clock (tests script it). measure_peak: measure each step's peak memory. logged: whether a
    metrics row is written at a step number (none by default).
    """

    def __init__(
        self,
        trainer: Trainer,
        hooks: Sequence[Hook],
        *,
        clock: Callable[[], float] = time.perf_counter,
        measure_peak: bool = True,
        logged: Callable[[int], bool] = lambda step: False,
        regroup: Regroup | None = None,
    ) -> None:
        self.trainer, self.hooks, self.clock = trainer, list(hooks), clock
        self.regroup = regroup
        #: The latest step that ran, as the loop measured it (its sync's wait included, once the sync returned).
        self.last_step: Step | None = None
        self._membership_events: list[dict[str, Any]] = []  # a change of workers, for the next step's events
        self.measure_peak, self.logged = measure_peak, logged
        self.stop_reason: str | None = None
        #: A hook halted the run after a step (a broken constraint): what was planned for its end is skipped.
        self.halted = False
        self.t = 0.0  # the run's clock at the top of this iteration (see `now`)
        self.step_end = 0.0  # the run's clock when the latest step returned
        self.train_seconds = 0.0  # the Trainer's own seconds of its steps
        self.peak_bytes, self.peak_method = 0, ""  # the highest step peak so far, and how it was measured
        #: The memory governor's micro-batch (None: the config's) and the heat's share of it; see `_recut`.
        self.micro_batch: int | None = None
        self.micro_batch_scale = 1.0
        #: The cut is still being probed (the memory governor's first steps): not yet the run's steady cut.
        self.probing = False
        self.on_out_of_memory = next((h.on_out_of_memory for h in self.hooks if h.on_out_of_memory), None)
        #: The workers may exchange after this step: always, but inside a round of the local sync mode, where no
        #: worker touches a peer until the round ends (the sync strategy says); hooks that exchange wait.
        self.exchanging = True
        self.applied: list[Decision] = []  # every decision applied, in order (what a test or a report reads)
        self._start = 0.0
        self._off = 0.0

    def now(self) -> float:
        """Seconds since the run started on its clock, less the time hooks took off it (evaluations)."""
        return self.clock() - self._start - self._off

    @contextlib.contextmanager
    def off_clock(self) -> Iterator[None]:
        """Time spent inside does not count on the run's clock."""
        begin = self.clock()
        try:
            yield
        finally:
            self._off += self.clock() - begin

    def _halt(self, reason: str) -> None:
        """End the run before the next step (the first reason given is kept)."""
        if self.stop_reason is None:
            self.stop_reason, self.halted = reason, True

    def _charge(self, step: Step, seconds: float) -> None:
        """Count seconds the sync spent finishing the step (a round's exchange) as the step's, waiting on sync."""
        if seconds:
            step.result.seconds += seconds
            step.result.sync_seconds += seconds
            self.train_seconds += seconds

    def apply(self, decisions: Iterable[Decision]) -> None:
        """Apply decisions in the order of ORDER (a kind's decisions in the order given)."""
        for decision in sorted(decisions, key=lambda d: ORDER.index(type(d))):
            self.applied.append(decision)
            if isinstance(decision, Cut):
                self.micro_batch, self.probing = decision.micro_batch, decision.probing
                self.trainer.widest = decision.widest
                if decision.release:
                    trim_heap()
            elif isinstance(decision, Threads):
                apply_threads(decision.count)
            elif isinstance(decision, Scale):
                self.micro_batch_scale = min(1.0, self.micro_batch_scale * decision.factor)
            elif isinstance(decision, Pause):
                time.sleep(decision.seconds)
            else:
                self._halt(decision.reason)

    def agreed(self, mine: bool) -> bool:
        """Whether any worker wants this; a collective with several workers, so every rank asks at the same point."""
        return self.trainer.sync.any(mine)

    def run(self) -> str | None:
        """Train until a hook ends the run; returns why it ended."""
        self._start = self.clock()
        strategy = self.trainer.strategy
        strategy.start()
        self.exchanging = strategy.exchanging  # a resume may land inside a local round
        self.apply(_collect(hook.start(self) for hook in self.hooks))
        while True:
            self.t = self.now()
            if self._stopping():
                break
            try:
                self._iteration()
            except Exception as error:
                if self.regroup is None or not self.regroup.lost(error):
                    raise
                self._membership_events += self.regroup.recover(self)
        strategy = self.trainer.strategy  # made anew when the workers changed
        strategy.finish()
        for hook in self.hooks:
            hook.finish(self)
        return self.stop_reason

    def _iteration(self) -> None:
        for hook in self.hooks:
            hook.before_step(self)
        step = self._step()
        self.apply(_collect(hook.after_step(self, step) for hook in self.hooks))
        self._recut()
        self.apply(_collect(hook.end_step(self, step) for hook in self.hooks))
        regroup = self.regroup
        # The first step (its deadline measured early), or a boundary that crossed a multiple of ADMIT_EVERY (local
        # rounds end every H steps): the same on every rank, since it depends on the step alone.
        step, rounds = self.trainer.step, self.trainer.strategy.every or 1
        crossed = step // ADMIT_EVERY > max(0, step - rounds) // ADMIT_EVERY
        due = regroup is not None and self.exchanging and (step == 1 or crossed)
        if due:  # every member looks at the same step
            self._membership_events += regroup.boundary(self)

    def _stopping(self) -> bool:
        if self.stop_reason is None:
            self.stop_reason = next((r for r in (hook.stop(self) for hook in self.hooks) if r), None)
        return self.stop_reason is not None

    def _step(self) -> Step:
        trainer = self.trainer
        peak_bytes = 0
        if self.measure_peak:
            with PeakMemory(trainer.device.type) as peak:
                result = trainer.train_step(on_out_of_memory=self.on_out_of_memory)
            peak_bytes, self.peak_method = peak.bytes, peak.method
            self.peak_bytes = max(self.peak_bytes, peak_bytes)
        else:
            result = trainer.train_step(on_out_of_memory=self.on_out_of_memory)
        self.train_seconds += result.seconds
        step = Step(result, peak_bytes, logged=self.logged(trainer.step))
        self.last_step = step  # the step ran, whether or not its sync below reaches every peer
        synced = trainer.strategy.after_step(result.seconds, result.sync_seconds, probing=self.probing)
        self._charge(step, synced.waited_s)
        self.exchanging = synced.exchanging
        step.events += synced.events
        step.events, self._membership_events = self._membership_events + step.events, []
        self.step_end = self.now()
        return step

    def _recut(self) -> None:
        """Cut the following global batches at the governor's micro-batch times the heat's share, where either set
        one; a smaller cut first gives freed heap back, or the smaller steps would measure as large."""
        if self.micro_batch is None and self.micro_batch_scale >= 1:
            return
        configured = self.trainer.cut.units(self.trainer.config.training.micro_batch)  # the config counts samples
        base = self.micro_batch if self.micro_batch is not None else configured
        micro = max(1, int(base * self.micro_batch_scale))
        if micro == self.trainer.micro_batch:
            return
        if micro < self.trainer.micro_batch:
            trim_heap()
        self.trainer.set_micro_batch(micro)
        for hook in self.hooks:
            hook.on_recut(self)


def _collect(returned: Iterable[Decisions]) -> list[Decision]:
    """The decisions the hooks returned, flattened (None: none)."""
    out: list[Decision] = []
    for item in returned:
        if item is None:
            continue
        out.extend([item] if isinstance(item, ORDER) else item)
    return out
