"""Files made to attack or break raytrm, and the cases the fuzzers found, kept as fixed examples (fast, not slow).

A checkpoint whose unpickling would run code, wherever raytrm reads checkpoints (`train --resume`,
`import-checkpoint`), is refused with one line and the code never runs; so is YAML with Python tags. Deeply
nested or alias-bomb YAML, and the dataset and checkpoint shapes that once escaped as tracebacks, are one line.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
from mutations import check_cli_refusal, check_refusal, run_cli

from raytrm import config as cfg
from raytrm.constants import spaces_dir
from raytrm.data.build import open_dataset
from raytrm.errors import UserError
from raytrm.train import checkpoint as ckpt
from raytrm.tune.space import load_space


class Plant:
    """Unpickling this runs `how`, which writes the marker file: proof that code ran."""

    def __init__(self, marker, how: str) -> None:
        self.marker, self.how = str(marker), how

    def __reduce__(self):
        if self.how == "system":
            return (os.system, (f"touch {self.marker}",))
        return (open, (self.marker, "w"))


def planted_payloads(marker) -> dict[str, bytes]:
    """Checkpoint payloads that write `marker` when loaded with plain pickle: torch's zip archive and a bare pickle."""
    out = {}
    for how in ("open", "system"):
        buffer = io.BytesIO()
        torch.save({"model": Plant(marker, how), "step": 1}, buffer)
        out[f"torch-{how}"] = buffer.getvalue()
        out[f"pickle-{how}"] = pickle.dumps({"model": Plant(marker, how)}, protocol=2)
    return out


def with_header(payload: bytes) -> bytes:
    """payload behind a header that matches it, as save_checkpoint writes one."""
    return ckpt.header_line(payload, step=1) + payload


@pytest.mark.parametrize("kind", ["torch-open", "torch-system", "pickle-open", "pickle-system"])
def test_the_planted_payloads_are_live(tmp_path, kind):
    """The attack is real: plain unpickling of each payload writes its marker."""
    marker = tmp_path / "ran"
    payload = planted_payloads(marker)[kind]
    if kind.startswith("torch"):
        torch.load(io.BytesIO(payload), weights_only=False)
    else:
        pickle.loads(payload)
    assert marker.exists()


@pytest.mark.parametrize("kind", ["torch-open", "torch-system", "pickle-open", "pickle-system"])
def test_resume_never_unpickles_code(tmp_path, seed_run, kind):
    run, _ = seed_run
    marker = tmp_path / "ran"
    target = tmp_path / "run"
    (target / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.yaml", target / "config.yaml")
    # Its checksum matches, so the payload itself reaches the unpickler: the only guard left is weights_only.
    planted = target / "checkpoints" / "step-00000001.ckpt"
    planted.write_bytes(with_header(planted_payloads(marker)[kind]))
    with pytest.raises(UserError) as refused:
        ckpt.load_checkpoint(planted)
    assert "payload cannot be read (UnpicklingError)" in check_refusal(refused.value)
    code, _, err = run_cli(["train", "--out", str(target), "--resume", "--steps", "2", "--quiet"])
    assert "no checkpoint verifies" in check_cli_refusal(code, err)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["torch-open", "torch-system", "pickle-open", "pickle-system"])
def test_import_checkpoint_never_unpickles_code(tmp_path, seed_run, kind):
    run, _ = seed_run
    marker = tmp_path / "ran"
    planted = tmp_path / "reference.pt"
    planted.write_bytes(planted_payloads(marker)[kind])
    out = tmp_path / "imported"
    code, _, err = run_cli(["import-checkpoint", str(planted), "--out", str(out), "--config", str(run / "config.yaml")])
    assert "not a readable PyTorch checkpoint (UnpicklingError)" in check_cli_refusal(code, err)
    assert not marker.exists()
    assert not (out / "config.yaml").exists()  # nothing left behind that looks like a run


PYTHON_TAGS = [
    "!!python/object/apply:os.system ['touch {marker}']",
    "!!python/object/new:os.system ['touch {marker}']",
    "!!python/object/apply:builtins.open ['{marker}', 'w']",
    "!!python/name:os.system",
]


@pytest.mark.parametrize("tag", PYTHON_TAGS)
@pytest.mark.parametrize("head", ["", "raytrm_profile: 1\n"])
def test_yaml_with_python_tags_is_refused(tmp_path, tag, head):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.yaml"
    path.write_text(f"{head}model:\n  hidden_size: {tag.format(marker=marker)}\n")
    code, _, err = run_cli(["validate", str(path)])
    assert "could not determine a constructor for the tag" in check_cli_refusal(code, err)
    space = tmp_path / "space.yaml"
    space.write_text(f"raytrm_space: 1\nbase: {tag.format(marker=marker)}\n")
    with pytest.raises(UserError) as refused:
        load_space(space)
    check_refusal(refused.value)
    assert not marker.exists()


