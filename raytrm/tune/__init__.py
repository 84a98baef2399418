"""`raytrm tune` and `raytrm export`: Optuna studies driven by Ray Tune, one profile per machine tier.

- space, space_sections, params: the search space file, validated before any trial runs
- objectives, search, ray_search: what a trial's measurements tell the sampler, in this process or under Ray Tune
- staged: the two searches of a space with a horizon (speed knobs per tier, learning knobs for all tiers)
- trial, curves: one trial (the Trainer, short and measured) and learning curves in samples
- layout: the run directory's files, storage and study names, and what each trial is handed
- tuner: drives a run; progress prints a line per trial
- studies, verify, profiles, tables, plots: a run's studies read back, its picks re-run on their tiers, exported as
  profiles, tabled and plotted
"""
