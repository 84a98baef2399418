"""Training health, live: the detectors that say a run is not learning, as one hook of the training loop.

After every step the hook reads the step's loss (the task's cross-entropy where it reports one: TRM's and the
language model's `lm_loss`, the classifier's `ce_loss`), its accuracy and the gradient norm before clipping, and runs
the detectors below on their history. Each finding is one warning line with the likely cause and the fix, built from
the run's own values (`Finding.line`), and one event in metrics.jsonl (`health-<kind>` with the same `reason` and
`fix`), which `raytrm report` prints as it is. The thresholds (docs/architecture.md states them for users):

- not learning: after the lr warm-up, the loss within 2% of the labels' entropy (the loss of predicting the labels'
  frequencies whatever the input: ln 9 on Sudoku, uniform over the digits) and the accuracy within 0.02 of chance
  (the most frequent label's share), for `training.not_learning_steps` steps in a row;
- non-finite: a loss or gradient norm that is NaN or infinite;
- spike: after the warm-up, a loss above the median of the last WINDOW steps by half that median and a tenth of the
  entropy, or a gradient norm SPIKE_GRAD times its median over them;
- rising: after the warm-up, the median loss of the last WINDOW steps 20% and a tenth of the entropy above the
  lowest such median of the run;
- plateau: the median loss of the last WINDOW steps less than 1% below the one `training.plateau_steps` steps before.

Each kind fires once a run. `halt_on` names the kinds that end the run: a tuning trial stops when it is not learning
or non-finite; `raytrm train` with `training.early_stop` stops on those and on a plateau.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from raytrm.train.loop import Hook, Loop, Step, Stop
from raytrm.train.size_rule import size_rule
from raytrm.train.trainer import StepResult, Trainer

logger = logging.getLogger(__name__)

WINDOW = 20  # steps whose median a spike, a rise and a plateau are measured against
AT_ENTROPY = 0.02  # the loss within this share of the labels' entropy...
AT_CHANCE = 0.02  # ...and the accuracy within this of chance: the model ignores its input
SPIKE_LOSS, SPIKE_GRAD = 0.5, 10.0  # a loss half again its median; a gradient norm ten times its median
RISE = 0.2  # the median loss this share above its lowest
PLATEAU = 0.01  # a fall smaller than this share over plateau_steps
ENTROPY_SHARE = 0.1  # spikes and rises must also exceed this share of the entropy (small losses are noisy)
DEFAULT_SCALE = 0.05  # that margin, in nats, where the labels' entropy is unknown
BASELINE_EXAMPLES = 256  # training examples whose labels give the entropy and chance

NOT_LEARNING, NON_FINITE, SPIKE, RISING, PLATEAU_KIND = "not-learning", "non-finite", "spike", "rising", "plateau"
#: Each kind's name in a report.
NAMES = {
    NOT_LEARNING: "not learning",
    NON_FINITE: "non-finite loss",
    SPIKE: "loss spike",
    RISING: "loss rising",
    PLATEAU_KIND: "plateau",
}
EVENT_PREFIX = "health-"
#: What a tuning trial halts on: a run that will not learn.
TRIAL_HALTS = (NOT_LEARNING, NON_FINITE)
#: What `training.early_stop` halts `raytrm train` on.
EARLY_STOP_HALTS = (NOT_LEARNING, NON_FINITE, PLATEAU_KIND)


@dataclasses.dataclass
class Finding:
    """One detection: its kind, the step, what the run shows and its likely cause (`reason`), and the fix."""

    kind: str
    step: int
    reason: str
    fix: str

    @property
    def name(self) -> str:
        return NAMES.get(self.kind, self.kind)

    def line(self) -> str:
        """The warning line a person reads."""
        return f"step {self.step}: {self.reason}; {self.fix}"

    def event(self) -> dict[str, Any]:
        """Its line in metrics.jsonl."""
        return {"step": self.step, "event": EVENT_PREFIX + self.kind, "reason": self.reason, "fix": self.fix}

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> Finding | None:
        """The finding a metrics.jsonl event records, or None for another kind of event."""
        name = str(event.get("event", ""))
        if not name.startswith(EVENT_PREFIX):
            return None
        kind = name.removeprefix(EVENT_PREFIX)
        return cls(kind, int(event["step"]), str(event.get("reason", "")), str(event.get("fix", "")))


@dataclasses.dataclass
class Context:
    """What the detectors compare against and the fixes name: the labels' entropy and chance accuracy (None where
    unknown), and the run's settings."""

    entropy: float | None
    chance: float | None
    classes: int | None  # how many labels, where they are equally frequent (the entropy then reads ln(classes))
    lr: float
    warmup_steps: int
    grad_clip: float | None = None
    dtype: str = "float32"
    suggested_lr: float | None = None  # the size rule's learning rate for this model (raytrm.train.defaults)
    not_learning_steps: int = 40
    plateau_steps: int = 200
    early_stop: bool = False

    @property
    def scale(self) -> float:
        """The smallest change of the loss that counts: a tenth of the entropy."""
        return ENTROPY_SHARE * self.entropy if self.entropy else DEFAULT_SCALE

    def entropy_text(self) -> str:
        assert self.entropy is not None
        if self.classes:
            return f"ln({self.classes})={self.entropy:.3f}"
        return f"the labels' entropy {self.entropy:.3f}"

    def lower_lr(self) -> str:
        if self.suggested_lr and self.suggested_lr < 0.9 * self.lr:
            return f"lower training.lr (now {self.lr:.3g}; the size rule gives {self.suggested_lr:.2g} for this model)"
        return f"lower training.lr (now {self.lr:.3g}; try {self.lr / 3:.2g})"

    def clip(self) -> str:
        return (
            f"clip the gradient (training.grad_clip, now {self.grad_clip if self.grad_clip else 'off'}; 1.0 is usual)"
        )