def alias_bomb(levels: int = 9) -> str:
    """Nine levels of nine aliases: 9**9 values when expanded, a few hundred bytes of YAML."""
    lines = ["training:", "  betas:", "  - &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text, piece",
    [
        ("model: " + "[" * 1000 + "]" * 1000 + "\n", "nested deeper than 64 levels"),
        ("raytrm_profile: 1\nmeasured:\n  objective:\n    a: " + "[" * 300 + "]" * 300 + "\n", "nested deeper"),
        (alias_bomb(), "more than 100000 values"),
        ("a: &a [*a]\n", "more than 100000 values"),
        ("model:\n  hidden_size: [" + ", ".join(["1"] * 5000) + "]\n", "got [1, 1, 1, 1, 1, ...], expected an integer"),
        ("raytrm_profile: 1\ntier: t\n", "limits.memory_budget_mb: got None, expected the tier's memory budget"),
    ],
    ids=["deep", "deep-profile", "alias-bomb", "self-alias", "huge-value", "profile-without-limits"],
)
def test_hostile_yaml_is_one_line(tmp_path, text, piece):
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    code, _, err = run_cli(["validate", str(path)])
    assert piece in check_cli_refusal(code, err)


@pytest.mark.parametrize("text", ["", "[1, 2]\n", "just text\n"])
def test_a_profile_without_its_schema_version_is_refused(tmp_path, text):
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as refused:
        cfg.load_profile(path)
    assert "raytrm_profile: got None, expected schema version 1" in check_refusal(refused.value)


@pytest.mark.parametrize("tiers", ["[[macbook-air-8gb]]", "[{name: macbook-air-8gb}]"])
def test_a_space_whose_tier_names_are_not_strings_is_one_line(tmp_path, tiers):
    path = tmp_path / "space.yaml"
    path.write_text((spaces_dir() / "quick.yaml").read_text() + f"tiers: {tiers}\n")
    with pytest.raises(UserError) as refused:
        load_space(path)
    check_refusal(refused.value)


def _edit_dataset(root, case: str) -> None:
    train = root / "train"
    meta = json.loads((train / "dataset.json").read_text())
    if case == "empty npy":
        (train / "all__inputs.npy").write_bytes(b"")
    elif case == "npz":
        with open(train / "all__labels.npy", "wb") as f:
            np.savez(f, a=np.zeros(3))
    elif case == "broken header":
        data = (train / "all__inputs.npy").read_bytes()
        (train / "all__inputs.npy").write_bytes(data.replace(b"'descr':", b"'descr'(:", 1))
    elif case == "string tokens":
        np.save(train / "all__inputs.npy", np.load(train / "all__inputs.npy").astype("<U2"))
    elif case == "float identifiers":
        np.save(
            train / "all__puzzle_identifiers.npy", np.full(len(np.load(train / "all__puzzle_identifiers.npy")), 0.5)
        )
    elif case == "uint64 offsets":
        np.save(train / "all__puzzle_indices.npy", np.load(train / "all__puzzle_indices.npy").astype(np.uint64))
    elif case == "unsigned offsets going back":
        offsets = np.load(train / "all__puzzle_indices.npy").astype(np.uint8)
        offsets[2] = offsets[3] + 1  # a wrapped-around difference once hid this
        np.save(train / "all__puzzle_indices.npy", offsets)
    elif case == "zero-d offsets":
        np.save(train / "all__puzzle_indices.npy", np.int32(0))
    elif case == "no examples":
        for name, value in (("inputs", np.zeros((0, 81), np.uint8)), ("labels", np.zeros((0, 81), np.uint8))):
            np.save(train / f"all__{name}.npy", value)
        np.save(train / "all__puzzle_identifiers.npy", np.zeros(0, np.int32))
        np.save(train / "all__puzzle_indices.npy", np.zeros(1, np.int32))
        np.save(train / "all__group_indices.npy", np.zeros(1, np.int32))
        meta.update(total_groups=0, total_puzzles=0)
        (train / "dataset.json").write_text(json.dumps(meta))
    elif case == "zero seq_len":
        n = len(np.load(train / "all__inputs.npy"))
        for name in ("inputs", "labels"):
            np.save(train / f"all__{name}.npy", np.zeros((n, 0), np.uint8))
        (train / "dataset.json").write_text(json.dumps({**meta, "seq_len": 0}))
    elif case == "test ids beyond the train table":
        test = root / "test"
        test_meta = json.loads((test / "dataset.json").read_text())
        (test / "dataset.json").write_text(json.dumps({**test_meta, "num_puzzle_identifiers": 5}))
        ids = np.load(test / "all__puzzle_identifiers.npy")
        np.save(test / "all__puzzle_identifiers.npy", np.full_like(ids, 4))
    elif case == "deep json":
        (train / "dataset.json").write_text("[" * 100_000)


