"""`python -m benchmarks transformer`: byte-level LM training tokens/s against this machine's matrix-multiply ceiling.

Each `raytrm` row is the real Trainer's `train_step` (data, forward, backward, loss, optimizer, EMA) at one width and
sequence length, on a generated text corpus. Its model FLOPs are counted by torch's FLOP counter on one step, and the
matmul ceiling is measured in the same run, once per round between the timed steps, so the fraction compares like
with like on a noisy machine.

A `nanogpt` row follows each raytrm row: a plain nanoGPT-style model and training step of the same width, depth,
heads, sequence length and batch, on the same device and forward dtype, drawing windows of the same corpus
(`benchmarks.nanogpt`). The two steps are timed in alternation, so a change in the machine's load reaches both rows
alike, and `ratio` is raytrm's tokens/s over the reference's. Their blocks differ as the two designs do (raytrm:
RMSNorm, RoPE, SwiGLU, EMA; nanoGPT: LayerNorm, learned positions, GELU MLP), so each row's FLOPs are its own count.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.nanogpt import NanoGPTTrainer
from benchmarks.timing import compiled_as_run, measure_side_by_side, onednn_columns
from raytrm import config as cfg
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
    #: On a CPU whose linear layers run on oneDNN: oneDNN's 2048^3 rate, and the model's fraction of it.
    onednn_gflops: float | None = None
    fraction_of_onednn: float | None = None
    #: "raytrm", or "nanogpt" for the nanoGPT-style reference's training step.
    impl: str = "raytrm"
    #: On a raytrm row measured beside the reference: raytrm tokens/s / reference tokens/s.
    ratio: float | None = None
    #: How the step ran: "off" (eager), raytrm's training.compile, or "torch.compile" for the reference.
    compiled: str = "off"


def synthetic_corpus(path: Path) -> Path:
    """Word-like text from a fixed seed: the timing does not depend on what the bytes say."""
    if not path.exists():
        rng = np.random.default_rng(0)
        letters = rng.integers(ord("a"), ord("z") + 1, CORPUS_BYTES, dtype=np.uint8)
        letters[rng.random(CORPUS_BYTES) < 0.18] = ord(" ")
        path.write_bytes(letters.tobytes())
    return path


@contextlib.contextmanager
def caches_in(directory: Path) -> Iterator[None]:
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


def _measure_pair(
    experiment: cfg.ExperimentConfig, corpus: Path, reference: bool, repeats: int
) -> list[TransformerRow]:
    """raytrm's row at one config, and the nanoGPT-style reference's beside it when asked for."""
    trainer = Trainer(experiment)
    steps: list[tuple[str, Callable[[], object]]] = [("raytrm", trainer.train_step)]
    if reference:
        # Compiled exactly where raytrm's compile plan compiles (not on a CPU without a C++ compiler, say).
        ref = NanoGPTTrainer(experiment, corpus, trainer.device, trainer.dtype, compile_model=bool(trainer.compiled))
        steps.append(("nanogpt", ref.train_step))
    model, batch = experiment.model, experiment.training.global_batch_size
    try:
        rates = measure_side_by_side([step for _, step in steps], trainer.device, trainer.dtype, repeats, batch)
    finally:
        trainer.close()
    compiled = {
        "raytrm": compiled_as_run(trainer, experiment.training.compile),
        "nanogpt": "torch.compile" if trainer.compiled else "off",
    }
    rows = [
        TransformerRow(
            hidden=model.hidden_size,
            seq_len=model.seq_len,
            layers=model.layers,
            batch=batch,
            device=trainer.device.type,
            dtype=str(trainer.dtype).removeprefix("torch."),
            tokens_per_sec=model.seq_len * r["samples_per_sec"],
            impl=impl,
            compiled=compiled[impl],
            **r,
        )
        for (impl, _), r in zip(steps, rates, strict=True)
    ]
    for row in rows:
        logger.info("%s", row)
    return rows


def bench_transformer(
    seq_lens: list[int],
    hiddens: list[int],
    batch: int,
    threads: int | None,
    device: str,
    work_dir: Path,
    repeats: int = 5,
    dtype: str = "auto",
    reference: bool = True,
    compile_mode: str = "off",
) -> list[TransformerRow]:
    """Median step time, tokens/s and FLOP rate of each (hidden, seq_len), with the matmul ceiling alongside.

    reference: follow each raytrm row with the nanoGPT-style reference's, timed in alternation with it.
    compile_mode: raytrm's training.compile (off, on, cudagraphs, auto); where it compiles, the reference is
    compiled too.
    """
    corpus = synthetic_corpus(work_dir / "corpus.txt")
    rows = []
    with caches_in(work_dir / "cache"):
        for hidden in hiddens:
            for seq_len in seq_lens:
                model = {
                    "name": "transformer",
                    "hidden_size": hidden,
                    "num_heads": max(1, hidden // HEAD_DIM),
                    "layers": LAYERS,
                    "seq_len": seq_len,
                }
                training = {
                    "global_batch_size": batch,
                    "threads": threads,
                    "device": device,
                    "dtype": dtype,
                    "compile": compile_mode,
                }
                data = {"name": "text", "path": str(corpus)}
                experiment = cfg.from_dict(cfg.ExperimentConfig, {"model": model, "data": data, "training": training})
                rows.extend(_measure_pair(experiment, corpus, reference, repeats))
    return rows


def format_rows(rows: list[TransformerRow]) -> str:
    head = (
        f"{'impl':<8} {'hidden':>6} {'seq':>5} {'layers':>6} {'batch':>5} {'device':>6} {'dtype':>8} {'step s':>8} "
        f"{'tokens/s':>10} {'samples/s':>10} {'GFLOP/step':>10} {'GFLOP/s':>8} {'matmul':>8} {'fraction':>8} "
        f"{'oneDNN':>8} {'fraction':>8} {'ratio':>6} compiled"
    )
    lines = [head]
    for r in rows:
        ratio = f"{r.ratio:>6.2f}" if r.ratio is not None else f"{'':>6}"
        lines.append(
            f"{r.impl:<8} {r.hidden:>6} {r.seq_len:>5} {r.layers:>6} {r.batch:>5} {r.device:>6} {r.dtype:>8} "
            f"{r.step_seconds:>8.3f} {r.tokens_per_sec:>10.0f} {r.samples_per_sec:>10.2f} {r.gflop_per_step:>10.2f} "
            f"{r.gflops:>8.1f} {r.matmul_gflops:>8.1f} {r.fraction_of_matmul:>8.2f} {onednn_columns(r)} {ratio} "
            f"{r.compiled}"
        )
    return "\n".join(lines)


def as_json(rows: list[TransformerRow]) -> list[dict]:
    return [asdict(r) for r in rows]
