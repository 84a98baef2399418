"""The run's sync strategy: one object per run that holds the sync mode, chooses it, and switches it.

The Trainer builds it over the collectives it is handed and calls it at one point of each step (`reduce`, with
`micro_batches` for the sums that start during the backward); the training loop calls it at one point after the
step (`after_step`), which returns what the step's sync did: the seconds an exchange waited, whether the workers
may exchange after this step (not inside a local round), and the events to log.

Modes (TrainConfig.sync_mode): exact (the gradient summed every step), compressed (summed in bf16 with error
feedback), local (rounds of H inner steps alone, raytrm.sync.local), and auto. `auto`, or local without H, measures
at the start: the link (raytrm.sync.link.measure_link) before the first step, then PROBE_STEPS steps for a step's
time without sync (exact where the link makes that cheap, else one local round of them), and chooses
(raytrm.sync.link.choose); a `sync-choice` event gives the choice and its reason. Every CHECK_EVERY steps the workers
compare the share of their steps spent waiting with the prediction; when it drifts (above both the target and twice
the prediction, or below a quarter of it outside exact), the link is measured again and the choice is made again
from the latest steps' times, every worker's: how late the slowest is, as well as how long a step takes.

Every decision is taken at a round's end from gathered measurements, so every rank takes the same one at the same
step. A worker's share of waiting is its sync seconds over its step seconds (a round's exchange counts in the step
that closed it); summary.json holds each worker's and the run's, the mode, H and every choice. A worker alone (no
collectives handed) has the `alone` mode: nothing is exchanged, nothing is chosen, nothing is recorded.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from raytrm import config as cfg
from raytrm.sync.contract import GradientSync, LocalSync, Replica
from raytrm.sync.exact import Exact
from raytrm.sync.link import MODES, NO_LATENESS, TARGET_SHARE, Choice, Lateness, Link, choose, mbit_text, measure_link
from raytrm.sync.local import Local, on_cpu
from raytrm.sync.mode import REGISTRY, Mode, Reduced, Scalar

logger = logging.getLogger(__name__)

PROBE_STEPS = 3  # steps timed before the first choice (the first of them, warm-up, is not counted)
PROBE_MAX_STEPS = 12  # while the memory governor still probes the cut, the choice waits for it, up to this step
CHECK_EVERY = 25  # steps between the workers' comparisons of the measured share with the prediction
CHEAP_PROBE_S = 0.25  # the probe steps run exact where the link sums the model's bytes in at most this


@dataclasses.dataclass
class Outcome:
    """What a step's sync did after the optimizer step: the seconds an exchange waited (counted in the step), whether
    the workers may exchange after this step, and the events to log (rank 0's; none elsewhere)."""

    waited_s: float = 0.0
    exchanging: bool = True
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class SyncStrategy:
    """The sync of one run (see the module docstring). sync: the collectives; None for a worker alone."""

    def __init__(
        self,
        replica: Replica,
        sync: GradientSync | None,
        train: cfg.TrainConfig,
        *,
        overlaps: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.replica, self.train, self.clock = replica, train, clock
        #: Part of a group of workers (even of one, after the others were lost): choices are made and recorded.
        self.distributed = sync is not None
        self.sync: GradientSync = sync if sync is not None else LocalSync()
        self.rank0 = self.sync.rank == 0
        self.overlaps = overlaps
        if replica.sparse_optimizer is not None and self.sync.world_size > 1:
            # Every worker applies SignSGD to the union of the rows all workers touched, so tables stay equal.
            replica.sparse_optimizer.gather = self.sync.gather_rows
        self.mode: Mode = Exact(replica, self.sync, overlaps=overlaps) if self.distributed else Mode(replica, self.sync)
        params = [p for p in replica.model.parameters() if p.requires_grad]
        self.model_bytes = sum(p.numel() * p.element_size() for p in params)
        self.link: Link | None = None
        self.choice: Choice | None = None
        self.choices: list[dict[str, Any]] = []  # every sync-choice event of the run
        self.choosing = self.sync.world_size > 1 and (
            train.sync_mode == "auto" or (train.sync_mode == "local" and train.sync_every is None)
        )
        self._pending: list[dict[str, Any]] = []  # events not yet handed to the loop
        self._decide_at: int | None = None  # the step after which the first choice is made
        self._times: list[float] = []  # this worker's step seconds without sync since the last decision
        self._window = [0.0, 0.0]  # this worker's sync and step seconds since the last check
        self._total = [0.0, 0.0]  # the same over the run
        self._checked = 0  # the step of the last decision or check
        self.shares: dict[str, Any] | None = None
        self._restored = False
        self._unlanded: dict[str, Any] | None = None  # the state of the round the run's end landed
        self._expected = TARGET_SHARE  # the share of waiting the latest decision expects

    # -- the mode's settings, as the run's -------------------------------------------------------------------------

    @property
    def every(self) -> int | None:
        """H of the local rounds (None in other modes)."""
        return self.mode.every if isinstance(self.mode, Local) else None

    @property
    def overlap(self) -> int:
        """Inner steps a local round's exchange travels behind (0 in other modes)."""
        return self.mode.overlap if isinstance(self.mode, Local) else 0

    # -- the Trainer's step ------------------------------------------------------------------------------------------

    @property
    def steps_alone(self) -> bool:
        """This worker steps on its own samples (a local round's inner steps): the EMA waits for the round's end."""
        return self.mode.steps_alone

    @property
    def overlapped(self) -> bool:
        """This step's gradient sum starts during the last backward: its micro-batches run one after another."""
        return self.mode.overlapped

    def micro_batches(self, parts: Sequence[slice]) -> Iterator[slice]:
        """The step's micro-batches, in order (again, for a worker that redoes its samples)."""
        return self.mode.micro_batches(parts)

    def reduce(self, loss: Scalar, totals: dict[str, Scalar]) -> Reduced:
        """The step's sums over the workers (or this worker's own, stepping alone), the gradients ready to apply."""
        return self.mode.reduce(loss, totals)

    # -- the loop ----------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Before the first step: the mode the config sets, or the link measured and the probe steps' mode."""
        if not self.distributed or self._restored:
            return
        step = self.replica.step
        self._checked = step
        if self.sync.world_size == 1:  # a group of one (a restart on the machine left): nothing to exchange
            self._record(Choice("exact", None, 0, 0.0, "one worker: nothing to exchange"))
            return
        if not self.choosing:
            train = self.train
            if train.sync_mode == "local":
                # Rounds set by hand: a step's own sync says nothing of the round's sum (an inner step sums nothing),
                # yet the report and an elastic run's deadline need what the sum costs.
                self._measure_link()
            self._enter(train.sync_mode, train.sync_every, train.sync_overlap or 0)
            self._record(Choice(self.mode.name, self.every, self.overlap, None, "set by training.sync_mode"))
            return
        probe_s = self._measure_link()
        cheap = self.train.sync_mode == "auto" and self.link.seconds(self.model_bytes) <= CHEAP_PROBE_S
        self._enter(*(("exact", None, 0) if cheap else ("local", PROBE_STEPS, 0)))
        self._decide_at = step + PROBE_STEPS
        if self.rank0:
            logger.info(
                "sync: link %s (probed in %.2f s); timing %d steps %s before choosing a mode",
                self.link.describe(),
                probe_s,
                PROBE_STEPS,
                "with exact sync" if cheap else "in one local round",
            )

    @property
    def exchanging(self) -> bool:
        """The workers may exchange after the latest step: not inside a local round, except at the run's last step
        (every rank knows it: the peers log the round's rows)."""
        steps = self.train.steps
        return self.mode.boundary or (steps is not None and self.replica.step >= steps)

    def after_step(self, seconds: float, sync_seconds: float, probing: bool = False) -> Outcome:
        """After the optimizer step: a local round's exchange when due, then, at a round's end, the first choice or
        the drift check. seconds, sync_seconds: the step's, as the Trainer measured it; probing: the memory governor
        still probes the cut (the first choice waits for it, up to PROBE_MAX_STEPS)."""
        if not self.distributed:
            return Outcome()
        waited = self.mode.after_step()
        self._account(seconds - sync_seconds, sync_seconds + waited, seconds + waited)
        if self.mode.boundary:
            step = self.replica.step
            due = self._decide_at is not None and step >= self._decide_at
            if due and (not probing or step >= PROBE_MAX_STEPS):
                waited += self._decide(first=True)
            elif self.choosing and self._decide_at is None and step - self._checked >= CHECK_EVERY:
                waited += self._check()
        events, self._pending = (self._pending if self.rank0 else []), []  # each rank decided the same: rank 0 logs
        return Outcome(waited, self.exchanging, events)

    def finish(self) -> None:
        """Land the round in progress, for the final evaluation and checkpoint's model, after keeping its state for a
        resume (which continues the round as a longer run would have); every worker's share of waiting, and the
        run's (collectives)."""
        if not self.distributed:
            return
        mode = self.mode
        if isinstance(mode, Local) and (mode.steps or mode.in_flight):
            self._unlanded = {**self.state_dict(with_ema=True), "landed": True}
            mode.end_round(wait=True)
        gathered = self.sync.gather_floats(self._total)
        waited, total = sum(row[0] for row in gathered), sum(row[1] for row in gathered)
        self.shares = {
            "run": waited / total if total else 0.0,
            "workers": [row[0] / row[1] if row[1] else 0.0 for row in gathered],
        }

    def _account(self, compute_s: float, sync_s: float, step_s: float) -> None:
        self._times.append(compute_s)
        for acc in (self._window, self._total):
            acc[0] += sync_s
            acc[1] += step_s

    # -- choosing ----------------------------------------------------------------------------------------------------

    def _step_time(self, skip_first: bool) -> float:
        """The slowest worker's median step without sync over the latest steps (a collective)."""
        times = self._times[1:] if skip_first and len(self._times) > 1 else self._times
        mine = statistics.median(times) if times else 0.0
        return max(row[0] for row in self.sync.gather_floats([mine]))

    def _lateness(self) -> Lateness:
        """Every worker's step times without sync over the latest steps, the same steps each (a collective)."""
        mine = self._times[-CHECK_EVERY:]
        rows = self.sync.gather_floats([math.nan] * (CHECK_EVERY - len(mine)) + mine)
        shared = [i for i in range(CHECK_EVERY) if not any(math.isnan(row[i]) for row in rows)]
        return Lateness([[row[i] for i in shared] for row in rows])

    def _choose(self, step_s: float, late: Lateness) -> Choice:
        assert self.link is not None
        train = self.train
        limit = max(1, train.steps // 4) if train.steps else None  # a round no longer than a quarter of the run
        return choose(
            self.link,
            step_s,
            self.model_bytes,
            modes=MODES if train.sync_mode == "auto" else ("local",),
            every=train.sync_every,
            overlap=train.sync_overlap,
            late=late,
            **({"max_every": limit} if limit else {}),
        )

    def _decide(self, first: bool, measured: float | None = None) -> float:
        """Choose from the link and the latest steps (after the first choice, how late the slowest worker was too),
        switch, record; returns the seconds the switch waited."""
        step_s = self._step_time(skip_first=first)
        choice = self._choose(step_s, NO_LATENESS if first else self._lateness())
        kept = (choice.mode, choice.every, choice.overlap) == (self.mode.name, self.every, self.overlap)
        waited = self._enter(choice.mode, choice.every, choice.overlap)
        self._record(choice, step_s=step_s, measured=measured)
        # A choice kept on a re-measure makes the share measured its norm: the next drift is from there.
        self._expected = measured if kept and measured is not None else choice.share
        self._decide_at, self._times, self._window = None, [], [0.0, 0.0]
        self._checked = self.replica.step
        return waited

    def _check(self) -> float:
        """Compare the measured share of waiting with the prediction; on drift, measure and choose again."""
        gathered = self.sync.gather_floats(self._window)
        total = sum(row[1] for row in gathered)
        measured = sum(row[0] for row in gathered) / total if total else 0.0
        self._window, self._checked = [0.0, 0.0], self.replica.step
        predicted = self._expected
        high = measured > max(2 * predicted, TARGET_SHARE)
        low = self.mode.name != "exact" and measured < predicted / 4
        if not (high or low):
            self._times = []
            return 0.0
        return self._measure_link() + self._decide(first=False, measured=measured)  # measured, then decided

    def _measure_link(self) -> float:
        """The link measured (a collective: every rank calls it at the same point); returns the probe's seconds."""
        self.link, probe_s = measure_link(self.sync, self.replica.device, self.model_bytes, clock=self.clock)
        return probe_s

    def _record(self, choice: Choice, step_s: float | None = None, measured: float | None = None) -> None:
        self.choice = choice
        extra: dict[str, Any] = {"model_mb": self.model_bytes / 1e6}
        if self.link is not None:
            extra["link"] = self.link.to_dict()
        if step_s is not None:
            extra["step_s"] = step_s
        if measured is not None:
            extra["measured_share"] = measured
        interface = getattr(self.sync, "interface", None)
        if interface is not None:
            extra["interface"] = interface
        before = next((c for c in reversed(self.choices) if "link" in c), None) if measured is not None else None
        if before is not None and self.link is not None:  # measured again on drift: the link it was
            extra["link_before"] = {**before["link"], "step": before["step"]}
        event = choice.event(self.replica.step, **extra)
        self.choices.append(event)
        self._pending.append(event)
        if self.rank0:
            every = f" H={choice.every}" if choice.every else ""
            overlap = f" overlap {choice.overlap}" if choice.overlap else ""
            logger.info("step %d: sync %s%s%s: %s", self.replica.step, choice.mode, every, overlap, choice.reason)
            was = extra.get("link_before")
            if was is not None and extra["link"]["mbit_s"] < was["mbit_s"] / 2:
                through = f" through {interface}" if interface else ""
                logger.warning(
                    "step %d: the sync's link%s measured again: %s, %s Mbit/s at step %d",
                    self.replica.step,
                    through,
                    self.link.describe(),
                    mbit_text(was["mbit_s"]),
                    was["step"],
                )

    def _enter(self, mode: str, every: int | None, overlap: int) -> float:
        """Switch to a mode at a round's end (every rank at the same step); returns the seconds it waited."""
        current = self.mode
        if mode == current.name:
            if isinstance(current, Local):
                assert every is not None
                current.configure(every, overlap)
            return 0.0
        waited = current.leave()
        current.close()
        kind = REGISTRY[mode]
        if issubclass(kind, Local):
            assert every is not None
            train = self.train
            outer = {"outer_lr": train.outer_lr, "outer_momentum": train.outer_momentum}
            self.mode = kind(self.replica, self.sync, every, overlap=overlap, **outer)
        else:
            assert issubclass(kind, Exact)
            self.mode = kind(self.replica, self.sync, overlaps=self.overlaps)
        self.mode.enter()
        return waited

    # -- checkpoints and the summary ---------------------------------------------------------------------------------

    def state_dict(self, with_ema: bool = False) -> dict[str, Any]:
        """The mode, the choices, the rounds' state and each worker's error-feedback residual (a collective); after
        the run, the state of the round it landed at its end."""
        if self._unlanded is not None:
            return self._unlanded
        return {
            "mode": self.mode.name,
            "every": self.every,
            "overlap": self.overlap,
            "link": dataclasses.asdict(self.link) if self.link else None,
            "choice": dataclasses.asdict(self.choice) if self.choice else None,
            "choices": self.choices,
            "decide_at": self._decide_at,
            "rounds": self.mode.state_dict(with_ema),
            "residuals": self.sync.gather_objects(on_cpu(self.sync.compression_state())),
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue the saved mode (after the Trainer's state); on another number of workers the rounds drop the
        round in progress and rank 0 takes every residual, so nothing unsent is lost."""
        if not state:
            return
        self.link = Link(**state["link"]) if state["link"] else None
        self.choice = Choice(**state["choice"]) if state["choice"] else None
        if self.choice is not None and self.choice.share is not None:
            self._expected = self.choice.share
        self.choices = list(state["choices"])
        self._decide_at = state["decide_at"]
        self._enter(state["mode"], state["every"], state["overlap"])
        if state["rounds"] is not None:
            self.mode.load_state_dict(state["rounds"], landed=bool(state.get("landed")))
        if self.sync.world_size == 1 and self.mode.name != "exact":  # alone now: what the rounds held lands, then plain
            self._enter("exact", None, 0)
        saved = state["residuals"]
        if len(saved) == self.sync.world_size:
            residual = saved[self.sync.rank]
        else:
            kept = [r for r in saved if r is not None]
            residual = sum(kept[1:], kept[0].clone()) if kept and self.rank0 else None
        self.sync.load_compression_state(residual)
        self._restored = True

    def summary(self) -> dict[str, Any]:
        """The sync part of summary.json (nothing for a worker alone)."""
        if not self.distributed:
            return {}
        return {
            "sync_mode": self.mode.name,
            "sync_every": self.every,
            "sync_overlap": self.overlap,
            "sync_share": self.shares,
            "sync_reason": self.choice.reason if self.choice else None,
            "sync_choices": self.choices,
        }

    def close(self) -> None:
        """Release what the mode holds on the model (the overlapped sum's hooks)."""
        self.mode.close()
