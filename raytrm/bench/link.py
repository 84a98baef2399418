"""`raytrm bench distributed --parts link`: two workers on two hosts joined by a link of a set rate.

The hosts are raytrm.bench.hosts' namespace pair (root, Linux): `raytrm cluster head` on host a, `raytrm cluster join`
on host b, then `raytrm train --address auto` on a, which trains one worker on each host. For each link rate (tc tbf
on both ends), each model (the TRM of `raytrm train`'s default at hidden 256, and a byte-level transformer LM of 20.6M
parameters, whose gradients weigh most) and each sync mode, one run of a fixed number of steps gives:

- samples/s over the run's steps after its first ones (start-up, the memory governor's probes): total samples over
  total seconds, so a mode whose rounds sync every H steps is timed over whole rounds, not by its median step;
- the sync share: the fraction of a step spent waiting on sync, as summary.json gives it, else from the workers'
  rows (the slowest worker's sync over its step, as `raytrm report` reads it);
- the quality after the run's fixed number of samples (TRM: eval cell accuracy; LM: eval bits per byte).

Every configuration runs once per round (--repeats rounds), the rates in alternating order; each figure is the median
over rounds, and each row's ratio is against the unshaped link with exact sync. The link's measured TCP rate and the
machine's load average are recorded beside each run.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from raytrm import config as cfg
from raytrm.bench.hosts import UNSHAPED, Pair, cannot_make_hosts, rate_bits
from raytrm.errors import UserError

logger = logging.getLogger(__name__)

RATES = (UNSHAPED, "1gbit", "100mbit", "20mbit")
#: The modes of training.sync_mode; "local:H" is local with training.sync_every H.
SYNC_MODES = ("exact", "compressed", "local", "auto")
BASELINE_MODE = "exact"
#: Quality read from summary.json per model family, and whether higher is better.
QUALITY = {"trm": ("eval_cell_acc", "cell acc"), "lm": ("eval_bits_per_byte", "bits/byte")}
LM_CORPUS_BYTES = 512 * 2**10  # its held-out 5% keeps the LM's final evaluation to ~100 windows on a CPU
RUN_SECONDS = 600  # a run's time limit: this, plus STEP_SECONDS a step
STEP_SECONDS = 180


@dataclass(frozen=True)
class LinkModel:
    """One model the pair trains at every rate and in every mode."""

    name: str  # "trm" or "lm"
    experiment: dict[str, Any]  # its model, data and training sections, as a config file holds them
    warmup: int  # the first steps, left out of the timing
    description: str

    @property
    def steps(self) -> int:
        return self.experiment["training"]["steps"]

    @property
    def global_batch(self) -> int:
        return self.experiment["training"]["global_batch_size"]


def _run_settings(steps: int) -> dict[str, Any]:
    """A run of exactly `steps` steps, a metrics row each step, one evaluation at the end."""
    return {"steps": steps, "time_budget_s": None, "log_interval": 1, "eval_interval": None}


def _warmup(steps: int) -> int:
    return max(2, steps // 6)


def trm_model(
    work_dir: Path, steps: int = 60, hidden: int = 256, batch: int = 64, train_puzzles: int = 4000, augment: int = 4
) -> LinkModel:
    """`raytrm train`'s default TRM (mlp_t on generated Sudoku) at `hidden`, its dataset generated into work_dir."""
    from raytrm.bench.transformer import caches_in
    from raytrm.data.cache import dataset_dir_for
    from raytrm.train.defaults import DEFAULT_EXPERIMENT

    base = copy.deepcopy(DEFAULT_EXPERIMENT)
    data = cfg.from_dict(cfg.DataConfig, {**base["data"], "train_puzzles": train_puzzles, "augment": augment})
    with caches_in(work_dir / "cache"):
        path = dataset_dir_for(data)
    experiment = {
        "model": {**base["model"], "hidden_size": hidden},
        "data": {"path": str(path)},
        "training": {**base["training"], "global_batch_size": batch, **_run_settings(steps)},
    }
    text = f"TRM mlp_t hidden {hidden}, global batch {batch}"
    return LinkModel("trm", experiment, _warmup(steps), text)


