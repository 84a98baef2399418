"""The reference's on-disk puzzle layout (TinyRecursiveModels `dataset/common.py`, `puzzle_dataset.py`): write, read.

DIR/identifiers.json lists puzzle identifier names; DIR/{train,test}/dataset.json holds the metadata; per set name
(the reference writes one set, "all") the split holds SET__inputs.npy and SET__labels.npy [N, seq_len] (uint8 as the
reference's Sudoku and Maze builders write them), SET__puzzle_identifiers.npy int32 [P], SET__puzzle_indices.npy
int32 [P + 1] (CSR offsets of each puzzle's examples) and SET__group_indices.npy int32 [G + 1] (CSR offsets of each
group's puzzles; a group is a base puzzle and its augmentations).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from raytrm.errors import UserError

logger = logging.getLogger(__name__)

IGNORE_LABEL = -100
ARRAY_FIELDS = ("inputs", "labels", "puzzle_identifiers", "puzzle_indices", "group_indices")
INDEX_DTYPE = np.int32
#: dataset.json fields that size the model: zero tokens, positions or puzzle identifiers (0 is <blank>) cannot be.
POSITIVE_FIELDS = ("vocab_size", "seq_len", "num_puzzle_identifiers")


def rebuild_hint(root: str | Path) -> str:
    """The fix named in errors about a dataset directory: regenerate it."""
    return f"fix: rebuild it with `raytrm data sudoku --out {root} --overwrite` (or `raytrm data maze ...`)"


@dataclass(frozen=True)
class PuzzleMetadata:
    """dataset.json: the reference's PuzzleDatasetMetadata fields, in its order and JSON types."""

    pad_id: int
    ignore_label_id: int | None
    blank_identifier_id: int
    vocab_size: int
    seq_len: int
    num_puzzle_identifiers: int
    total_groups: int
    mean_puzzle_examples: float
    total_puzzles: int
    sets: list[str] = field(default_factory=lambda: ["all"])

    def to_json(self) -> dict:
        """The dict written to dataset.json (mean_puzzle_examples always a float, as pydantic dumps it)."""
        return {**asdict(self), "mean_puzzle_examples": float(self.mean_puzzle_examples)}

    @classmethod
    def from_json(cls, data: object, source: str) -> PuzzleMetadata:
        """Validate a parsed dataset.json; `source` names the file in errors."""
        fix = rebuild_hint(Path(source).parent.parent)
        if not isinstance(data, dict):
            raise UserError(f"{source}: got a JSON {type(data).__name__}, expected an object; {fix}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise UserError(
                f"{source}: missing field {missing[0]!r} (all missing: {', '.join(missing)}); expected the fields"
                f" {', '.join(names)}; {fix}"
            )
        extra = sorted(set(data) - set(names))
        if extra:
            logger.warning("%s: ignoring fields the reference does not define: %s", source, ", ".join(extra))
        for name in names:
            value = data[name]
            if name == "sets":
                ok = isinstance(value, list) and value and all(isinstance(s, str) and s for s in value)
                expected = "a non-empty list of set names"
            elif name == "mean_puzzle_examples":
                ok, expected = (
                    isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                    "a number > 0",
                )
            else:
                least = 1 if name in POSITIVE_FIELDS else 0
                ok = (isinstance(value, int) and not isinstance(value, bool) and value >= least) or (
                    name == "ignore_label_id" and value is None
                )
                expected = f"an integer >= {least}" + (" or null" if name == "ignore_label_id" else "")
            if not ok:
                raise UserError(f"{source}: field {name!r}: got {value!r}, expected {expected}; {fix}")
        return cls(**{n: data[n] for n in names})


def write_split(
    split_dir: str | Path,
    metadata: PuzzleMetadata,
    arrays: dict[str, np.ndarray],
    set_name: str = "all",
) -> None:
    """Write dataset.json and the five SET__*.npy files of one split, as the reference's builders do."""
    split_dir = Path(split_dir)
    split_dir.mkdir(parents=True, exist_ok=True)
    token_dtype = np.uint8 if metadata.vocab_size <= 256 else np.int32
    for name in ARRAY_FIELDS:
        dtype = token_dtype if name in ("inputs", "labels") else INDEX_DTYPE
        np.save(split_dir / f"{set_name}__{name}.npy", np.ascontiguousarray(arrays[name], dtype=dtype))
    (split_dir / "dataset.json").write_text(json.dumps(metadata.to_json()))


def write_identifiers(root: str | Path, names: list[str]) -> None:
    """Write DIR/identifiers.json (index = puzzle identifier; 0 is "<blank>")."""
    (Path(root) / "identifiers.json").write_text(json.dumps(names))


