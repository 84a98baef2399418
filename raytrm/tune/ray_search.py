"""Ray Tune's side of the search: one constrained OptunaSearch per tier, multiplexed in one Tune run."""

from __future__ import annotations

import json
import logging
from typing import Any

from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch
from ray.tune.utils.util import unflatten_dict

from raytrm.tune import objectives
from raytrm.tune.search import failed_result, make_sampler, record
from raytrm.tune.space import SearchSpace, suggest

logger = logging.getLogger(__name__)


class ConstrainedOptunaSearch(OptunaSearch):
    """OptunaSearch for one tier's study: constraints and measurements recorded on every completed trial."""

    def __init__(self, space: SearchSpace, tier: str, study_name: str, storage: Any, seed: int) -> None:
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
        self.tier, self.objective = tier, space.objective

    def suggest(self, trial_id: str) -> dict | None:
        params = super().suggest(trial_id)
        number = self._ot_trials[trial_id].number
        return {"tier": self.tier, "trial_number": number, "params": params}

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        """Trials report once, at their end; nothing to prune on."""

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id in self._completed_trials:
            return
        ot_trial = self._ot_trials[trial_id]
        if result:
            result = unflatten_dict(result)  # Tune hands searchers flattened results ("experiment/model/...")
        if error or not result or "status" not in result:
            result = failed_result(result, "the trial process died or raised (see the Ray Tune log)")
        try:
            record(self._ot_study, ot_trial, result, self.objective)
        except Exception as exc:  # a storage hiccup must not end the whole study
            logger.warning("could not record trial %d: %s", ot_trial.number, exc)
        self._completed_trials.add(trial_id)


class TierSearcher(Searcher):
    """One ConstrainedOptunaSearch per tier; suggests for a tier only while one of its machines is free."""

    def __init__(
        self,
        searchers: dict[str, ConstrainedOptunaSearch],
        remaining: dict[str, int],
        machines: dict[str, int],
        objective: str,
    ) -> None:
        names = objectives.metric_names(objective)
        super().__init__(metric=names if len(names) > 1 else names[0], mode="max")
        self.searchers, self.remaining, self.machines = searchers, dict(remaining), dict(machines)
        self.live: dict[str, int] = dict.fromkeys(searchers, 0)
        self.tier_of: dict[str, str] = {}

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec: Any) -> bool:
        return True  # the space, metrics and modes come from the space file

    def suggest(self, trial_id: str) -> dict | None:
        open_tiers = [t for t, n in self.remaining.items() if n > 0]
        if not open_tiers and not any(self.live.values()):
            return Searcher.FINISHED
        free = [t for t in open_tiers if self.live[t] < self.machines.get(t, 1)]
        if not free:
            return None  # every machine of the tiers still searching is busy: Tune asks again later
        tier = min(free, key=lambda t: (self.live[t] / max(1, self.machines.get(t, 1)), t))
        config = self.searchers[tier].suggest(trial_id)
        if config is None:
            return None
        self.tier_of[trial_id] = tier
        self.remaining[tier] -= 1
        self.live[tier] += 1
        return config

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        pass

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        tier = self.tier_of.pop(trial_id, None)
        if tier is None:
            return
        self.live[tier] -= 1
        self.searchers[tier].on_trial_complete(trial_id, result, error)

    def save(self, checkpoint_path: str) -> None:
        # The optuna storage is the study's state; Tune's own snapshot of the searcher is not used to resume.
        with open(checkpoint_path, "w") as f:
            json.dump({"remaining": self.remaining}, f)

    def restore(self, checkpoint_path: str) -> None:
        pass