def lm_model(
    work_dir: Path, steps: int = 8, hidden: int = 512, layers: int = 6, seq_len: int = 256, batch: int = 8
) -> LinkModel:
    """The byte-level transformer LM (hidden 512, 6 layers: 20.6M parameters) on a slice of this Python's standard
    library sources written into work_dir."""
    from raytrm.bench.transformer import HEAD_DIM

    model = {"name": "transformer", "task": "lm", "hidden_size": hidden, "num_heads": max(1, hidden // HEAD_DIM)}
    training = {"global_batch_size": batch, "lr": 1e-3, "warmup_steps": 2, "weight_decay": 0.1, "grad_clip": 1.0}
    experiment = {
        "model": {**model, "layers": layers, "seq_len": seq_len},
        "data": {"name": "text", "path": str(stdlib_corpus(work_dir / "corpus.py.txt"))},
        "training": {**training, **_run_settings(steps)},
    }
    text = f"byte-level LM hidden {hidden}, {layers} layers, seq {seq_len}, global batch {batch}"
    return LinkModel("lm", experiment, _warmup(steps), text)


def stdlib_corpus(path: Path, size: int = LM_CORPUS_BYTES) -> Path:
    """The first `size` bytes of this Python's top-level standard library modules, in name order."""
    if not path.exists():
        chunks, total = [], 0
        for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            chunks.append(source.read_bytes())
            total += len(chunks[-1])
            if total >= size:
                break
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(chunks)[:size])
    return path


def parameters(model: LinkModel, work_dir: Path) -> int:
    """The model's parameter count, from a Trainer built here on the CPU."""
    from raytrm.bench.transformer import caches_in
    from raytrm.train.trainer import Trainer

    experiment = copy.deepcopy(model.experiment)
    experiment["training"]["device"] = "cpu"
    with caches_in(work_dir / "cache"):
        trainer = Trainer(cfg.from_dict(cfg.ExperimentConfig, experiment, f"the {model.name} link model"))
    try:
        return trainer.model.num_parameters()
    finally:
        trainer.close()


def sync_modes_built() -> bool:
    """Whether this build's training config has sync modes (training.sync_mode); before them, exact sync only."""
    return "sync_mode" in {f.name for f in dataclasses.fields(cfg.TrainConfig)}


def default_modes() -> list[str]:
    return list(SYNC_MODES) if sync_modes_built() else [BASELINE_MODE]


def mode_settings(mode: str) -> dict[str, Any]:
    """The training fields of a mode: exact, compressed, local, local:H (H inner steps a round) or auto."""
    name, _, every = mode.partition(":")
    if name not in SYNC_MODES or (every and (name != "local" or not every.isdigit() or int(every) < 1)):
        raise UserError(f"sync mode {mode!r}: expected one of {', '.join(SYNC_MODES)} or local:H with H >= 1")
    if not sync_modes_built():
        if mode != BASELINE_MODE:
            raise UserError(f"sync mode {mode!r}: this build has exact sync only (no training.sync_mode); drop it")
        return {}
    return {"sync_mode": name, **({"sync_every": int(every)} if every else {})}


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


# -- one run -------------------------------------------------------------------------------------------------------


@dataclass
class LinkRun:
    """One run's figures (or its failure)."""

    model: str
    rate: str
    mode: str
    round: int
    link_mbit: float  # what one TCP connection carried from host a to b just before
    load: float  # this machine's 1-minute load average at the run's end
    samples_per_sec: float | None = None
    sync_share: float | None = None
    sync_share_from: str = ""  # "summary" or "worker rows"
    quality: float | None = None
    chosen: str = ""  # the sync mode (and H) summary.json records, where it records one
    workers: int | None = None
    timed_steps: int = 0
    error: str = ""


def read_run(run_dir: Path, model: LinkModel) -> dict[str, Any]:
    """A finished run's figures from its summary.json and metrics.jsonl (a row each step)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "event" not in r and r.get("samples_per_sec")]
    timed = [r for r in rows if r["step"] > model.warmup] or rows
    seconds = [model.global_batch / r["samples_per_sec"] for r in timed]
    share, source = _summary_share(summary), "summary"
    if share is None:
        share, source = _rows_share(timed), "worker rows"
    chosen = summary.get("sync_mode") or ""
    if chosen and summary.get("sync_every"):
        chosen += f" H={summary['sync_every']}"
    return {
        "samples_per_sec": model.global_batch * len(timed) / sum(seconds),
        "sync_share": share,
        "sync_share_from": source if share is not None else "",
        "quality": summary.get(QUALITY[model.name][0]),
        "chosen": chosen,
        "workers": summary.get("workers", 1),
        "timed_steps": len(timed),
    }


def _summary_share(summary: dict[str, Any]) -> float | None:
    """The run's sync share where summary.json records it: a number, or the run's beside each worker's."""
    share = summary.get("sync_share")
    if isinstance(share, dict):
        share = share.get("run")
    return float(share) if isinstance(share, (int, float)) else None


def _rows_share(rows: list[dict[str, Any]]) -> float | None:
    """The slowest worker's sync over its step, summed over the rows: a worker's sync holds its wait for slower
    workers, so the sync itself is read off the one that waits for no one."""
    sync = step = 0.0
    for row in rows:
        workers = row.get("workers") or []
        if not workers:
            continue
        slow = max(workers, key=lambda w: w.get("compute_s") or 0.0)
        sync += slow.get("sync_s") or 0.0
        step += (slow.get("compute_s") or 0.0) + (slow.get("sync_s") or 0.0)
    return sync / step if step > 0 else None


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
                    logger.info("%s", _run_line(run))
    return runs, links


def _run_line(run: LinkRun) -> str:
    where = f"round {run.round} {run.model} {run.rate} {run.mode}"
    if run.error:
        return f"{where}: FAILED: {run.error.splitlines()[0]}"
    share = f"{run.sync_share:.3f}" if run.sync_share is not None else "-"
    return (
        f"{where}: {run.samples_per_sec:.2f} samples/s, sync share {share}, quality {run.quality} (load {run.load:.1f})"
    )


# -- rows ----------------------------------------------------------------------------------------------------------


@dataclass
class LinkRow:
    """The medians of one (model, rate, mode) over the rounds, against the model's unshaped exact row."""

    model: str
    rate: str
    mode: str
    samples_per_sec: float | None
    ratio: float | None
    sync_share: float | None
    quality: float | None
    quality_delta: float | None
    link_mbit: float
    load: float
    runs: int
    failed: int
    chosen: list[str] = field(default_factory=list)


def _median(values: list[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def rows_of(runs: list[LinkRun]) -> list[LinkRow]:
    """One row per (model, rate, mode), in the order first run."""
    groups: dict[tuple[str, str, str], list[LinkRun]] = {}
    for run in runs:
        groups.setdefault((run.model, run.rate, run.mode), []).append(run)
    rows = []
    for (model, rate, mode), found in groups.items():
        ok = [r for r in found if not r.error]
        rows.append(
            LinkRow(
                model,
                rate,
                mode,
                _median([r.samples_per_sec for r in ok]),
                None,
                _median([r.sync_share for r in ok]),
                _median([r.quality for r in ok]),
                None,
                statistics.median(r.link_mbit for r in found),
                statistics.median(r.load for r in found),
                len(found),
                len(found) - len(ok),
                sorted({r.chosen for r in ok if r.chosen}),
            )
        )
    for row in rows:
        base = next((b for b in rows if (b.model, b.rate, b.mode) == (row.model, UNSHAPED, BASELINE_MODE)), None)
        if base is None:
            continue
        if row.samples_per_sec is not None and base.samples_per_sec:
            row.ratio = row.samples_per_sec / base.samples_per_sec
        if row.quality is not None and base.quality is not None:
            row.quality_delta = row.quality - base.quality
    return rows


def format_rows(rows: list[LinkRow], models: list[dict[str, Any]]) -> str:
    lines = [
        f"{m['name']}: {m['description']}, {m['parameters']:,} parameters, {m['steps']} steps ({m['samples']:,} "
        f"samples), timed after step {m['warmup']}"
        for m in models
    ]
    lines.append(
        f"{'model':<5} {'link':<9} {'mode':<11} {'samples/s':>9} {'ratio':>6} {'sync':>6} {'quality':>17} "
        f"{'delta':>7} {'link Mbit/s':>11} {'load':>5}  runs"
    )
    for r in rows:
        name = QUALITY[r.model][1]
        quality = f"{name} {r.quality:.4f}" if r.quality is not None else "-"
        cells = [
            f"{r.samples_per_sec:>9.2f}" if r.samples_per_sec is not None else f"{'-':>9}",
            f"{r.ratio:>6.3f}" if r.ratio is not None else f"{'':>6}",
            f"{r.sync_share:>6.3f}" if r.sync_share is not None else f"{'-':>6}",
            f"{quality:>17}",
            f"{r.quality_delta:>+7.4f}" if r.quality_delta is not None else f"{'':>7}",
        ]
        note = f"{r.runs}" + (f", {r.failed} failed" if r.failed else "")
        if r.chosen:
            note += f"; chose {', '.join(r.chosen)}"
        where = f"{r.model:<5} {r.rate:<9} {r.mode:<11}"
        lines.append(f"{where} {' '.join(cells)} {r.link_mbit:>11.1f} {r.load:>5.1f}  {note}")
    return "\n".join(lines)


# -- the part ------------------------------------------------------------------------------------------------------


@dataclass
class LinkReport:
    models: list[dict[str, Any]]
    links: list[dict[str, Any]]
    runs: list[LinkRun]
    rows: list[LinkRow]

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
            "parameters": parameters(m, work_dir),
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
    """The link part as `raytrm bench distributed` runs it: the full-size models named, at the rates and modes."""
    refuse_unless_possible()
    steps = steps or []
    builders = {"trm": trm_model, "lm": lm_model}
    models = []
    for k, name in enumerate(names):
        sized = {"steps": steps[min(k, len(steps) - 1)]} if steps else {}
        models.append(builders[name](work_dir, **sized))
    return bench_link(models, rates, modes or default_modes(), rounds, work_dir)
