"""`python -m benchmarks distributed --parts link`: two workers on two hosts joined by a link of a set rate.

The hosts are tests.support.hosts' namespace pair (root, Linux): `raytrm cluster head` on host a, `raytrm cluster join`
on host b, then `raytrm train --address auto` on a, which trains one worker on each host. For each link rate (tc tbf
on both ends), each model (benchmarks.link_models: TRM, a byte-level LM whose gradients weigh most, and a 110M causal
LM with LoRA, whose sync sums its adapters alone) and each sync mode, one run of a fixed number of steps gives
samples/s, the sync share of a step and the quality after the run's samples (benchmarks.link_runs says how each is
read).

Every configuration runs once per round (--link-rounds), the rates in alternating order; each figure is the median
over rounds, and each row's ratio is against the unshaped link with exact sync. The link's measured TCP rate and the
machine's load average are recorded beside each run.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.link_models import (
    QUALITY,
    LinkModel,
    default_modes,
    hflora_model,
    lm_model,
    mode_settings,
    sizes,
    trm_model,
)
from benchmarks.link_runs import LinkRow, LinkRun, format_rows, read_run, rows_of, run_line
from raytrm import config as cfg
from raytrm.errors import UserError
from tests.support.hosts import UNSHAPED, Pair, cannot_make_hosts, rate_bits

logger = logging.getLogger(__name__)

RATES = (UNSHAPED, "1gbit", "100mbit", "20mbit")
RUN_SECONDS = 600  # a run's time limit: this, plus STEP_SECONDS a step
STEP_SECONDS = 180


def check_rates(rates: list[str]) -> None:
    for rate in rates:
        try:
            rate_bits(rate)
        except ValueError as e:
            raise UserError(str(e)) from None


def refuse_unless_possible() -> None:
    """One line and exit code 2 where the pair cannot be made (not root, not Linux, tools missing)."""
    reason = cannot_make_hosts()
    if reason:
        raise UserError(f"--parts link builds two hosts from network namespaces, which it cannot here: {reason}")


# -- the pair ------------------------------------------------------------------------------------------------------


def start_cluster(pair: Pair) -> None:
    """A head on host a; host b joins it with the head's token (what `scp HEAD:.ray/auth_token` does)."""
    a, b = pair.a, pair.b
    a.raytrm("cluster", "head", check=True, timeout=300)
    token = b.home / ".ray" / "auth_token"
    token.parent.mkdir(exist_ok=True)
    token.write_text((a.home / ".ray" / "auth_token").read_text())
    token.chmod(0o600)
    b.raytrm("cluster", "join", a.ip, check=True, timeout=300)


def train_on_pair(pair: Pair, model: LinkModel, mode: str, run_dir: Path) -> dict[str, Any]:
    """One `raytrm train --address auto` of the model in the mode, driven from host a; its figures."""
    experiment = copy.deepcopy(model.experiment)
    experiment["training"].update(mode_settings(mode))
    config = run_dir.with_suffix(".yaml")
    cfg.write_yaml(cfg.from_dict(cfg.ExperimentConfig, experiment, f"the {model.name} link run"), config)
    args = ("train", "--config", str(config), "--address", "auto", "--out", str(run_dir), "--quiet")
    done = pair.a.raytrm(*args, timeout=RUN_SECONDS + STEP_SECONDS * model.steps)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-20:]
        raise RuntimeError(f"`raytrm {' '.join(args)}` exited {done.returncode}:\n" + "\n".join(tail))
    return read_run(run_dir, model)


def measure(
    pair: Pair, models: list[LinkModel], rates: list[str], modes: list[str], rounds: int, work_dir: Path
) -> tuple[list[LinkRun], list[dict[str, Any]]]:
    """Every (rate, model, mode) once a round, the rates' order reversed every other round; the runs and the link
    measured at each rate."""
    runs: list[LinkRun] = []
    links: list[dict[str, Any]] = []
    for r in range(rounds):
        for rate in rates if r % 2 == 0 else rates[::-1]:
            pair.set_rate(rate)
            link = {"round": r, "rate": rate, "a_to_b_mbit": pair.transfer_mbit("a")}
            link["b_to_a_mbit"] = pair.transfer_mbit("b")
            links.append(link)
            logger.info("link %s: %.1f Mbit/s a -> b, %.1f b -> a", rate, link["a_to_b_mbit"], link["b_to_a_mbit"])
            for model in models:
                for mode in modes:
                    run_dir = work_dir / f"{model.name}-{rate}-{mode.replace(':', '')}-{r}"
                    try:
                        figures = train_on_pair(pair, model, mode, run_dir)
                        error = ""
                    except (RuntimeError, OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
                        figures, error = {}, str(e)
                    run = LinkRun(model.name, rate, mode, r, link["a_to_b_mbit"], os.getloadavg()[0], **figures)
                    run.error = error
                    runs.append(run)
                    logger.info("%s", run_line(run))
    return runs, links


# -- the part ------------------------------------------------------------------------------------------------------


@dataclass
class LinkReport:
    models: list[dict[str, Any]]
    links: list[dict[str, Any]]
    runs: list[LinkRun]
    rows: list[LinkRow]

    def table(self) -> str:
        return format_rows(self.rows, self.models)

    def to_json(self) -> dict[str, Any]:
        return {
            "models": self.models,
            "links": self.links,
            "rows": [asdict(r) for r in self.rows],
            "runs": [asdict(r) for r in self.runs],
        }


def bench_link(models: list[LinkModel], rates: list[str], modes: list[str], rounds: int, work_dir: Path) -> LinkReport:
    """Make the pair, start the cluster on it, measure every configuration, and remove the pair whatever happened."""
    refuse_unless_possible()
    check_rates(rates)
    for mode in modes:
        mode_settings(mode)
    described = [
        {
            "name": m.name,
            "description": m.description,
            **sizes(m, work_dir),
            "steps": m.steps,
            "global_batch": m.global_batch,
            "samples": m.steps * m.global_batch,
            "warmup": m.warmup,
            "quality": QUALITY[m.name][0],
            "experiment": m.experiment,
        }
        for m in models
    ]
    runs_dir = work_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    with Pair(work_dir / "hosts") as pair:
        start_cluster(pair)
        runs, links = measure(pair, models, rates, modes, rounds, runs_dir)
        for host in (pair.b, pair.a):
            host.raytrm("cluster", "stop")
    return LinkReport(described, links, runs, rows_of(runs))


def run(
    rates: list[str], modes: list[str] | None, names: list[str], steps: list[int] | None, rounds: int, work_dir: Path
) -> LinkReport:
    """The link part as `python -m benchmarks distributed` runs it: the full-size models named, at the rates and
    modes."""
    refuse_unless_possible()
    steps = steps or []
    builders = {"trm": trm_model, "lm": lm_model, "hflora": hflora_model}
    models = []
    for k, name in enumerate(names):
        sized = {"steps": steps[min(k, len(steps) - 1)]} if steps else {}
        models.append(builders[name](work_dir, **sized))
    return bench_link(models, rates, modes or default_modes(), rounds, work_dir)
