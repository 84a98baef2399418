"""The reference layout: round trip, files as the reference writes them, its loader's reads, bad datasets, builds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from raytrm.data import PuzzleDataset, PuzzleMetadata, build_dataset, group_membership, open_dataset, write_split
from raytrm.errors import UserError

# PuzzleDatasetMetadata in the reference's dataset/common.py, in its order, with the JSON type pydantic dumps.
REFERENCE_FIELDS = {
    "pad_id": int,
    "ignore_label_id": int,
    "blank_identifier_id": int,
    "vocab_size": int,
    "seq_len": int,
    "num_puzzle_identifiers": int,
    "total_groups": int,
    "mean_puzzle_examples": float,
    "total_puzzles": int,
    "sets": list,
}
ARRAY_DTYPES = {
    "inputs": np.uint8,
    "labels": np.uint8,
    "puzzle_identifiers": np.int32,
    "puzzle_indices": np.int32,
    "group_indices": np.int32,
}


def write_like_reference_builder(root: Path, num_aug: int = 2) -> dict[str, np.ndarray]:
    """A tiny Sudoku-like dataset laid out by the reference builder's conventions, written without raytrm."""
    rng = np.random.default_rng(0)
    digits = rng.integers(0, 10, size=(3 * (1 + num_aug), 81)).astype(np.uint8)  # "0" is a blank, as in its CSV
    arrays = {
        "inputs": digits + 1,  # uint8 + 1 stays uint8, as in its _seq_to_numpy
        "labels": np.where(np.arange(81) < 80, (digits % 9) + 2, 0).astype(np.uint8),  # last cell PAD: ignored
        "group_indices": np.arange(0, 3 * (1 + num_aug) + 1, 1 + num_aug, dtype=np.int32),
        "puzzle_indices": np.arange(3 * (1 + num_aug) + 1, dtype=np.int32),
        "puzzle_identifiers": np.zeros(3 * (1 + num_aug), dtype=np.int32),
    }
    meta = dict(seq_len=81, vocab_size=11, pad_id=0, ignore_label_id=0, blank_identifier_id=0)
    # Its builder sets total_puzzles to the number of groups, and pydantic dumps mean_puzzle_examples=1 as 1.0.
    meta.update(num_puzzle_identifiers=1, total_groups=3, mean_puzzle_examples=1.0, total_puzzles=3, sets=["all"])
    for split in ("train", "test"):
        (root / split).mkdir(parents=True)
        (root / split / "dataset.json").write_text(json.dumps(meta))
        for name, value in arrays.items():
            np.save(root / split / f"all__{name}.npy", value)
    (root / "identifiers.json").write_text(json.dumps(["<blank>"]))
    return arrays


def reference_style_reads(root: Path, split: str, batch_size: int = 4) -> list[dict[str, np.ndarray]]:
    """What the reference's puzzle_dataset.py and pretrain.py read, redone here: file names, fields, offsets."""
    meta = json.loads((root / split / "dataset.json").read_text())
    assert set(REFERENCE_FIELDS) <= set(meta)  # PuzzleDatasetMetadata(**json) needs every field
    assert meta["total_groups"] * meta["mean_puzzle_examples"] / batch_size > 0  # its total_steps formula
    modes = {"inputs": "r", "labels": "r", "puzzle_identifiers": None, "puzzle_indices": None, "group_indices": None}
    batches = []
    for set_name in meta["sets"]:
        data = {k: np.load(root / split / f"{set_name}__{k}.npy", mmap_mode=m) for k, m in modes.items()}
        rng = np.random.Generator(np.random.Philox(seed=0))
        examples, puzzles = [], []
        for group in rng.permutation(data["group_indices"].size - 1):  # its train sampling, one puzzle per group
            puzzle = rng.integers(data["group_indices"][group], data["group_indices"][group + 1])
            start = data["puzzle_indices"][puzzle]
            size = int(data["puzzle_indices"][puzzle + 1] - start)
            examples.append(start + np.random.choice(size, 1, replace=False)[0])
            puzzles.append(puzzle)
        first = np.searchsorted(data["puzzle_indices"], 0, side="right") - 1  # its test iteration
        assert first == 0
        batch = {
            "inputs": data["inputs"][examples],
            "labels": data["labels"][examples],
            "puzzle_identifiers": data["puzzle_identifiers"][puzzles],
        }
        batch = {k: v.astype(np.int32) for k, v in batch.items()}
        if meta["ignore_label_id"] is not None:
            batch["labels"][batch["labels"] == meta["ignore_label_id"]] = -100
        assert batch["inputs"].shape[1] == meta["seq_len"] and batch["inputs"].max() < meta["vocab_size"]
        batches.append({**batch, "examples": np.array(examples)})
    return batches


