"""What `python -m benchmarks distributed --parts link` trains: its three models, and the training fields of each
sync mode.

TRM is `raytrm train`'s default (mlp_t on generated Sudoku) at hidden 256 and global batch 64; the LM is a byte-level
transformer of 20.6M parameters (hidden 512, 6 layers), whose gradients weigh most; hflora is the hf family's
causal LM of 110M parameters (random weights, benchmarks.link_lora) with LoRA, where only the adapters train, so a
sync sums about 1% of the model's bytes. Each run trains a fixed number of steps, a metrics row each step, and is
evaluated once at the end: its quality at that many samples.
"""

from __future__ import annotations

import copy
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrm import config as cfg
from raytrm.errors import UserError

if TYPE_CHECKING:
    from benchmarks.link_lora import Layout

#: The modes of training.sync_mode; "local:H" is local with training.sync_every H.
SYNC_MODES = ("exact", "compressed", "local", "auto")
BASELINE_MODE = "exact"  # every row's ratio is to this mode on the unshaped link
#: The summary.json field read as each model's quality, and its name in the table.
QUALITY = {
    "trm": ("eval_cell_acc", "cell acc"),
    "lm": ("eval_bits_per_byte", "bits/byte"),
    "hflora": ("eval_loss", "loss"),
}
LM_CORPUS_BYTES = 512 * 2**10  # its held-out 5% keeps the LM's final evaluation to ~100 windows on a CPU
#: hflora's held-out share of the docstrings: the last 1% (about 30 of them), so that its final evaluation, a
#: forward of the 110M model over each held-out window on one core, stays short.
HFLORA_HELD_SHARE = 0.01


@dataclass(frozen=True)
class LinkModel:
    """One model the pair trains at every rate and in every mode."""

    name: str  # a key of QUALITY
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


def hflora_model(
    work_dir: Path,
    steps: int = 20,
    seq_len: int = 128,
    batch: int = 8,
    rank: int = 8,
    lr: float = 1e-3,
    layout: Layout | None = None,
) -> LinkModel:
    """The hf family's causal LM of `layout` (110M parameters by default, random weights; benchmarks.link_lora) with
    LoRA of `rank` on the family's default targets (peft's for Llama: q_proj and v_proj), trained as language-model
    records on benchmarks.hf_corpus' docstrings; base directory and text built into work_dir once. A step of this
    batch is a few seconds on one core a worker; the sync sums the adapters only. With random base weights the lr
    is a from-scratch one, not fine-tuning's."""
    from benchmarks.hf_corpus import build_corpus
    from benchmarks.link_lora import Layout, base_dir, record_texts
    from raytrm.families.hf import EMBEDDED_DEFAULT

    layout = layout or Layout()
    records = build_corpus(work_dir / "docstrings")
    base = base_dir(work_dir / "hflora-base", record_texts(records), layout)
    model = {"name": "hf", "task": "lm", "path": str(base), "seq_len": seq_len}
    lora = {"lora_rank": rank, "lora_alpha": 2.0 * rank, "lora_merge": False}  # the run keeps its adapters alone
    training = {**EMBEDDED_DEFAULT["training"], "global_batch_size": batch, "lr": lr, "warmup_steps": 2}
    experiment = {
        "model": {**model, **lora},
        "data": {"name": "records", "path": str(records), "validation_share": HFLORA_HELD_SHARE},
        "training": {**training, **_run_settings(steps)},
    }
    size = f"{layout.layers} layers of hidden {layout.hidden}"
    text = f"Llama-style LM ({size}, random weights) with LoRA rank {rank}, seq {seq_len}, global batch {batch}"
    return LinkModel("hflora", experiment, _warmup(steps), text)


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


def sizes(model: LinkModel, work_dir: Path) -> dict[str, int]:
    """The model's parameters, trainable parameters and the bytes a sync sums (benchmarks.link_lora.model_sizes),
    from a Trainer built here on the CPU."""
    from benchmarks.link_lora import model_sizes
    from benchmarks.transformer import caches_in
    from raytrm.train.trainer import Trainer

    experiment = copy.deepcopy(model.experiment)
    experiment["training"]["device"] = "cpu"
    with caches_in(work_dir / "cache"):
        trainer = Trainer(cfg.from_dict(cfg.ExperimentConfig, experiment, f"the {model.name} link model"))
    try:
        return model_sizes(trainer.model)
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