DATASET_CASES = [
    "empty npy",
    "npz",
    "broken header",
    "string tokens",
    "float identifiers",
    "unsigned offsets going back",
    "zero-d offsets",
    "no examples",
    "zero seq_len",
    "test ids beyond the train table",
    "deep json",
]


@pytest.mark.parametrize("case", DATASET_CASES)
def test_broken_datasets_are_one_line(tmp_path, seed_dataset, case):
    root = tmp_path / "data"
    shutil.copytree(seed_dataset, root)
    _edit_dataset(root, case)
    with pytest.raises(UserError) as refused:
        open_dataset(root)
    check_refusal(refused.value)


def test_unsigned_offsets_load_as_they_read(tmp_path, seed_dataset):
    """uint64 offsets once crashed np.repeat (no safe cast to int64); their values are what count."""
    root = tmp_path / "data"
    shutil.copytree(seed_dataset, root)
    _edit_dataset(root, "uint64 offsets")
    train, _ = open_dataset(root)
    assert train.puzzle_indices.dtype == np.uint64 and len(train.example_puzzle) == len(train)


@pytest.mark.parametrize(
    "state",
    [None, [], {}, {"model": {0: None}}, {"model": "weights", "config": 3}, "text"],
    ids=["none", "list", "empty", "int-key", "wrong-types", "str"],
)
def test_checksummed_checkpoints_with_the_wrong_contents_are_one_line(tmp_path, seed_run, state):
    run, _ = seed_run
    target = tmp_path / "run"
    (target / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.yaml", target / "config.yaml")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    (target / "checkpoints" / "step-00000001.ckpt").write_bytes(with_header(buffer.getvalue()))
    code, _, err = run_cli(["train", "--out", str(target), "--resume", "--steps", "2", "--quiet"])
    check_cli_refusal(code, err)
    code, _, err = run_cli(["export-checkpoint", str(target), "--out", str(tmp_path / "ref.pt")])
    check_cli_refusal(code, err)


@pytest.mark.parametrize(
    "edit",
    [
        lambda state: state.update(exp_avg=3),
        lambda state: state.update(exp_avg=torch.tensor(0.5)),
        lambda state: state.update(step=torch.zeros(2)),
    ],
    ids=["moment-a-number", "moment-a-scalar-tensor", "step-a-vector"],
)
def test_optimizer_states_that_load_but_cannot_step_are_one_line(tmp_path, seed_run, edit):
    """Found by the checkpoint fuzzing: torch's load_state_dict takes these, and its first step fails deep inside."""
    run, _ = seed_run
    target = tmp_path / "run"
    shutil.copytree(run, target)
    path = target / "checkpoints" / "step-00000001.ckpt"
    state = ckpt.load_checkpoint(path)
    edit(next(iter(state["optimizer"]["state"].values())))
    ckpt.save_checkpoint(state, path.parent, 1)
    code, _, err = run_cli(["train", "--out", str(target), "--resume", "--steps", "2", "--quiet"])
    assert "optimizer state" in check_cli_refusal(code, err)


def test_a_parameters_optimizer_state_that_is_no_mapping_is_one_line(tmp_path, seed_run):
    run, _ = seed_run
    target = tmp_path / "run"
    shutil.copytree(run, target)
    path = target / "checkpoints" / "step-00000001.ckpt"
    state = ckpt.load_checkpoint(path)
    first = next(iter(state["optimizer"]["state"]))
    state["optimizer"]["state"][first] = []
    ckpt.save_checkpoint(state, path.parent, 1)
    code, _, err = run_cli(["train", "--out", str(target), "--resume", "--steps", "2", "--quiet"])
    assert "expected a mapping" in check_cli_refusal(code, err)


def test_a_deeply_nested_checkpoint_header_is_one_line(tmp_path):
    path = tmp_path / "step-00000001.ckpt"
    path.write_bytes(b"[" * 100_000 + b"\n")
    with pytest.raises(UserError) as refused:
        ckpt.load_checkpoint(path)
    assert "not a raytrm checkpoint" in check_refusal(refused.value)


@pytest.mark.parametrize("edit", ["int key", "int tensor", "complex", "meta", "sparse"])
def test_reference_checkpoints_of_the_wrong_kind_are_one_line(tmp_path, seed_run, edit):
    run, reference = seed_run
    state = torch.load(reference, weights_only=True)
    if edit == "int key":
        state[5] = torch.zeros(1)
    else:
        make = {
            "int tensor": lambda v: v.to(torch.int64),
            "complex": lambda v: v.to(torch.complex64),
            "meta": lambda v: torch.empty_like(v, device="meta"),
            "sparse": lambda v: v.to_sparse(),
        }[edit]
        state = {k: make(v) for k, v in state.items()}
    path = tmp_path / "reference.pt"
    torch.save(state, path)
    out = tmp_path / "imported"
    code, _, err = run_cli(["import-checkpoint", str(path), "--out", str(out), "--config", str(run / "config.yaml")])
    assert "not a state dict of names to floating-point tensors" in check_cli_refusal(code, err)
