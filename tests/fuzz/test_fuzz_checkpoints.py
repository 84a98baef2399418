"""Fuzzing checkpoints: raytrm's own (what `raytrm train --resume` reads) and the reference layout (what
`raytrm import-checkpoint` reads): truncated, bit-flipped, random bytes, edited headers, and valid archives with the
wrong contents (a checksum that matches, so the contents themselves are put to the test), among them tensors of
another shape than the config builds.

Property: loading either gives a state the trainer takes, or refuses with a UserError of one line; the CLI command
exits 0, or 2 with one line on stderr.
"""

from __future__ import annotations

import copy
import io
import itertools
import json
import pickle
import shutil
import zipfile

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mutations import (
    FUZZ,
    FUZZ_EXAMPLES,
    GARBAGE,
    Counter,
    check_cli_refusal,
    corrupted,
    load_or_refusal,
    mutated,
    run_cli,
)

from raytrm import config as cfg
from raytrm.models.reference_layout import load_reference_checkpoint
from raytrm.train import checkpoint as ckpt
from raytrm.train.trainer import Trainer

pytestmark = pytest.mark.slow

TENSORS = st.builds(
    lambda shape, dtype: torch.ones(shape, dtype=dtype),
    st.lists(st.integers(0, 4), max_size=3),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]),
)
CHECKPOINT = "step-00000001.ckpt"


def torch_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def with_header(payload: bytes) -> bytes:
    """payload behind a header that matches it, as save_checkpoint writes one."""
    return ckpt.header_line(payload, step=1) + payload


@st.composite
def zip_edit(draw: st.DrawFn, payload: bytes) -> bytes:
    """A torch archive with one member dropped, corrupted, or its pickle replaced by a pickle of garbage."""
    source = zipfile.ZipFile(io.BytesIO(payload))
    members = source.infolist()
    target = members[draw(st.integers(0, len(members) - 1))]
    op = draw(st.sampled_from(["drop", "corrupt", "pickle"]))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for info in members:
            data = source.read(info)
            if info is target and op == "drop":
                continue
            if info is target and op == "corrupt":
                data = draw(corrupted(data))
            if info.filename.endswith("data.pkl") and op == "pickle":
                data = pickle.dumps(draw(GARBAGE), protocol=2)
            archive.writestr(info.filename, data)
    return out.getvalue()


def state_files(state: dict, extra: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    """Valid torch archives of a state with wrong contents: edited values, keys, tensors; or foreign objects."""
    return st.one_of(mutated(state, extra=extra).map(torch_bytes), (GARBAGE | TENSORS).map(torch_bytes))


def _tensor_slots(doc: object) -> list[tuple[object, object]]:
    """(container, key) of every tensor in a state, depth first (tuples hold none that a checkpoint keeps)."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    out: list[tuple[object, object]] = []
    for key, value in list(items):
        if isinstance(value, torch.Tensor):
            out.append((doc, key))
        else:
            out.extend(_tensor_slots(value))
    return out


@st.composite
def reshaped(draw: st.DrawFn, state: dict) -> dict:
    """The state with one to three of its tensors given another shape, dtype kept: a checkpoint whose every byte
    checks out, written for another model (a dimension one more or less, one dimension more or fewer)."""
    state = copy.deepcopy(state)
    slots = _tensor_slots(state)
    for _ in range(draw(st.integers(1, 3))):
        parent, key = slots[draw(st.integers(0, len(slots) - 1))]
        old = parent[key]
        shape = list(old.shape)
        op = draw(st.sampled_from(["grow", "shrink", "add", "drop"] if shape else ["add"]))
        if op in ("grow", "shrink"):
            at = draw(st.integers(0, len(shape) - 1))
            shape[at] = shape[at] + 1 if op == "grow" or shape[at] <= 1 else shape[at] - 1
        elif op == "add":
            shape.insert(draw(st.integers(0, len(shape))), 2)
        else:
            shape.pop(draw(st.integers(0, len(shape) - 1)))
        parent[key] = torch.zeros(shape, dtype=old.dtype)
    return state


def raytrm_checkpoints(raw: bytes) -> st.SearchStrategy[bytes]:
    header, _, payload = raw.partition(b"\n")
    state = torch.load(io.BytesIO(payload), weights_only=True)
    edited_header = mutated(json.loads(header)).map(lambda h: json.dumps(h).encode() + b"\n" + payload)
    return st.one_of(
        corrupted(raw),
        edited_header,
        state_files(state, TENSORS).map(with_header),
        state_files(state, TENSORS).map(with_header),
        reshaped(state).map(torch_bytes).map(with_header),
        reshaped(state).map(torch_bytes).map(with_header),
        zip_edit(payload).map(with_header),
    )


def reference_checkpoints(raw: bytes) -> st.SearchStrategy[bytes]:
    state = torch.load(io.BytesIO(raw), weights_only=True)
    return st.one_of(corrupted(raw), state_files(state, TENSORS), state_files(state, TENSORS), zip_edit(raw))


def test_raytrm_checkpoints(tmp_path, seed_run, tiers_read_once):
    run, _ = seed_run
    counter = Counter("raytrm checkpoints (train --resume)")
    numbers = itertools.count()

    @FUZZ
    @given(raytrm_checkpoints((run / "checkpoints" / CHECKPOINT).read_bytes()))
    def prop(content: bytes) -> None:
        target = tmp_path / f"run{next(numbers)}"
        (target / "checkpoints").mkdir(parents=True)
        shutil.copy(run / "config.yaml", target / "config.yaml")
        (target / "checkpoints" / CHECKPOINT).write_bytes(content)
        loaded, _ = load_or_refusal(ckpt.load_checkpoint, target / "checkpoints" / CHECKPOINT)
        assert loaded is None or isinstance(loaded, dict)
        # One step after the resume: a state that loads but cannot train is no valid state.
        code, _, err = run_cli(["train", "--out", str(target), "--resume", "--steps", "2", "--quiet"])
        if loaded is None or code != 0:
            check_cli_refusal(code, err)
        counter.add(code != 0)
        shutil.rmtree(target)

    prop()
    print(counter.report())
    assert counter.ran >= FUZZ_EXAMPLES


def test_reference_checkpoints(tmp_path, seed_run, tiers_read_once):
    run, reference = seed_run
    counter = Counter("reference checkpoints (import-checkpoint)")
    model = Trainer(cfg.load(cfg.ExperimentConfig, run / "config.yaml")).model
    numbers = itertools.count()

    @FUZZ
    @given(reference_checkpoints(reference.read_bytes()))
    def prop(content: bytes) -> None:
        n = next(numbers)
        path = tmp_path / f"ref{n}.pt"
        path.write_bytes(content)
        _, error = load_or_refusal(load_reference_checkpoint, path, model)
        out = tmp_path / f"imported{n}"
        code, _, err = run_cli(
            ["import-checkpoint", str(path), "--out", str(out), "--config", str(run / "config.yaml")]
        )
        if error is not None or code != 0:
            check_cli_refusal(code, err)
        counter.add(error is not None)
        path.unlink()
        shutil.rmtree(out, ignore_errors=True)

    prop()
    print(counter.report())
    assert counter.ran >= FUZZ_EXAMPLES