def read_metadata(split_dir: str | Path) -> PuzzleMetadata:
    """Read and validate SPLIT/dataset.json."""
    split_dir = Path(split_dir)
    path = split_dir / "dataset.json"
    if not path.is_file():
        root = split_dir.parent
        if (root / "dataset.json").is_file():
            raise UserError(
                f"{root}: no {split_dir.name}/dataset.json; {root} is itself a split;"
                f" fix: pass its parent {root.parent}"
            )
        raise UserError(
            # root exists, and `raytrm data` refuses an existing --out: so a new directory inside it.
            f"{root}: no {split_dir.name}/dataset.json, so it is not a puzzle dataset; fix: build one into a new"
            f" directory and pass that, e.g. `raytrm data sudoku --out {root / 'sudoku'}`"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: brackets nested too deeply
        raise UserError(f"{path}: not readable JSON ({exc}); {rebuild_hint(split_dir.parent)}") from exc
    return PuzzleMetadata.from_json(data, str(path))


def group_membership(puzzle_indices: np.ndarray, group_indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which puzzle each example belongs to [N] and which group each puzzle belongs to [P], both int32."""
    # int64 first: np.repeat takes no uint64 counts, and a file may hold offsets of any integer type.
    example_puzzle = np.repeat(
        np.arange(len(puzzle_indices) - 1, dtype=INDEX_DTYPE), np.diff(puzzle_indices.astype(np.int64))
    )
    puzzle_group = np.repeat(
        np.arange(len(group_indices) - 1, dtype=INDEX_DTYPE), np.diff(group_indices.astype(np.int64))
    )
    return example_puzzle, puzzle_group


def _check_offsets(source: str, name: str, offsets: np.ndarray, end: int, end_name: str, fix: str) -> None:
    if offsets.ndim != 1 or len(offsets) < 1 or not np.issubdtype(offsets.dtype, np.integer):
        raise UserError(
            f"{source}: {name}: got shape {offsets.shape} {offsets.dtype}, expected 1-D integer offsets; {fix}"
        )
    # As int64: differences of unsigned offsets would wrap around; a uint64 beyond int64 turns negative, refused below.
    offsets = offsets.astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != end or np.any(np.diff(offsets) < 0):
        raise UserError(
            f"{source}: {name}: got offsets from {offsets[0]} to {offsets[-1]}"
            f"{' not monotone' if np.any(np.diff(offsets) < 0) else ''}, expected non-decreasing offsets from 0 to"
            f" {end} ({end_name}); {fix}"
        )


class PuzzleDataset:
    """One split of a dataset in the reference layout: memory-mapped examples, CSR puzzle and group offsets."""

    def __init__(
        self, root: str | Path, split: str = "train", *, set_name: str | None = None, check_values: bool = True
    ) -> None:
        self.root, self.split = Path(root), split
        split_dir = self.root / split
        self.metadata = meta = read_metadata(split_dir)
        self.set_name = set_name or meta.sets[0]
        where = f"{split_dir}/{self.set_name}__"
        if self.set_name not in meta.sets:
            raise UserError(
                f"{split_dir}: set {self.set_name!r} not in dataset.json sets {meta.sets}; fix: pick one of them"
            )
        arrays = {}
        for name in ARRAY_FIELDS:
            path = split_dir / f"{self.set_name}__{name}.npy"
            if not path.is_file():
                raise UserError(
                    f"{path}: missing (dataset.json lists set {self.set_name!r}); {rebuild_hint(self.root)}"
                )
            try:
                arrays[name] = np.load(path, mmap_mode="r" if name in ("inputs", "labels") else None)
            except Exception as exc:  # numpy raises whatever its header parser meets (EOFError, TokenError, ...)
                raise UserError(f"{path}: not a readable .npy file ({exc}); {rebuild_hint(self.root)}") from exc
            if not isinstance(arrays[name], np.ndarray):  # an .npz archive under the .npy name
                arrays[name].close()
                raise UserError(f"{path}: an .npz archive, expected one .npy array; {rebuild_hint(self.root)}")
        self.inputs, self.labels = arrays["inputs"], arrays["labels"]
        self.puzzle_identifiers = arrays["puzzle_identifiers"]
        self.puzzle_indices, self.group_indices = arrays["puzzle_indices"], arrays["group_indices"]
        self._validate(where, check_values)
        self.example_puzzle, self.puzzle_group = group_membership(self.puzzle_indices, self.group_indices)

    def _validate(self, where: str, check_values: bool) -> None:
        meta, inputs, labels = self.metadata, self.inputs, self.labels
        json_path = f"{self.root / self.split}/dataset.json"
        fix = rebuild_hint(self.root)
        for name in ("inputs", "labels", "puzzle_identifiers"):
            dtype = getattr(self, name).dtype
            if not np.issubdtype(dtype, np.integer):
                raise UserError(
                    f"{where}{name}.npy: got dtype {dtype}, expected integers (the reference writes uint8 or int32);"
                    f" {fix}"
                )
        if inputs.ndim != 2 or inputs.shape[1] != meta.seq_len:
            raise UserError(
                f"{where}inputs.npy: got shape {inputs.shape}, expected [N, {meta.seq_len}] (seq_len in {json_path});"
                f" {fix}"
            )
        if labels.shape != inputs.shape:
            raise UserError(
                f"{where}labels.npy: got shape {labels.shape}, expected {inputs.shape} like inputs.npy; {fix}"
            )
        if not len(inputs):  # nothing to train on or evaluate: the batch stream would divide by zero
            raise UserError(f"{where}inputs.npy: got no examples, expected at least one; {fix}")
        _check_offsets(
            f"{where}puzzle_indices.npy", "puzzle offsets", self.puzzle_indices, len(inputs), "examples", fix
        )
        n_puzzles = len(self.puzzle_indices) - 1
        _check_offsets(f"{where}group_indices.npy", "group offsets", self.group_indices, n_puzzles, "puzzles", fix)
        n_groups = len(self.group_indices) - 1
        ids = self.puzzle_identifiers
        if ids.shape != (n_puzzles,):
            raise UserError(f"{where}puzzle_identifiers.npy: got shape {ids.shape}, expected ({n_puzzles},); {fix}")
        if len(ids) and (ids.min() < 0 or ids.max() >= meta.num_puzzle_identifiers):
            raise UserError(
                f"{where}puzzle_identifiers.npy: got ids {ids.min()}..{ids.max()},"
                f" expected 0..{meta.num_puzzle_identifiers - 1}"
                f" (num_puzzle_identifiers in {json_path}); {fix}"
            )
        if meta.total_groups != n_groups:
            raise UserError(
                f"{json_path}: total_groups: got {meta.total_groups}, expected {n_groups} from group_indices.npy; {fix}"
            )
        # The reference's Sudoku and Maze builders write total_puzzles = total_groups, even with augmentations.
        if meta.total_puzzles not in (n_puzzles, n_groups):
            quirk = (
                f" (or {n_groups}, as the reference's Sudoku and Maze builders write)" if n_groups != n_puzzles else ""
            )
            raise UserError(
                f"{json_path}: total_puzzles: got {meta.total_puzzles}, expected {n_puzzles} from puzzle_indices.npy"
                f"{quirk}; {fix}"
            )
        mean = len(inputs) / max(n_puzzles, 1)
        if len(meta.sets) == 1 and n_puzzles and abs(meta.mean_puzzle_examples - mean) > 1e-6 * mean:
            raise UserError(
                f"{json_path}: mean_puzzle_examples: got {meta.mean_puzzle_examples}, expected {mean:g} examples per"
                f" puzzle from puzzle_indices.npy; {fix}"
            )
        if check_values:
            allowed = () if meta.ignore_label_id is None else (meta.ignore_label_id,)
            for source, tokens, ok in ((f"{where}inputs.npy", inputs, ()), (f"{where}labels.npy", labels, allowed)):
                low, high = int(tokens.min()), int(tokens.max())
                if (low < 0 and low not in ok) or (high >= meta.vocab_size and high not in ok):
                    raise UserError(
                        f"{source}: token {low if low < 0 else high} out of vocab, expected 0..{meta.vocab_size - 1}"
                        f" (vocab_size in {json_path}); {fix}"
                    )

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def num_puzzles(self) -> int:
        """Puzzles in this split (P)."""
        return len(self.puzzle_indices) - 1

    @property
    def num_groups(self) -> int:
        """Groups in this split (G)."""
        return len(self.group_indices) - 1

    def examples_of_puzzle(self, puzzle: int) -> range:
        """Example indices of one puzzle."""
        return range(int(self.puzzle_indices[puzzle]), int(self.puzzle_indices[puzzle + 1]))

    def puzzles_of_group(self, group: int) -> range:
        """Puzzle indices of one group."""
        return range(int(self.group_indices[group]), int(self.group_indices[group + 1]))

    def examples_of_group(self, group: int) -> range:
        """Example indices of one group (its puzzles' examples are contiguous)."""
        puzzles = self.puzzles_of_group(group)
        return range(int(self.puzzle_indices[puzzles.start]), int(self.puzzle_indices[puzzles.stop]))

    def batch(self, indices: np.ndarray, map_ignore: bool = True) -> dict[str, np.ndarray]:
        """Examples at `indices` as int32 inputs, labels (ignore_label_id -> -100 if map_ignore), puzzle_identifiers."""
        idx = np.asarray(indices, dtype=np.int64)
        order = np.argsort(idx, kind="stable")  # sorted reads are sequential on the memory map
        inv = np.empty_like(order)
        inv[order] = np.arange(len(order))
        inputs = np.asarray(self.inputs[idx[order]], dtype=np.int32)[inv]
        labels = np.asarray(self.labels[idx[order]], dtype=np.int32)[inv]
        if map_ignore and self.metadata.ignore_label_id is not None:
            labels[labels == self.metadata.ignore_label_id] = IGNORE_LABEL
        ids = self.puzzle_identifiers[self.example_puzzle[idx]].astype(np.int32)
        return {"inputs": inputs, "labels": labels, "puzzle_identifiers": ids}
