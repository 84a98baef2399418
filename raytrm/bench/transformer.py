"""`raytrm bench transformer`: byte-level LM training tokens/s against this machine's matrix-multiply ceiling.

Each row is the real Trainer's `train_step` (data, forward, backward, loss, optimizer, EMA) at one width and sequence
length, on a generated text corpus. Its model FLOPs are counted by torch's FLOP counter on one step, and the matmul
ceiling is measured in the same run, once per round between the timed steps, so the fraction compares like with
like on a noisy machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from raytrm import config as cfg
from raytrm.bench.timing import measure_steps, step_rates
from raytrm.constants import CACHE_DIR_ENV
from raytrm.train.trainer import Trainer

logger = logging.getLogger(__name__)

LAYERS = 4
HEAD_DIM = 64
CORPUS_BYTES = 4 * 2**20


@dataclass
class TransformerRow:
    hidden: int
    seq_len: int
    layers: int
    batch: int
    device: str
    dtype: str
    step_seconds: float
    tokens_per_sec: float
    samples_per_sec: float
    gflop_per_step: float
    gflops: float
    matmul_gflops: float
    fraction_of_matmul: float


def _corpus(path: Path) -> Path:
    """Word-like text from a fixed seed: the timing does not depend on what the bytes say."""
    if not path.exists():
        rng = np.random.default_rng(0)
        letters = rng.integers(ord("a"), ord("z") + 1, CORPUS_BYTES, dtype=np.uint8)
        letters[rng.random(CORPUS_BYTES) < 0.18] = ord(" ")
        path.write_bytes(letters.tobytes())
    return path


@contextlib.contextmanager
def _cache_in(directory: Path) -> Iterator[None]:
    """Keep the benchmark's token caches in its work directory, not the user's cache."""
    old = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(directory)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(CACHE_DIR_ENV, None)
        else:
            os.environ[CACHE_DIR_ENV] = old


def _measure(experiment: cfg.ExperimentConfig, repeats: int) -> TransformerRow:
    trainer = Trainer(experiment)
    try:
        (flops,), (seconds,), ceiling = measure_steps([trainer.train_step], trainer.device, trainer.dtype, repeats)
    finally:
        trainer.close()
    model, batch = experiment.model, experiment.training.global_batch_size
    row = TransformerRow(
        hidden=model.hidden_size,
        seq_len=model.seq_len,
        layers=model.layers,
        batch=batch,
        device=trainer.device.type,
        dtype=str(trainer.dtype).removeprefix("torch."),
        tokens_per_sec=batch * model.seq_len / seconds,
        **step_rates(batch, flops, seconds, ceiling),
    )
    logger.info("%s", row)
    return row


def bench_transformer(
    seq_lens: list[int],
    hiddens: list[int],
    batch: int,
    threads: int | None,
    device: str,
    work_dir: Path,
    repeats: int = 5,
    dtype: str = "auto",
) -> list[TransformerRow]:
    """Median step time, tokens/s and FLOP rate of each (hidden, seq_len), with the matmul ceiling alongside."""
    corpus = _corpus(work_dir / "corpus.txt")
    rows = []
    with _cache_in(work_dir / "cache"):
        for hidden in hiddens:
            for seq_len in seq_lens:
                model = {
                    "name": "transformer",
                    "hidden_size": hidden,
                    "num_heads": max(1, hidden // HEAD_DIM),
                    "layers": LAYERS,
                    "seq_len": seq_len,
                }
                training = {"global_batch_size": batch, "threads": threads, "device": device, "dtype": dtype}
                data = {"name": "text", "path": str(corpus)}
                experiment = cfg.from_dict(cfg.ExperimentConfig, {"model": model, "data": data, "training": training})
                rows.append(_measure(experiment, repeats))
    return rows


def format_rows(rows: list[TransformerRow]) -> str:
    head = (
        f"{'hidden':>6} {'seq':>5} {'layers':>6} {'batch':>5} {'device':>6} {'dtype':>8} {'step s':>8} "
        f"{'tokens/s':>10} {'samples/s':>10} {'GFLOP/step':>10} {'GFLOP/s':>8} {'matmul':>8} {'fraction':>8}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.hidden:>6} {r.seq_len:>5} {r.layers:>6} {r.batch:>5} {r.device:>6} {r.dtype:>8} "
            f"{r.step_seconds:>8.3f} {r.tokens_per_sec:>10.0f} {r.samples_per_sec:>10.2f} {r.gflop_per_step:>10.2f} "
            f"{r.gflops:>8.1f} {r.matmul_gflops:>8.1f} {r.fraction_of_matmul:>8.2f}"
        )
    return "\n".join(lines)


def as_json(rows: list[TransformerRow]) -> list[dict]:
    return [asdict(r) for r in rows]