def test_round_trip_with_uneven_puzzles_and_groups(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    arrays = {
        "inputs": rng.integers(0, 7, size=(7, 5)),
        "labels": rng.integers(0, 7, size=(7, 5)),
        "puzzle_identifiers": np.array([1, 2, 0, 3]),
        "puzzle_indices": np.array([0, 2, 3, 6, 7]),
        "group_indices": np.array([0, 2, 4]),
    }
    meta = PuzzleMetadata(0, 0, 0, 7, 5, 4, 2, 7 / 4, 4, ["all"])
    write_split(tmp_path / "train", meta, arrays)
    ds = PuzzleDataset(tmp_path, "train")
    assert ds.metadata == meta and len(ds) == 7 and ds.num_puzzles == 4 and ds.num_groups == 2
    assert isinstance(ds.inputs, np.memmap) and isinstance(ds.labels, np.memmap)
    for name, value in arrays.items():
        assert (np.asarray(getattr(ds, name)) == value).all()
    assert list(ds.examples_of_puzzle(2)) == [3, 4, 5] and list(ds.puzzles_of_group(1)) == [2, 3]
    assert list(ds.examples_of_group(0)) == [0, 1, 2] and list(ds.examples_of_group(1)) == [3, 4, 5, 6]
    example_puzzle, puzzle_group = group_membership(arrays["puzzle_indices"], arrays["group_indices"])
    assert example_puzzle.tolist() == [0, 0, 1, 2, 2, 2, 3] and puzzle_group.tolist() == [0, 0, 1, 1]
    batch = ds.batch(np.array([6, 0, 4, 0]))
    assert all(v.dtype == np.int32 for v in batch.values())
    assert (batch["inputs"] == arrays["inputs"][[6, 0, 4, 0]]).all()
    assert batch["puzzle_identifiers"].tolist() == [3, 1, 0, 1]  # examples 6, 0, 4, 0 are in puzzles 3, 0, 2, 0
    raw = arrays["labels"][[6, 0, 4, 0]]
    assert (batch["labels"] == np.where(raw == 0, -100, raw)).all()
    assert (ds.batch(np.array([6, 0]), map_ignore=False)["labels"] == arrays["labels"][[6, 0]]).all()


def test_built_files_match_the_reference_format(tmp_path: Path) -> None:
    root = build_dataset("sudoku", tmp_path / "sudoku", count=5, test_count=3, givens=36, augment=2, seed=0)
    assert json.loads((root / "identifiers.json").read_text()) == ["<blank>"]
    for split, n, group in (("train", 15, 3), ("test", 3, 1)):
        meta = json.loads((root / split / "dataset.json").read_text())
        assert list(meta) == list(REFERENCE_FIELDS)
        assert all(type(meta[k]) is t for k, t in REFERENCE_FIELDS.items())
        assert meta["sets"] == ["all"] and meta["seq_len"] == 81 and meta["vocab_size"] == 11
        assert (meta["pad_id"], meta["ignore_label_id"], meta["blank_identifier_id"]) == (0, 0, 0)
        assert (meta["total_groups"], meta["total_puzzles"], meta["mean_puzzle_examples"]) == (n // group, n, 1.0)
        loaded = {k: np.load(root / split / f"all__{k}.npy") for k in ARRAY_DTYPES}
        assert all(loaded[k].dtype == t for k, t in ARRAY_DTYPES.items())
        assert loaded["inputs"].shape == loaded["labels"].shape == (n, 81)
        assert loaded["puzzle_indices"].tolist() == list(range(n + 1))
        assert loaded["group_indices"].tolist() == list(range(0, n + 1, group))
        assert loaded["labels"].min() >= 2 and loaded["inputs"].min() >= 1  # every cell supervised, no PAD


def test_reader_loads_a_dataset_written_the_reference_way(tmp_path: Path) -> None:
    arrays = write_like_reference_builder(tmp_path)
    train, test = open_dataset(tmp_path)
    assert train.metadata.total_puzzles == 3 and train.num_puzzles == 9  # the reference builder's count, accepted
    for name, value in arrays.items():
        assert (np.asarray(getattr(train, name)) == value).all() and getattr(train, name).dtype == value.dtype
    batch = test.batch(np.arange(9))
    assert (batch["labels"][:, 80] == -100).all() and (batch["labels"][:, :80] == arrays["labels"][:, :80]).all()
    assert reference_style_reads(tmp_path, "train")[0]["labels"][0, 80] == -100


@pytest.mark.parametrize("kind", ["sudoku", "maze"])
def test_reference_loader_reads_accept_our_datasets(tmp_path: Path, kind: str) -> None:
    root = build_dataset(kind, tmp_path / kind, count=4, test_count=2, augment=3, size=9, givens=40, seed=1)
    train, _ = open_dataset(root)
    for split in ("train", "test"):
        (theirs,) = reference_style_reads(root, split)
        ours = PuzzleDataset(root, split).batch(theirs["examples"])
        assert all((ours[k] == theirs[k]).all() for k in ("inputs", "labels", "puzzle_identifiers"))
    assert train.metadata.seq_len == 81 and train.num_groups == 4 and len(train) == 16  # a 9x9 maze is 81 long too


def _corrupt(root: Path, **changes: object) -> None:
    path = root / "train" / "dataset.json"
    meta = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None and key != "ignore_label_id":
            del meta[key]
        else:
            meta[key] = value
    path.write_text(json.dumps(meta))


@pytest.fixture
def built(tmp_path: Path) -> Path:
    return build_dataset("sudoku", tmp_path / "ds", count=4, test_count=2, givens=40, augment=1, seed=2)


def test_not_a_dataset(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"no train/dataset\.json, so it is not a puzzle dataset.*raytrm data sudoku"):
        open_dataset(tmp_path)
    with pytest.raises(UserError, match="no such directory"):
        open_dataset(tmp_path / "missing")


def test_split_directory_given_instead_of_the_dataset(built: Path) -> None:
    with pytest.raises(
        UserError, match=r"ds/train: no train/dataset\.json; .*ds/train is itself a split; fix: pass its parent .*/ds$"
    ):
        open_dataset(built / "train")


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"seq_len": None}, r"dataset\.json: missing field 'seq_len'.*expected the fields pad_id, ignore_label_id"),
        ({"seq_len": "81"}, r"field 'seq_len': got '81', expected an integer >= 1"),
        ({"sets": []}, r"field 'sets': got \[\], expected a non-empty list"),
        ({"seq_len": 80}, r"all__inputs\.npy: got shape \(8, 81\), expected \[N, 80\] \(seq_len in .*dataset\.json\)"),
        ({"total_puzzles": 99}, r"total_puzzles: got 99, expected 8 from puzzle_indices\.npy \(or 4"),
        ({"total_groups": 5}, r"total_groups: got 5, expected 4 from group_indices\.npy"),
        ({"vocab_size": 10}, r"all__inputs\.npy: token 10 out of vocab, expected 0\.\.9 \(vocab_size"),
        ({"mean_puzzle_examples": 2.0}, r"mean_puzzle_examples: got 2\.0, expected 1 examples per puzzle"),
    ],
)
def test_bad_metadata(built: Path, changes: dict, message: str) -> None:
    _corrupt(built, **changes)
    with pytest.raises(UserError, match=message):
        open_dataset(built)


