"""Fuzzing dataset directories in the TRM reference layout: corrupt dataset.json, arrays of the wrong shape or dtype,
out-of-range values, truncated or foreign .npy files, missing files and splits.

Property: open_dataset either gives two splits whose batches are well-formed for the model the train split sizes
(tokens in the vocabulary, identifiers in the puzzle table, rows of seq_len) or refuses with a UserError of one
line; `raytrm train --data DIR` trains, or exits 2 with one line on stderr.
"""

from __future__ import annotations

import itertools
import json
import shutil

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from mutations import (
    FUZZ,
    FUZZ_EXAMPLES,
    TINY,
    Counter,
    check_cli_refusal,
    corrupted,
    load_or_refusal,
    mutated,
    run_cli,
)

from raytrm.data.build import open_dataset
from raytrm.data.puzzle_format import ARRAY_FIELDS, IGNORE_LABEL

pytestmark = pytest.mark.slow

SPLITS = ("train", "test")
NPY = [f"{split}/all__{name}.npy" for split in SPLITS for name in ARRAY_FIELDS]
JSON = [f"{split}/dataset.json" for split in SPLITS]
DTYPES = ["uint8", "int8", "int16", ">i4", "int32", "int64", "uint16", "uint64", "float16", "float64", "bool"]
ODD_DTYPES = ["complex64", "<U2", "S3"]
VALUES = [-(2**40), -101, -100, -1, 0, 1, 10, 11, 127, 255, 256, 2**31 - 1, 2**40]


@st.composite
def array_edit(draw: st.DrawFn, array: np.ndarray) -> object:
    """A replacement for one array: another dtype, shape or values, a random array, or something not an array."""
    op = draw(st.sampled_from(["dtype", "shape", "value", "random", "odd"]))
    if op == "dtype":
        return array.astype(draw(st.sampled_from(DTYPES + ODD_DTYPES)))
    if op == "shape":
        cut = draw(st.integers(0, max(0, len(array) - 1)))
        return draw(
            st.sampled_from(
                [array.reshape(-1), array[None], array.T, array[:cut], array[cut:], array[..., :cut], array[:0]]
            )
        )
    if op == "value" and array.size:
        out = np.array(array, copy=True).astype(np.int64)
        flat = out.reshape(-1)
        for _ in range(draw(st.integers(1, 3))):
            flat[draw(st.integers(0, flat.size - 1))] = draw(st.sampled_from(VALUES))
        return out.astype(draw(st.sampled_from([array.dtype.str, "int64"])))
    if op == "random":
        return draw(
            hnp.arrays(st.sampled_from(DTYPES).map(np.dtype), hnp.array_shapes(min_dims=0, max_dims=3, max_side=6))
        )
    return draw(st.sampled_from(["npz", "object", "zero-d", "nan"]))


def _write_array(path, value: object) -> None:
    if isinstance(value, np.ndarray):
        np.save(path, value)
    elif value == "npz":
        with open(path, "wb") as f:
            np.savez(f, a=np.zeros(3))
    elif value == "object":
        np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    elif value == "zero-d":
        np.save(path, np.int32(7))
    else:
        np.save(path, np.full((4, 81), np.nan))


@st.composite
def dataset_edits(draw: st.DrawFn, root) -> list:
    """One or two edits of the seed dataset, each (kind, file, payload)."""
    edits = []
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["json", "json", "npy", "npy", "npy", "bytes", "delete"]))
        if kind == "json":
            name = draw(st.sampled_from(JSON))
            edits.append((kind, name, draw(mutated(json.loads((root / name).read_text())))))
        elif kind == "npy":
            name = draw(st.sampled_from(NPY))
            edits.append((kind, name, draw(array_edit(np.load(root / name)))))
        elif kind == "bytes":
            name = draw(st.sampled_from(NPY + JSON))
            edits.append((kind, name, draw(corrupted((root / name).read_bytes()))))
        else:
            edits.append((kind, draw(st.sampled_from([*NPY, *JSON, *SPLITS])), None))
    return edits


def _apply(root, edits: list) -> None:
    for kind, name, payload in edits:
        path = root / name
        if kind == "delete":
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        elif not path.parent.is_dir():
            continue  # its split was deleted by an earlier edit
        elif kind == "json":
            path.write_text(json.dumps(payload))
        elif kind == "npy":
            _write_array(path, payload)
        else:
            path.write_bytes(payload)


def _check_usable(train, test) -> None:
    """What the trainer relies on: examples in both splits, batches the model sized from train/dataset.json can take."""
    meta = train.metadata
    assert len(train) > 0 and len(test) > 0
    for split in (train, test):
        assert len(split.example_puzzle) == len(split) and len(split.puzzle_group) == split.num_puzzles
        batch = split.batch(np.arange(min(len(split), 4)))
        assert batch["inputs"].shape == batch["labels"].shape == (min(len(split), 4), meta.seq_len)
        assert batch["inputs"].min() >= 0 and batch["inputs"].max() < meta.vocab_size
        labels = batch["labels"][batch["labels"] != IGNORE_LABEL]
        assert labels.size == 0 or (labels.min() >= 0 and labels.max() < meta.vocab_size)
        ids = batch["puzzle_identifiers"]
        assert ids.min() >= 0 and ids.max() < meta.num_puzzle_identifiers


def test_dataset_directories(tmp_path, seed_dataset, tiers_read_once):
    counter = Counter("dataset directories")
    numbers = itertools.count()

    @FUZZ
    @given(dataset_edits(seed_dataset))
    def prop(edits: list) -> None:
        n = next(numbers)
        root = tmp_path / f"d{n}"
        shutil.copytree(seed_dataset, root)
        _apply(root, edits)
        loaded, error = load_or_refusal(open_dataset, root)
        if loaded is not None:
            _check_usable(*loaded)
        code, _, err = run_cli(["train", "--data", str(root), "--steps", "1", "--out", str(tmp_path / f"r{n}"), *TINY])
        if loaded is None or code != 0:
            check_cli_refusal(code, err)
        counter.add(error is not None)
        shutil.rmtree(root)
        shutil.rmtree(tmp_path / f"r{n}", ignore_errors=True)

    prop()
    print(counter.report())
    assert counter.ran >= FUZZ_EXAMPLES
