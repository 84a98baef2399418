"""Build a generated Sudoku or maze dataset in the reference layout, atomically; open one back."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from raytrm.data import maze, sudoku
from raytrm.data.puzzle_format import (
    PuzzleDataset,
    PuzzleMetadata,
    read_metadata,
    rebuild_hint,
    write_identifiers,
    write_split,
)
from raytrm.errors import UserError

logger = logging.getLogger(__name__)

KINDS = ("sudoku", "maze")
MAX_MAZE_AUGMENT = 7  # the 7 non-identity symmetries of the square
_TRAIN, _TEST, _AUGMENT = 0, 1, 2  # independent random streams per seed
_AUGMENT_CHUNK = 65536


def _stream(seed: int, stream: int, round_: int = 0) -> int:
    """An integer seed for one purpose, independent of the others drawn from the same user seed."""
    return int(np.random.SeedSequence([seed, stream, round_]).generate_state(1)[0])


def _check_args(kind: str, count: int, test_count: int, augment: int) -> None:
    if kind not in KINDS:
        raise UserError(
            f"dataset kind: got {kind!r}, expected one of {', '.join(KINDS)};"
            " fix: `raytrm data sudoku` or `raytrm data maze`"
        )
    for name, flag, value, low in (("count", "count", count, 1), ("test_count", "test-count", test_count, 0)):
        if not isinstance(value, int) or value < low:
            raise UserError(f"dataset {name}: got {value!r}, expected an integer >= {low}; fix: pass --{flag} 1000")
    if not isinstance(augment, int) or augment < 0:
        raise UserError(f"dataset augment: got {augment!r}, expected an integer >= 0; fix: pass --augment 0")
    if kind == "maze" and augment > MAX_MAZE_AUGMENT:
        raise UserError(
            f"dataset augment: got {augment} for maze, expected 0..{MAX_MAZE_AUGMENT} (a maze has 8 symmetries, the"
            f" reference uses all 8); fix: pass --augment {MAX_MAZE_AUGMENT}"
        )


def _distinct(
    make: Callable[[int, int], tuple[np.ndarray, np.ndarray]], count: int, exclude: set[bytes]
) -> tuple[np.ndarray, np.ndarray]:
    """`count` base puzzles from `make(count, round)`, none of whose inputs is in `exclude` (the train split)."""
    kept_in: list[np.ndarray] = []
    kept_out: list[np.ndarray] = []
    round_ = 0
    while len(kept_in) < count:
        inputs, labels = make(count - len(kept_in), round_)
        for x, y in zip(inputs, labels, strict=True):
            if x.tobytes() not in exclude:
                kept_in.append(x)
                kept_out.append(y)
        round_ += 1
    return np.stack(kept_in), np.stack(kept_out)


def _sudoku_split(bases: tuple[np.ndarray, np.ndarray], augment: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Groups of one base puzzle then `augment` shuffled copies, as tokens [count * (1 + augment), 81]."""
    inputs = np.repeat(bases[0], 1 + augment, axis=0)
    labels = np.repeat(bases[1], 1 + augment, axis=0)
    copies = np.flatnonzero(np.arange(len(inputs)) % (1 + augment))  # every example but each group's first
    rng = np.random.default_rng(seed)
    for chunk in np.array_split(copies, max(1, len(copies) // _AUGMENT_CHUNK)):  # bounds augment()'s temporaries
        inputs[chunk], labels[chunk] = sudoku.augment(inputs[chunk], labels[chunk], rng)
    return sudoku.encode(inputs), sudoku.encode(labels)


def _maze_split(bases: tuple[np.ndarray, np.ndarray], augment: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Groups of one base maze then `augment` distinct symmetric copies, as tokens [count * (1 + augment), size^2]."""
    inputs, labels = bases
    rng = np.random.default_rng(seed)
    out_in, out_lab = [], []
    for x, y in zip(inputs, labels, strict=True):
        for tid in [0, *(rng.permutation(MAX_MAZE_AUGMENT)[:augment] + 1).tolist()]:
            out_in.append(maze.dihedral(x, tid).reshape(-1))
            out_lab.append(maze.dihedral(y, tid).reshape(-1))
    return np.stack(out_in), np.stack(out_lab)


def _write(split_dir: Path, inputs: np.ndarray, labels: np.ndarray, group_size: int, seq_len: int, vocab: int) -> None:
    """One split: one example per puzzle, a group per base puzzle, every identifier 0 ("<blank>")."""
    n = len(inputs)
    arrays = {
        "inputs": inputs.reshape(n, seq_len),
        "labels": labels.reshape(n, seq_len),
        "puzzle_identifiers": np.zeros(n, np.int32),
        "puzzle_indices": np.arange(n + 1, dtype=np.int32),
        "group_indices": np.arange(0, n + 1, group_size, dtype=np.int32),
    }
    meta = PuzzleMetadata(
        pad_id=0,
        ignore_label_id=0,
        blank_identifier_id=0,
        vocab_size=vocab,
        seq_len=seq_len,
        num_puzzle_identifiers=1,
        total_groups=n // group_size,
        mean_puzzle_examples=1.0,
        total_puzzles=n,
        sets=["all"],
    )
    write_split(split_dir, meta, arrays)


def build_dataset(
    kind: str,
    out_dir: str | Path,
    *,
    count: int,
    test_count: int,
    givens: int = 36,
    augment: int = 0,
    size: int = 30,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Write `count` train (augmented) and `test_count` test (not augmented) puzzles into `out_dir`; returns it.

    The dataset is written into a hidden sibling directory and renamed into place at the end, so an interrupted build
    never leaves `out_dir` looking complete.
    """
    _check_args(kind, count, test_count, augment)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise UserError(f"{out}: already exists; fix: pass a new --out, or --overwrite to replace it")
    if out.exists() and not (out / "train" / "dataset.json").is_file():
        # --overwrite replaces a dataset; anything else at --out (a file, a home directory) is the user's to keep.
        raise UserError(
            f"{out}: not a dataset (no train/dataset.json), so --overwrite will not replace it; fix: pass a new --out"
        )
    if kind == "sudoku":
        sudoku.check_givens(givens)

        def make(n: int, stream: int, round_: int = 0) -> tuple[np.ndarray, np.ndarray]:
            return sudoku.generate_puzzles(n, givens, seed=_stream(seed, stream, round_))

        split, seq_len, vocab = _sudoku_split, sudoku.SEQ_LEN, sudoku.VOCAB_SIZE
    else:
        maze.check_maze_args(size, maze.default_min_distance(size), maze.DEFAULT_BRAID)

        def make(n: int, stream: int, round_: int = 0) -> tuple[np.ndarray, np.ndarray]:
            return maze.generate_mazes(n, size, seed=_stream(seed, stream, round_))

        split, seq_len, vocab = _maze_split, size * size, maze.VOCAB_SIZE
    started = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        train = make(count, _TRAIN)
        seen = {x.tobytes() for x in train[0]}
        train_in, train_lab = split(train, augment, _stream(seed, _AUGMENT))
        _write(tmp / "train", train_in, train_lab, 1 + augment, seq_len, vocab)
        test_in = test_lab = np.zeros((0, seq_len), np.uint8)
        if test_count:
            test = _distinct(lambda n, r: make(n, _TEST, r), test_count, seen)
            test_in, test_lab = split(test, 0, 0)
        _write(tmp / "test", test_in, test_lab, 1, seq_len, vocab)
        write_identifiers(tmp, ["<blank>"])
        build = {"kind": kind, "count": count, "test_count": test_count, "augment": augment, "seed": seed}
        build.update({"givens": givens} if kind == "sudoku" else {"size": size})
        (tmp / "raytrm_build.json").write_text(json.dumps(build))
        _swap_in(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "%s: %s dataset, %d train examples (%d puzzles x %d), %d test, %.1fs",
        out,
        kind,
        len(train_in),
        count,
        1 + augment,
        test_count,
        time.perf_counter() - started,
    )
    return out


def _swap_in(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished build into place, replacing an existing `out` only after the new one is complete."""
    if not out.exists():
        os.replace(tmp, out)
        return
    if not overwrite:  # a concurrent build of the same directory finished first: keep it
        logger.info("%s: appeared while building; keeping it and dropping this build", out)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _require_dir(path: str | Path) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise UserError(
            f"{root}: no such directory, so it is not a puzzle dataset; fix: build one with"
            f" `raytrm data sudoku --out {root}` (or `raytrm data maze --out {root}`)"
        )
    return root


def require_dataset(path: str | Path) -> None:
    """Raise open_dataset's one-line error if path is not a puzzle dataset, reading only its splits' metadata."""
    root = _require_dir(path)
    for split in ("train", "test"):
        read_metadata(root / split)


def open_dataset(path: str | Path, *, check_values: bool = True) -> tuple[PuzzleDataset, PuzzleDataset]:
    """The train and test splits of a dataset in the reference layout, checked to agree on tokens and length."""
    root = _require_dir(path)
    train = PuzzleDataset(root, "train", check_values=check_values)
    test = PuzzleDataset(root, "test", check_values=check_values)
    for name in ("seq_len", "vocab_size", "pad_id", "ignore_label_id", "num_puzzle_identifiers"):
        a, b = getattr(train.metadata, name), getattr(test.metadata, name)
        if a != b:
            raise UserError(
                f"{root}/test/dataset.json: {name}: got {b!r}, expected {a!r} as in train/dataset.json;"
                f" {rebuild_hint(root)}"
            )
    return train, test