def test_bad_arrays(built: Path) -> None:
    split = built / "train"
    indices = np.load(split / "all__puzzle_indices.npy")
    np.save(split / "all__puzzle_indices.npy", indices[[0, 2, 1, *range(3, len(indices))]])
    with pytest.raises(
        UserError, match=r"all__puzzle_indices\.npy: puzzle offsets: got offsets from 0 to 8 not monotone"
    ):
        open_dataset(built)
    np.save(split / "all__puzzle_indices.npy", indices[:-1])
    with pytest.raises(UserError, match=r"expected non-decreasing offsets from 0 to 8 \(examples\)"):
        open_dataset(built)
    np.save(split / "all__puzzle_indices.npy", indices)
    np.save(split / "all__puzzle_identifiers.npy", np.array([0, 0, 5, 0, 0, 0, 0, 0], np.int32))
    with pytest.raises(UserError, match=r"all__puzzle_identifiers\.npy: got ids 0\.\.5, expected 0\.\.0"):
        open_dataset(built)
    (split / "all__labels.npy").unlink()
    with pytest.raises(UserError, match=r"all__labels\.npy: missing .*rebuild"):
        open_dataset(built)
    (split / "dataset.json").write_text("{not json")
    with pytest.raises(UserError, match=r"dataset\.json: not readable JSON"):
        open_dataset(built)