class HealthMonitor:
    """The detectors over a run's history, one step at a time (no torch: tests script the history)."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self.fired: set[str] = set()
        self.losses: deque[float] = deque(maxlen=WINDOW)
        self.grads: deque[float] = deque(maxlen=WINDOW)
        self.medians: deque[float] = deque(maxlen=context.plateau_steps + 1)
        self.lowest: float | None = None
        self.at_chance = 0  # steps in a row at the entropy and chance, after the warm-up

    def observe(self, step: int, loss: float, accuracy: float | None, grad_norm: float | None) -> list[Finding]:
        """The findings of the step that just ended (step: the steps done, this one included)."""
        c = self.context
        found = []
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            found.append(self._non_finite(step, loss, grad_norm))
            return [f for f in found if self._first(f)]
        warmed = step > c.warmup_steps
        if warmed and self._at_chance(loss, accuracy):
            self.at_chance += 1
        else:
            self.at_chance = 0
        if self.at_chance >= c.not_learning_steps:
            found.append(self._not_learning(step, loss, accuracy))
        full = len(self.losses) == WINDOW
        if warmed and full:
            spike = self._spike(step, loss, grad_norm)
            if spike is not None:
                found.append(spike)
        self.losses.append(loss)
        if grad_norm is not None:
            self.grads.append(grad_norm)
        if len(self.losses) == WINDOW:
            median = statistics.median(self.losses)
            self.medians.append(median)
            if warmed:
                found += self._trend(step, median)
        return [f for f in found if self._first(f)]

    def _first(self, finding: Finding) -> bool:
        if finding.kind in self.fired:
            return False
        self.fired.add(finding.kind)
        return True

    def _at_chance(self, loss: float, accuracy: float | None) -> bool:
        c = self.context
        if c.entropy is None or abs(loss - c.entropy) > AT_ENTROPY * c.entropy:
            return False
        return accuracy is None or c.chance is None or accuracy <= c.chance + AT_CHANCE

    def _not_learning(self, step: int, loss: float, accuracy: float | None) -> Finding:
        c = self.context
        acc = f" with accuracy {accuracy:.3f} (chance {c.chance:.3f})" if accuracy is not None and c.chance else ""
        what = "uniformly" if c.classes else "the labels' frequencies"
        return Finding(
            NOT_LEARNING,
            step,
            f"loss has sat at {c.entropy_text()} for {self.at_chance} steps{acc}: the model predicts {what}, "
            "whatever its input",
            f"{c.lower_lr()} or raise training.warmup_steps (now {c.warmup_steps})",
        )

    def _non_finite(self, step: int, loss: float, grad_norm: float | None) -> Finding:
        c = self.context
        grad = f" (gradient norm {grad_norm:.3g})" if grad_norm is not None else ""
        dtype = f", or train in float32 (training.dtype, now {c.dtype})" if c.dtype in ("bfloat16", "float16") else ""
        return Finding(
            NON_FINITE,
            step,
            f"loss is {loss:.3g} at step {step}{grad}: an update overflowed, and the weights are lost from here",
            f"{c.lower_lr()}, {c.clip()}{dtype}",
        )

    def _spike(self, step: int, loss: float, grad_norm: float | None) -> Finding | None:
        c = self.context
        median = statistics.median(self.losses)
        grad_median = statistics.median(self.grads) if len(self.grads) == WINDOW else None
        loss_spike = loss > median + max(SPIKE_LOSS * median, c.scale)
        grad_spike = grad_norm is not None and bool(grad_median) and grad_norm > SPIKE_GRAD * grad_median
        if not (loss_spike or grad_spike):
            return None
        grad = f" (gradient norm {grad_norm:.3g}, median {grad_median:.3g})" if grad_median and grad_norm else ""
        return Finding(
            SPIKE,
            step,
            f"loss jumped to {loss:.3g} at step {step}, against a median of {median:.3g} over the last {WINDOW} "
            f"steps{grad}: an unstable update",
            f"{c.clip()} or {c.lower_lr()}",
        )

    def _trend(self, step: int, median: float) -> list[Finding]:
        c = self.context
        found = []
        self.lowest = median if self.lowest is None else min(self.lowest, median)
        if median > self.lowest * (1 + RISE) and median - self.lowest > c.scale:
            found.append(
                Finding(
                    RISING,
                    step,
                    f"loss rose from {self.lowest:.3g} to {median:.3g} (medians of {WINDOW} steps) by step {step}: "
                    "the run is diverging",
                    f"{c.lower_lr()}, {c.clip()}, or decay the lr (training.schedule: cosine)",
                )
            )
        if len(self.medians) > c.plateau_steps and self.at_chance == 0 and NOT_LEARNING not in self.fired:
            before = self.medians[0]
            if median > before * (1 - PLATEAU):
                stop = (
                    "the run stops here (training.early_stop)"
                    if c.early_stop
                    else "training.early_stop ends a run here"
                )
                found.append(
                    Finding(
                        PLATEAU_KIND,
                        step,
                        f"loss went from {before:.3g} to {median:.3g} (medians of {WINDOW} steps) in the last "
                        f"{c.plateau_steps} steps, less than {PLATEAU:.0%} down: a plateau at lr {c.lr:.3g}",
                        f"decay the lr as the run goes (training.schedule: cosine), or stop: {stop}",
                    )
                )
        return found


def task_loss(result: StepResult) -> float:
    """The step's cross-entropy where the task reports it apart (TRM's includes its halting loss), else its loss."""
    for key in ("lm_loss", "ce_loss"):
        value = result.metrics.get(key)
        if value is not None:
            return float(value)
    return float(result.loss)


def label_baseline(data: Any, examples: int = BASELINE_EXAMPLES) -> tuple[float, float, int | None]:
    """(entropy in nats, chance accuracy, the number of labels where they are equally frequent) of the labels of a
    spread of training examples: what a model that ignores its input scores."""
    count = len(data)
    indices = np.unique(np.linspace(0, count - 1, num=min(count, examples)).astype(np.int64))
    labels = np.asarray(data.batch(indices)["labels"]).ravel()
    labels = labels[labels >= 0]  # ignored positions (-100)
    counts = np.bincount(labels)
    shares = counts[counts > 0] / max(1, labels.size)
    entropy = float(-(shares * np.log(shares)).sum())
    classes = len(shares)
    uniform = classes > 1 and abs(entropy - math.log(classes)) <= 0.01 * math.log(classes)
    return entropy, float(shares.max()), classes if uniform else None


class Health(Hook):
    """The detectors as a hook: every worker watches the same summed loss and gradient, rank 0 warns and records.

    halt_on: the kinds of finding that end the run (with several workers, when any worker finds one).
    """

    def __init__(self, trainer: Trainer, halt_on: Iterable[str] = ()) -> None:
        self.trainer, self.halt_on = trainer, set(halt_on)
        self.rank0 = trainer.sync.rank == 0
        self.findings: list[Finding] = []
        self.monitor: HealthMonitor | None = None

    def start(self, loop: Loop) -> None:
        trainer = self.trainer
        train = trainer.config.training
        entropy, chance, classes = label_baseline(trainer.train_data)
        self.monitor = HealthMonitor(
            Context(
                entropy,
                chance,
                classes,
                lr=train.lr,
                warmup_steps=train.warmup_steps,
                grad_clip=train.grad_clip,
                dtype=str(trainer.dtype).removeprefix("torch."),
                suggested_lr=size_rule(trainer.config.model)[0],
                not_learning_steps=train.not_learning_steps,
                plateau_steps=train.plateau_steps,
                early_stop=train.early_stop,
            )
        )

    def before_step(self, loop: Loop) -> None:
        self.trainer.watch_update = loop.logged(self.trainer.step + 1)

    def end_step(self, loop: Loop, step: Step) -> Stop | None:
        assert self.monitor is not None
        result = step.result
        found = self.monitor.observe(
            self.trainer.step, task_loss(result), result.metrics.get("accuracy"), result.grad_norm
        )
        for finding in found:
            self.findings.append(finding)
            step.events.append(finding.event())
            if self.rank0:
                logger.warning("%s", finding.line())
        if not self.halt_on:
            return None
        halting = next((f for f in found if f.kind in self.halt_on), None)
        if self.trainer.sync.world_size > 1:  # every rank asks at every step, so none waits on a collective alone
            if loop.agreed(halting is not None):
                return Stop(f"early stop: {halting.name if halting else 'another worker found the run unhealthy'}")
        elif halting is not None:
            return Stop(f"early stop: {halting.name}")
        return None

    def found(self, *kinds: str) -> Finding | None:
        """The first finding of one of these kinds, if any."""
        return next((f for f in self.findings if f.kind in kinds), None)
