"""A tiny Sudoku dataset and a one-step run of a tiny TRM on it: the valid files the fuzz tests start from."""

from __future__ import annotations

import pytest
from mutations import TINY, run_cli

from raytrm.data.build import build_dataset


@pytest.fixture
def tiers_read_once(monkeypatch):
    """tiers.yaml parsed once: parsing it is most of the time of one `raytrm train` run that refuses its input."""
    from raytrm.hardware import tiers

    real, table = tiers.load_tiers, tiers.load_tiers()
    monkeypatch.setattr(tiers, "load_tiers", lambda path=None: table if path is None else real(path))


@pytest.fixture(scope="session")
def seed_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-data") / "sudoku"
    return build_dataset("sudoku", root, count=8, test_count=2, givens=40, augment=1, seed=5)


@pytest.fixture(scope="session")
def seed_run(tmp_path_factory, seed_dataset):
    """A run directory (config.yaml, checkpoints/step-00000001.ckpt) and its weights in the reference layout."""
    work = tmp_path_factory.mktemp("fuzz-run")
    run = work / "run"
    code, _, err = run_cli(["train", "--data", str(seed_dataset), "--steps", "1", "--out", str(run), *TINY])
    assert code == 0, err
    reference = work / "reference.pt"
    code, _, err = run_cli(["export-checkpoint", str(run), "--out", str(reference)])
    assert code == 0, err
    return run, reference