def test_out_of_vocab_labels_and_unknown_set(built: Path) -> None:
    labels = np.load(built / "test" / "all__labels.npy")
    labels[0, 0] = 11
    np.save(built / "test" / "all__labels.npy", labels)
    with pytest.raises(UserError, match=r"test/all__labels\.npy: token 11 out of vocab, expected 0\.\.10"):
        open_dataset(built)
    with pytest.raises(UserError, match=r"set 'extra' not in dataset\.json sets \['all'\]"):
        PuzzleDataset(built, "train", set_name="extra")


def test_build_is_atomic_and_does_not_clobber(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "ds"

    def crash(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("raytrm.data.build.write_identifiers", crash)
    with pytest.raises(KeyboardInterrupt):
        build_dataset("sudoku", out, count=2, test_count=1, givens=40)
    assert list(tmp_path.iterdir()) == []  # neither the directory nor a partial sibling is left
    monkeypatch.undo()
    renames = []

    def spy(src: str | Path, dst: str | Path) -> None:  # the directory appears in one rename, already complete
        assert not Path(dst).exists() and Path(src).name.startswith(".ds.partial-")
        assert {p.name for p in Path(src).iterdir()} >= {"train", "test", "identifiers.json"}
        renames.append(dst)
        real_replace(src, dst)

    real_replace = os.replace
    monkeypatch.setattr("raytrm.data.build.os.replace", spy)
    build_dataset("sudoku", out, count=2, test_count=1, givens=40)
    monkeypatch.undo()
    assert renames == [out]
    with pytest.raises(UserError, match=r"ds: already exists; fix: pass a new --out, or --overwrite"):
        build_dataset("sudoku", out, count=2, test_count=1, givens=40)
    build_dataset("maze", out, count=2, test_count=1, size=7, overwrite=True)
    assert open_dataset(out)[0].metadata.seq_len == 49 and [p.name for p in tmp_path.iterdir()] == ["ds"]


def test_build_splits_are_deterministic_and_disjoint(tmp_path: Path) -> None:
    a = build_dataset("maze", tmp_path / "a", count=30, test_count=30, size=7, augment=7, seed=3)
    b = build_dataset("maze", tmp_path / "b", count=30, test_count=30, size=7, augment=7, seed=3)
    (train_a, test_a), (train_b, _) = open_dataset(a), open_dataset(b)
    assert (np.asarray(train_a.inputs) == np.asarray(train_b.inputs)).all()
    train_bases = {bytes(train_a.inputs[i]) for i in range(0, len(train_a), 8)}
    assert not train_bases & {bytes(x) for x in np.asarray(test_a.inputs)}  # small mazes repeat; test skips those
    group = np.asarray(train_a.inputs[list(train_a.examples_of_group(0))])
    assert len({g.tobytes() for g in group}) == 8  # the 8 symmetries of one maze


def test_bad_build_arguments(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"dataset kind: got 'chess', expected one of sudoku, maze"):
        build_dataset("chess", tmp_path / "x", count=1, test_count=1)
    with pytest.raises(UserError, match=r"dataset augment: got 8 for maze, expected 0\.\.7"):
        build_dataset("maze", tmp_path / "x", count=1, test_count=1, augment=8)
    with pytest.raises(UserError, match=r"dataset count: got 0, expected an integer >= 1"):
        build_dataset("sudoku", tmp_path / "x", count=0, test_count=1)
    assert not (tmp_path / "x").exists()
