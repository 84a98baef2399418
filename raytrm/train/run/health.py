"""Training health, live: the detectors that say a run is not learning, as one hook of the training loop.

After every step the hook reads the step's loss (the task's cross-entropy where it reports one: TRM's and the
language model's `lm_loss`, the classifier's `ce_loss`), its accuracy, the gradient norm before clipping and, on the
steps that measure it (logged ones, and every UPDATE_EVERY-th), the update/weight ratio, and runs the detectors below
on their history. Each finding is one warning line with the likely cause and the fix, built from the run's own
values (`Finding.line`), and one event in metrics.jsonl (`health-<kind>` with the same `reason` and `fix`), which
`raytrm report` prints as it is. The thresholds (docs/architecture.md states them for users):

- not learning: after the lr warm-up, the loss within 2% of the labels' entropy (the loss of predicting the labels'
  frequencies whatever the input: ln 9 on Sudoku, uniform over the digits) and the accuracy within 0.02 of chance
  (the most frequent label's share), for `training.not_learning_steps` steps in a row;
- non-finite: a loss or gradient norm that is NaN or infinite, at any step;
- absurd: at any step, the warm-up included, a loss ABSURD times what a uniform guess over the model's outputs costs
  (ln of the vocabulary or the classes; the labels' entropy where that is unknown). A model starts near ln(V) (the
  recorded real runs at most 1.5 times it); ten times it puts V^-10 on the right label on average, logits tens of
  nats wrong, which only weights blown up by an update give;
- frozen: at any step, the weights not moving. On FROZEN_CHECKS measured steps in a row the update/weight ratio, taken
  at the configured lr (the warm-up's and the schedule's lower lr scaled back up: Adam's update is proportional to
  lr), under FROZEN_RATIO, the rounding of a float32 weight, so the updates are lost to it; or the loss the same to
  LOSS_ROUNDING of itself for WINDOW steps in a row (the same batch on weights that do not change);
- spike: after the warm-up, a loss above the median of the last WINDOW steps by half that median and a tenth of the
  entropy, or a gradient norm SPIKE_GRAD times its median over them;
- rising: after the warm-up, the median loss of the last WINDOW steps 20% and a tenth of the entropy above the
  lowest such median of the run;
- plateau: the median loss of the last WINDOW steps less than 1% below the one `training.plateau_steps` steps before.

Each kind fires once a run. `halt_on` names the kinds that end the run: a tuning trial stops when it is not learning,
non-finite or frozen (a run that cannot learn: its quality at the end would be the untrained model's, after the
trial's whole budget); an absurd loss does not stop it, as a run can come back from one and, if it does not, the
plateau or the overflow that follows stops it. `raytrm train` with `training.early_stop` stops on those three and
on a plateau.
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
from raytrm.train.run.size_rule import size_rule
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
ABSURD = 10.0  # a loss this many times a uniform guess's
FROZEN_RATIO = 2.0**-24  # half a float32 ulp, relative: a weight's update smaller than this rounds away
FROZEN_CHECKS = 3  # measured steps in a row: one step may update nothing by design (a skipped step), three do not
LOSS_ROUNDING = 1e-6  # a loss that moves less than this share of itself moves only by float32 rounding
UPDATE_EVERY = 10  # steps between measures of the update ratio where no metrics row asks for one (a trial)
FAR_BELOW = 10.0  # an lr this many times under the size rule's is far below it

NOT_LEARNING, NON_FINITE, SPIKE, RISING, PLATEAU_KIND = "not-learning", "non-finite", "spike", "rising", "plateau"
ABSURD_KIND, FROZEN = "absurd-loss", "frozen"
#: Each kind's name in a report.
NAMES = {
    NOT_LEARNING: "not learning",
    NON_FINITE: "non-finite loss",
    ABSURD_KIND: "absurd loss",
    FROZEN: "weights frozen",
    SPIKE: "loss spike",
    RISING: "loss rising",
    PLATEAU_KIND: "plateau",
}
EVENT_PREFIX = "health-"
#: What a tuning trial halts on: a run that will not or cannot learn.
TRIAL_HALTS = (NOT_LEARNING, NON_FINITE, FROZEN)
#: What `training.early_stop` halts `raytrm train` on.
EARLY_STOP_HALTS = (NOT_LEARNING, NON_FINITE, FROZEN, PLATEAU_KIND)


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
    suggested_lr: float | None = None  # the size rule's learning rate for this model (raytrm.train.run.experiment)
    not_learning_steps: int = 40
    plateau_steps: int = 200
    early_stop: bool = False
    outputs: int | None = None  # what the model chooses each label from: its vocabulary, or the classes

    @property
    def scale(self) -> float:
        """The smallest change of the loss that counts: a tenth of the entropy."""
        return ENTROPY_SHARE * self.entropy if self.entropy else DEFAULT_SCALE

    def guess(self) -> tuple[float, str] | None:
        """What a uniform guess over the outputs costs, in nats and in words (else the labels' entropy, which no
        larger vocabulary lowers); None where neither is known."""
        if self.outputs and self.outputs > 1:
            return math.log(self.outputs), f"ln({self.outputs})={math.log(self.outputs):.3f}, a uniform guess"
        if self.entropy:
            return self.entropy, f"{self.entropy_text()}, the labels' frequencies"
        return None

    def entropy_text(self) -> str:
        assert self.entropy is not None
        if self.classes:
            return f"ln({self.classes})={self.entropy:.3f}"
        return f"the labels' entropy {self.entropy:.3f}"

    def lower_lr(self) -> str:
        if self.suggested_lr and self.suggested_lr < 0.9 * self.lr:
            return f"lower training.lr (now {self.lr:.3g}; the size rule gives {self.suggested_lr:.2g} for this model)"
        return f"lower training.lr (now {self.lr:.3g}; try {self.lr / 3:.2g})"

    def raise_lr(self) -> str:
        if self.suggested_lr and self.lr * FAR_BELOW < self.suggested_lr:
            return (
                f"raise training.lr (--lr): {self.lr:.3g} is far below the size rule's {self.suggested_lr:.2g} for "
                "this model"
            )
        rule = f"; the size rule gives {self.suggested_lr:.2g} for this model" if self.suggested_lr else ""
        return f"raise training.lr (--lr, now {self.lr:.3g}{rule})"

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
        self.recent: deque[float] = deque(maxlen=WINDOW)  # the last steps' losses, for the frozen check
        self.still: list[tuple[int, float]] = []  # (step, ratio at the configured lr) of measured steps in a row
        self.observed = 0

    def observe(
        self,
        step: int,
        loss: float,
        accuracy: float | None,
        grad_norm: float | None,
        update_ratio: float | None = None,
        lr: float | None = None,
    ) -> list[Finding]:
        """The findings of the step that just ended (step: the steps done, this one included; update_ratio where the
        step measured it; lr: the step's, the configured one where not given)."""
        c = self.context
        self.observed += 1
        found = []
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            found.append(self._non_finite(step, loss, grad_norm))
            return [f for f in found if self._first(f)]
        absurd = self._absurd(step, loss)
        if absurd is not None:
            found.append(absurd)
        frozen = self._frozen(step, loss, grad_norm, update_ratio, c.lr if lr is None else lr)
        if frozen is not None:
            found.append(frozen)
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

    def _absurd(self, step: int, loss: float) -> Finding | None:
        c = self.context
        guess = c.guess()
        if guess is None or loss <= ABSURD * guess[0]:
            return None
        times = f"{loss / guess[0]:.0f} times {guess[1]}"
        if self.observed == 1:  # its loss is of the weights the run started from: no update of its own yet
            return Finding(
                ABSURD_KIND,
                step,
                f"loss is {loss:.3g} at step {step}, {times}, before any update: the weights the run started from "
                "predict the labels confidently wrong",
                "check the checkpoint it resumed from (--resume) and that the data's labels are the task's",
            )
        return Finding(
            ABSURD_KIND,
            step,
            f"loss is {loss:.3g} at step {step}, {times}: an update blew the weights up"
            + (" inside the lr warm-up" if step <= c.warmup_steps else ""),
            c.lower_lr() + ("" if c.grad_clip else f", {c.clip()}"),
        )

    def _frozen(
        self, step: int, loss: float, grad_norm: float | None, ratio: float | None, lr: float
    ) -> Finding | None:
        c = self.context
        self.recent.append(loss)
        if ratio is not None and lr > 0 and math.isfinite(ratio):
            at_lr = ratio * c.lr / lr  # Adam's update scales with lr: what the configured lr moves
            self.still = [*self.still, (step, at_lr)][-FROZEN_CHECKS:] if at_lr < FROZEN_RATIO else []
        grad = f" (gradient norm {grad_norm:.3g})" if grad_norm is not None else ""
        fix = (
            "the loss sends no gradient to the weights: check the data's labels and the model"
            if grad_norm == 0
            else c.raise_lr()
        )
        if len(self.still) >= FROZEN_CHECKS:
            first, _ = self.still[0]
            largest = max(r for _, r in self.still)
            return Finding(
                FROZEN,
                step,
                f"the updates moved the weights by at most {largest:.2g} of their norm a step over "
                f"{FROZEN_CHECKS} measured steps ({first} to {step}) at lr {c.lr:.3g}{grad}, under a float32 "
                f"weight's rounding ({FROZEN_RATIO:.2g}): the loss cannot move",
                fix,
            )
        spread = max(self.recent) - min(self.recent)
        if len(self.recent) == WINDOW and loss > c.scale and spread <= LOSS_ROUNDING * loss:
            return Finding(
                FROZEN,
                step,
                f"loss has stayed at {loss:.6g} (within {spread / loss:.1g} of itself) for {WINDOW} steps up to "
                f"step {step}{grad}: the weights are not moving",
                fix,
            )
        return None

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


def output_count(data: Any) -> int | None:
    """How many values the model chooses each label from: the classes of a classifier, else the vocabulary."""
    meta = getattr(data, "metadata", None)
    if getattr(meta, "task", None) == "classify":
        return int(meta.num_classes)
    vocab = getattr(meta, "vocab_size", None)
    return int(vocab) if vocab else None


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
                outputs=output_count(trainer.train_data),
            )
        )

    def before_step(self, loop: Loop) -> None:
        upcoming = self.trainer.step + 1
        self.trainer.watch_update = loop.logged(upcoming) or upcoming % UPDATE_EVERY == 0

    def end_step(self, loop: Loop, step: Step) -> Stop | None:
        assert self.monitor is not None
        result, trainer = step.result, self.trainer
        found = self.monitor.observe(
            trainer.step,
            task_loss(result),
            result.metrics.get("accuracy"),
            result.grad_norm,
            update_ratio=result.update_ratio,
            lr=trainer.current_lr,
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
