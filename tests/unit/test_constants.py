"""Where raytrm finds its tier table and search spaces: package data unless $RAYTRM_SPACES_DIR names a folder, and a
bare name stands for the file of that name there only where no such path exists."""

from __future__ import annotations

from pathlib import Path

import raytrm
from raytrm.constants import SPACES_DIR_ENV, named_file, spaces_dir


def test_the_tiers_and_spaces_are_package_data(monkeypatch):
    monkeypatch.delenv(SPACES_DIR_ENV, raising=False)
    assert spaces_dir() == Path(raytrm.__file__).resolve().parent / "tune_spaces"
    assert {"tiers", "quick", "sudoku", "maze", "transformer"} <= {p.stem for p in spaces_dir().glob("*.yaml")}


def test_the_environment_names_another_folder(monkeypatch, tmp_path):
    (tmp_path / "mine.yaml").write_text("raytrm_space: 1\n")
    monkeypatch.setenv(SPACES_DIR_ENV, str(tmp_path))
    assert spaces_dir() == tmp_path
    assert named_file("mine") == tmp_path / "mine.yaml" and named_file("quick") is None


def test_a_bare_name_is_the_shipped_file_unless_a_path_of_that_name_exists(monkeypatch, tmp_path):
    monkeypatch.delenv(SPACES_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert named_file("quick") == spaces_dir() / "quick.yaml"
    assert named_file("tiers") == spaces_dir() / "tiers.yaml"
    assert named_file("quick.yaml") is None  # a file name is a path, never a name
    assert named_file("nothing") is None
    (tmp_path / "quick").write_text("training: {}\n")
    assert named_file("quick") is None
