"""Workers for the elastic training tests: a tiny TRM trained by the one loop over raytrm.sync.membership's groups,
each in a process of its own around a store the test serves."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any

import torch

from raytrm.sync.membership import Membership, RunFinished
from raytrm.sync.process_group import ProcessGroupSync
from raytrm.train.elastic import Elastic
from raytrm.train.loop import Hook, Loop, Stop
from raytrm.train.run.evaluations import IntervalEvaluation
from raytrm.train.run.metrics import read_metrics
from raytrm.train.run.peers import PeersHook
from raytrm.train.run.stop_rules import StepLimit
from raytrm.train.trainer import Trainer


def steps_logged(run_dir: Path) -> int:
    """The last step with a loss in a run directory's metrics.jsonl (0 before the first)."""
    path = run_dir / "metrics.jsonl"
    rows = [r for r in read_metrics(path) if "step" in r and "loss" in r] if path.exists() else []
    return max((r["step"] for r in rows), default=0)


class StopWhenAsked(Hook):
    """Ends the run at the first step after the test sets the store's "stop" key (rank 0 reads it, all agree)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def end_step(self, loop: Loop, step: Any) -> Any:
        asked = loop.trainer.sync.rank == 0 and self.store.check(["stop"])
        return Stop("asked") if loop.agreed(asked) else None


class Gaps(Hook):
    """The wall time between one step's end and the next's, on this worker."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.gaps: list[float] = []

    def end_step(self, loop: Loop, step: Any) -> None:
        now = time.monotonic()
        if self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now


class EvaluateEvery(Hook):
    """`raytrm train`'s evaluations into every step's row (as MetricsRows asks for them); with plan['slow_eval'],
    each evaluation first sleeps that long (rank 0's work alone, longer than a collective's deadline)."""

    def __init__(self, trainer: Trainer, elastic: Elastic, plan: dict[str, Any]) -> None:
        evaluate, sleep = trainer.evaluate, plan.get("slow_eval", 0.0)
        self.taken = 0  # evaluations this worker took

        def slow(**kw: Any) -> dict[str, Any]:
            time.sleep(sleep)
            self.taken += 1
            return evaluate(**kw)

        trainer.evaluate = slow  # type: ignore[method-assign]
        self.evaluations = IntervalEvaluation(trainer, plan["eval_every"], elastic.alone)

    def end_step(self, loop: Loop, step: Any) -> None:
        self.evaluations.row_scores(loop.trainer.step)

    def finish(self, loop: Loop) -> None:
        self.evaluations.finish(loop)


def worker(name: str, port: int, plan: dict[str, Any], config: Any, results: Any) -> None:
    """Train to plan['steps'] with the run's membership; puts the final weights, the step and the changes seen."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    members = Membership(store, name, deadline=plan["deadline"], settle_s=plan["settle"])
    elastic = Elastic(members)
    device = torch.device("cpu")
    if plan.get("join"):
        trainer = Trainer(config)
        results.put(("ready", name, os.getpid()))
        try:
            elastic.enter(trainer, lambda: ProcessGroupSync(device))
        except RunFinished:
            results.put(("done", name, {"finished_outside": True}))
            return
    else:
        members.start(plan["size"])
        trainer = Trainer(config, sync=ProcessGroupSync(device))
        results.put(("ready", name, os.getpid()))
    gaps = Gaps()
    limit = StopWhenAsked(store) if plan.get("until_asked") else StepLimit(plan["steps"])
    evaluations = EvaluateEvery(trainer, elastic, plan) if plan.get("eval_every") else None
    hooks = [PeersHook(trainer), gaps, limit, evaluations]
    loop = Loop(trainer, [h for h in hooks if h is not None], measure_peak=False, regroup=elastic)
    try:
        loop.run()
    except RunFinished:  # left behind, and the others ended the run before this worker was let back in
        results.put(("done", name, {"finished_outside": True}))
        return
    # As numpy: a tensor would travel through a file descriptor that dies with this process.
    weights = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]).numpy()
    members.leave()
    evaluated = evaluations.taken if evaluations is not None else 0
    log = {"step": trainer.step, "weights": weights, "changes": elastic.changes, "gaps": gaps.gaps}
    results.put(("done", name, {**log, "evaluated": evaluated}))
