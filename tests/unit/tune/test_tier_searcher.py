"""The Tune searcher across tiers: one trial per free machine, and a tier whose machines leave the cluster.

Fake per-tier searchers and a fake clock script the decisions; no Ray is started.
"""

from __future__ import annotations

from ray.tune.search import Searcher

from raytrm.tune.ray_search import TierSearcher


class FakeSearch:
    """Stands for one tier's ConstrainedOptunaSearch: numbers its trials, keeps what it was told."""

    def __init__(self, tier: str) -> None:
        self.tier, self.numbers, self.told = tier, {}, []

    def suggest(self, trial_id: str) -> dict:
        self.numbers[trial_id] = len(self.numbers)
        return {"tier": self.tier, "trial_number": self.numbers[trial_id]}

    def number_of(self, trial_id: str) -> int:
        return self.numbers[trial_id]

    def on_trial_complete(self, trial_id: str, result: dict | None, error: bool) -> None:
        self.told.append((self.numbers[trial_id], result, error))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def searcher(machines_now, clock, remaining=2):
    fakes = {t: FakeSearch(t) for t in ("air", "studio")}
    return TierSearcher(
        fakes, dict.fromkeys(fakes, remaining), dict.fromkeys(fakes, 1), "quality", machines_now, clock=clock
    ), fakes


def test_a_lost_tier_stops_with_its_dead_trial_recorded_and_the_other_tier_finishes():
    alive = {"air": 1, "studio": 1}
    clock = Clock()
    tiers, fakes = searcher(lambda: dict(alive), clock)
    assert tiers.suggest("t1")["tier"] == "air" and tiers.suggest("t2")["tier"] == "studio"
    assert tiers.suggest("t3") is None  # both machines busy
    progress = {"samples_per_sec": 41.0, "peak_memory_mb": 300.0, "final": False}
    tiers.on_trial_result("t1", progress)
    del alive["air"]  # the MacBook leaves mid-trial; Tune then reports the trial's error without a result
    tiers.on_trial_complete("t1", error=True)
    assert fakes["air"].told == [(0, progress, True)]  # recorded with what it measured, not lost
    assert tiers.lost == {"air": {"not_run": 1, "at": tiers.lost["air"]["at"]}} and tiers.died["air"] == [0]
    clock.now += 60
    assert tiers.suggest("t3") is None  # studio's machine is still busy; nothing more for air
    tiers.on_trial_complete("t2", {"status": "ok"})
    assert tiers.suggest("t3")["tier"] == "studio"
    tiers.on_trial_complete("t3", {"status": "ok"})
    assert tiers.suggest("t4") is Searcher.FINISHED
    assert [n for n, _, error in fakes["studio"].told if not error] == [0, 1]


def test_a_dead_trial_holds_its_tier_until_ray_could_have_noticed_the_node():
    clock = Clock()
    tiers, fakes = searcher(lambda: {"air": 1, "studio": 1}, clock, remaining=3)
    tiers.suggest("t1"), tiers.suggest("t2")
    tiers.on_trial_complete("t1", error=True)  # the trial died, but its machine is still in the cluster
    assert fakes["air"].told == [(0, None, True)] and tiers.lost == {}
    clock.now += 10
    assert tiers.suggest("t3") is None  # air's machine is free, but maybe dying: wait the grace period
    clock.now += 25
    assert tiers.suggest("t3")["tier"] == "air"  # still alive after it: trials go on
    assert tiers.lost == {}


def test_without_a_cluster_reader_tiers_are_never_lost():
    tiers, _ = searcher(None, Clock(), remaining=1)
    tiers.suggest("t1")
    tiers.on_trial_complete("t1", error=True)
    assert tiers.lost == {}


def test_a_shared_pool_places_trials_on_any_free_tier_and_survives_a_lost_one():
    # The learning search of a staged run: one count of trials for all tiers, each trial on whichever machine is free.
    alive = {"air": 1, "studio": 1}
    fakes = {t: FakeSearch(t) for t in ("air", "studio")}
    tiers = TierSearcher(
        fakes, dict.fromkeys(fakes, 3), dict.fromkeys(fakes, 1), "quality", lambda: dict(alive), clock=Clock(), pool=3
    )
    assert [tiers.suggest(t)["tier"] for t in ("t1", "t2")] == ["air", "studio"]
    del alive["air"]
    tiers.on_trial_complete("t1", error=True)  # air's machine left: the pool goes on on studio
    assert tiers.lost["air"]["not_run"] == 0 and tiers.pool == 1
    tiers.on_trial_complete("t2", {"status": "ok"})
    assert tiers.suggest("t3")["tier"] == "studio"
    assert tiers.suggest("t4") is None  # the pool is spent; t3 still runs
    tiers.on_trial_complete("t3", {"status": "ok"})
    assert tiers.suggest("t4") is Searcher.FINISHED
