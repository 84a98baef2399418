"""Ray Tune's side of the search: one constrained OptunaSearch per tier, multiplexed in one Tune run."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch
from ray.tune.stopper import Stopper
from ray.tune.utils.util import unflatten_dict

from raytrm.tune import objectives
from raytrm.tune.params import suggest
from raytrm.tune.search import failed_result, make_pruner, make_sampler, record, should_stop
from raytrm.tune.space import SearchSpace

logger = logging.getLogger(__name__)


class ConstrainedOptunaSearch(OptunaSearch):
    """OptunaSearch for one tier's study: constraints and measurements recorded on every completed trial.

    Several may share one study (a staged search's learning study: one per tier, all asking the same study, each
    placing its trials on its own tier); `extra` goes into every config it suggests (that tier's speed knobs).
    """

    def __init__(
        self, space: SearchSpace, tier: str, study_name: str, storage: Any, seed: int, extra: dict | None = None
    ) -> None:
        params = space.parsed
        names = objectives.metric_names(space.objective)
        super().__init__(
            space=lambda trial: suggest(trial, params),
            metric=names if len(names) > 1 else names[0],
            mode=["max"] * len(names) if len(names) > 1 else "max",
            sampler=make_sampler(space, seed),
            study_name=study_name,
            storage=storage,
        )
        self.tier, self.objective, self.extra = tier, space.objective, dict(extra or {})
        self._ot_study.pruner = make_pruner(space)  # OptunaSearch builds its study with a NopPruner

    def suggest(self, trial_id: str) -> dict | None:
        params = super().suggest(trial_id)
        return {"tier": self.tier, "trial_number": self.number_of(trial_id), "params": params, **self.extra}

    def number_of(self, trial_id: str) -> int:
        """The study's number of the trial that Tune calls trial_id."""
        return self._ot_trials[trial_id].number

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        """Intermediate evaluations reach the study through PrunerStopper, which reports them before deciding."""

    def should_stop(self, trial_id: str, result: dict) -> bool:
        """Report an intermediate evaluation to the trial's study; True when its pruner stops the trial."""
        value = objectives.objective_values(result, self.objective)[0]
        return should_stop(self._ot_trials[trial_id], value, int(result["evaluation"]))

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id in self._completed_trials:
            return
        ot_trial = self._ot_trials[trial_id]
        if result:
            result = unflatten_dict(result)  # Tune hands searchers flattened results ("experiment/model/...")
        if error or not result or "status" not in result:
            result = failed_result(result, "the trial process died or raised (see the Ray Tune log)")
        # A trial stopped by the pruner ends on an intermediate evaluation.
        pruned = not error and result.get("final") is False
        try:
            record(self._ot_study, ot_trial, result, self.objective, pruned=pruned)
        except Exception as exc:  # a storage hiccup must not end the whole study
            logger.warning("could not record trial %d: %s", ot_trial.number, exc)
        self._completed_trials.add(trial_id)


class TierSearcher(Searcher):
    """One ConstrainedOptunaSearch per tier; suggests for a tier only while one of its machines is free.

    With `machines_now` (tier -> alive machines, read from the cluster) it notices a tier whose last machine left:
    that tier's study stops where it is (`lost` says when and what it did not run) and the others go on. A trial
    that dies is recorded with its last progress report, and its tier gets no new trial for `grace_s`, the time
    Ray may take to declare a vanished node dead.

    With `pool` the tiers share one count of trials (a study that any machine may run: a staged search's learning
    study) instead of each tier having its own in `remaining`; a lost tier then leaves the pool to the others.
    """

    def __init__(
        self,
        searchers: dict[str, ConstrainedOptunaSearch],
        remaining: dict[str, int],
        machines: dict[str, int],
        objective: str,
        machines_now: Callable[[], dict[str, int]] | None = None,
        check_every_s: float = 2.0,
        grace_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        pool: int | None = None,
    ) -> None:
        names = objectives.metric_names(objective)
        super().__init__(metric=names if len(names) > 1 else names[0], mode="max")
        self.searchers, self.remaining, self.machines = searchers, dict(remaining), dict(machines)
        self.live: dict[str, int] = dict.fromkeys(searchers, 0)
        self.tier_of: dict[str, str] = {}
        self.last: dict[str, dict] = {}  # each running trial's latest progress report
        self.lost: dict[str, dict[str, Any]] = {}
        self.machines_now, self.check_every_s, self.grace_s, self.clock = machines_now, check_every_s, grace_s, clock
        self._checked = -math.inf
        self._suspect: dict[str, float] = {}  # tier -> when one of its trials died
        self.died: dict[str, list[int]] = {t: [] for t in searchers}  # trial numbers whose process died
        self.pool = pool

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec: Any) -> bool:
        return True  # the space, metrics and modes come from the space file

    def _refresh(self, force: bool = False) -> None:
        """Re-read the machines of every tier; a tier with none left is lost."""
        now = self.clock()
        if self.machines_now is None or (not force and now - self._checked < self.check_every_s):
            return
        self._checked = now
        counts = self.machines_now()
        for tier in self.searchers:
            if counts.get(tier, 0) > 0:
                self.machines[tier] = counts[tier]
            elif tier not in self.lost:
                not_run = self.remaining.get(tier, 0) if self.pool is None else 0  # a shared pool goes on elsewhere
                self.lost[tier] = {"not_run": not_run, "at": time.time()}
                logger.warning(
                    "tier %s lost: its last machine left the cluster; its study stops with %d trial(s) not run",
                    tier,
                    self.lost[tier]["not_run"],
                )
                self.remaining[tier] = 0

    def suggest(self, trial_id: str) -> dict | None:
        self._refresh()
        now = self.clock()
        for tier, since in list(self._suspect.items()):
            if now - since >= self.grace_s:
                del self._suspect[tier]
                self._refresh(force=True)
        if self.pool is not None:
            open_tiers = [t for t in self.searchers if t not in self.lost] if self.pool > 0 else []
        else:
            open_tiers = [t for t, n in self.remaining.items() if n > 0]
        if not open_tiers and not any(self.live.values()):
            return Searcher.FINISHED
        free = [t for t in open_tiers if self.live[t] < self.machines.get(t, 1) and t not in self._suspect]
        if not free:
            return None  # every machine of the tiers still searching is busy: Tune asks again later
        tier = min(free, key=lambda t: (self.live[t] / max(1, self.machines.get(t, 1)), t))
        config = self.searchers[tier].suggest(trial_id)
        if config is None:
            return None
        self.tier_of[trial_id] = tier
        if self.pool is not None:
            self.pool -= 1
        else:
            self.remaining[tier] -= 1
        self.live[tier] += 1
        return config

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        self.last[trial_id] = result

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        tier = self.tier_of.pop(trial_id, None)
        last = self.last.pop(trial_id, None)
        if tier is None:
            return
        self.live[tier] -= 1
        if error:  # Tune hands an errored trial's searcher no result: its last progress report is what it measured
            result = result or last
            self.died[tier].append(self.searchers[tier].number_of(trial_id))
            self._suspect[tier] = self.clock()
            self._refresh(force=True)
        self.searchers[tier].on_trial_complete(trial_id, result, error)

    def save(self, checkpoint_path: str) -> None:
        # The optuna storage is the study's state; Tune's own snapshot of the searcher is not used to resume.
        with open(checkpoint_path, "w") as f:
            json.dump({"remaining": self.remaining}, f)

    def restore(self, checkpoint_path: str) -> None:
        pass


class PrunerStopper(Stopper):
    """Ends a trial that an intermediate evaluation puts behind its tier's study, as the space's pruner decides.

    Tune consults a stopper before any searcher sees a result, so this is where each intermediate evaluation is
    reported to Optuna (per tier: each tier's study prunes against its own machines' trials only).
    """

    def __init__(self, searcher: TierSearcher | None) -> None:
        self.searcher = searcher

    def __getstate__(self) -> dict:
        # Tune pickles its run config into the experiment state; the live stopper keeps the driver's searcher.
        return {}

    def __setstate__(self, state: dict) -> None:
        self.searcher = None

    def __call__(self, trial_id: str, result: dict) -> bool:
        tier = self.searcher.tier_of.get(trial_id) if self.searcher else None
        if tier is None or result.get("final") is not False or result.get("evaluation") is None:
            return False  # a final result, or a progress report: nothing for the pruner
        stop = self.searcher.searchers[tier].should_stop(trial_id, result)
        if stop:
            logger.info("trial %s of %s pruned at evaluation %s", trial_id, tier, result.get("evaluation"))
        return stop

    def stop_all(self) -> bool:
        return False
