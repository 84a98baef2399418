"""What `python -m benchmarks distributed --parts link` trains: its two models, and the training fields of each
sync mode.

TRM is `raytrm train`'s default (mlp_t on generated Sudoku) at hidden 256 and global batch 64; the LM is a byte-level
transformer of 20.6M parameters (hidden 512, 6 layers), whose gradients weigh most. Each run trains a fixed number
of steps, a metrics row each step, and is evaluated once at the end: its quality at that many samples.
"""

from __future__ import annotations

import copy
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrm import config as cfg
from raytrm.errors import UserError

#: The modes of training.sync_mode; "local:H" is local with training.sync_every H.
SYNC_MODES = ("exact", "compressed", "local", "auto")
BASELINE_MODE = "exact"  # every row's ratio is to this mode on the unshaped link
#: The summary.json field read as each model's quality, and its name in the table.
QUALITY = {"trm": ("eval_cell_acc", "cell acc"), "lm": ("eval_bits_per_byte", "bits/byte")}
LM_CORPUS_BYTES = 512 * 2**10  # its held-out 5% keeps the LM's final evaluation to ~100 windows on a CPU


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
    from benchmarks.transformer import caches_in
    from raytrm.data.cache import dataset_dir_for
    from raytrm.families.trm import EMBEDDED_DEFAULT

    base = copy.deepcopy(EMBEDDED_DEFAULT)
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
    work_dir: Path, steps: int = 20, hidden: int = 512, layers: int = 6, seq_len: int = 256, batch: int = 32
) -> LinkModel:
    """The byte-level transformer LM (hidden 512, 6 layers: 20.6M parameters) on a slice of this Python's standard
    library sources written into work_dir. A run is long enough for the rounds a slow link needs: a round is at most
    a quarter of the run, and at 100 Mbit/s summing the LM's 82 MB takes about half a step of this batch on 2 cores."""
    from benchmarks.transformer import HEAD_DIM

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
    from benchmarks.transformer import caches_in
    from raytrm.train.trainer import Trainer

    experiment = copy.deepcopy(model.experiment)
    experiment["training"]["device"] = "cpu"
    with caches_in(work_dir / "cache"):
        trainer = Trainer(cfg.from_dict(cfg.ExperimentConfig, experiment, f"the {model.name} link model"))
    try:
        return trainer.model.num_parameters()
    finally:
        trainer.close()


def default_modes() -> list[str]:
    return list(SYNC_MODES)


def mode_settings(mode: str) -> dict[str, Any]:
    """The training fields of a mode: exact, compressed, local, local:H (H inner steps a round) or auto."""
    name, _, every = mode.partition(":")
    if name not in SYNC_MODES or (every and (name != "local" or not every.isdigit() or int(every) < 1)):
        raise UserError(f"sync mode {mode!r}: expected one of {', '.join(SYNC_MODES)} or local:H with H >= 1")
    return {"sync_mode": name, **({"sync_every": int(every)} if every else {})}
