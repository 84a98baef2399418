"""Plots of a tuning run, per tier, as PNG files in the run directory (optuna.visualization.matplotlib).

matplotlib rather than plotly: a PNG opens anywhere (Finder's Quick Look, a terminal image viewer, a CI artifact)
without a browser or a 3.5 MB JavaScript bundle per file.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from raytrm.tune.layout import PLOTS_DIR, read_state
from raytrm.tune.studies import load_study

logger = logging.getLogger(__name__)


def write_plots(run_dir: str | Path) -> list[Path]:
    """Optimization history, parameter importances and (multi-objective) the Pareto front, for each tier's study;
    for a staged run, each tier's speed study and the learning study, with its trials' evaluations at the rungs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    run_dir = Path(run_dir)
    state = read_state(run_dir)
    written = []
    studies = {tier: state["studies"][tier] for tier in state["tiers"]}
    if state.get("learning_study"):
        studies = {f"{tier}-speed": name for tier, name in studies.items()} | {"learning": state["learning_study"]}
    for label, study_name in studies.items():
        study = load_study(state, study_name)
        multi = len(study.directions) > 1
        plots = {
            "importances": lambda s, multi=multi: ovm.plot_param_importances(
                s, target=(lambda t: t.values[0]) if multi else None
            )
        }
        if multi:
            plots["pareto"] = lambda s: ovm.plot_pareto_front(
                s, target_names=["quality", "samples/s"], constraints_func=lambda t: list(t.constraints.values())
            )
            plots["history"] = lambda s: ovm.plot_optimization_history(
                s, target=lambda t: t.values[0], target_name="quality"
            )
        else:
            plots["history"] = lambda s: ovm.plot_optimization_history(s)
        if label == "learning" and any(trial.intermediate_values for trial in study.trials):  # evaluations a pruner saw
            plots["rungs"] = lambda s: ovm.plot_intermediate_values(s)
        for name, draw in plots.items():
            path = run_dir / PLOTS_DIR / f"{label}-{name}.png"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ax = draw(study)
                path.parent.mkdir(parents=True, exist_ok=True)
                ax.figure.savefig(path, dpi=100, bbox_inches="tight")
                plt.close(ax.figure)
                written.append(path)
            except Exception as e:  # e.g. importances need two finished trials with varied parameters
                logger.info("no %s plot for %s: %s", name, label, e)
    return written
