"""The schema's readers shared by every file raytrm reads: the schema version rule, JSON records and their fields."""

from __future__ import annotations

import pytest

from raytrm import __version__
from raytrm.errors import ConfigError, UserError
from raytrm.schema import check_fields, check_version, read_json

AGAIN = "export it again with this version"


def _refusal(data, version=1) -> str:
    with pytest.raises(UserError) as refused:
        check_version(data, "f.yaml", "raytrm_x", version, "this is not an x file", AGAIN)
    return str(refused.value)


def test_the_version_this_raytrm_reads_passes():
    check_version({"raytrm_x": 1}, "f.yaml", "raytrm_x", 1, "", AGAIN)
    check_version({"raytrm_x": 2}, "f.yaml", "raytrm_x", 2, "", AGAIN)


def test_a_newer_version_says_to_upgrade_raytrm_or_make_the_file_again():
    assert _refusal({"raytrm_x": 2}) == (
        f"f.yaml: raytrm_x 2 is newer than this raytrm ({__version__}) reads (1); upgrade raytrm "
        f"(`pip install -U raytrm`), or {AGAIN}"
    )


def test_an_older_version_says_to_make_the_file_again():
    assert _refusal({"raytrm_x": 1}, version=2) == (
        f"f.yaml: raytrm_x 1 is older than this raytrm ({__version__}) reads (2); {AGAIN}"
    )


@pytest.mark.parametrize("found", ["1", 1.0, 0, -1, True, None, [1], {"v": 1}])
def test_a_version_that_is_not_a_whole_number_from_1_is_refused(found):
    assert _refusal({"raytrm_x": found}) == (
        f"f.yaml: raytrm_x: got {found!r}, expected a schema version, a whole number >= 1 (this raytrm reads 1); "
        f"fix: set raytrm_x: 1, or {AGAIN}"
    )


@pytest.mark.parametrize("data", [{}, {"other": 1}, [1], "text", None])
def test_a_missing_version_names_what_the_file_is_not(data):
    assert _refusal(data) == "f.yaml: raytrm_x: got None, expected schema version 1; fix: this is not an x file"


@pytest.mark.parametrize(
    ("content", "piece"),
    [
        (b"\xff\xfe{}", "not a text file (invalid UTF-8 at byte 0); expected JSON; FIX"),
        (b'{"a": 1', "not JSON at line 1, column 8 (Expecting ',' delimiter); FIX"),
        (b"", "not JSON at line 1, column 1 (Expecting value); FIX"),
        (b"[1, 2]", "(top level): got [1, 2], expected a JSON object of field: value; fix: FIX"),
        (b"3", "(top level): got 3, expected a JSON object of field: value; fix: FIX"),
        (b"[" * 100_000, "data nested too deep to be a raytrm file; FIX"),
    ],
)
def test_json_that_is_not_one_object_is_one_line(tmp_path, content, piece):
    path = tmp_path / "r.json"
    path.write_bytes(content)
    with pytest.raises(UserError) as refused:
        read_json(path, "FIX")
    assert str(refused.value) == f"{path}: {piece}"


def test_a_json_object_reads(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"a": 1, "b": NaN}')
    data = read_json(path, "FIX")
    assert data["a"] == 1 and data["b"] != data["b"]
    with pytest.raises(UserError, match="no such file"):
        read_json(tmp_path / "none.json", "FIX")


KINDS = {"n": "number", "i": "int", "s": "str", "l": "list", "d": "dict"}


@pytest.mark.parametrize(
    ("record", "required", "piece"),
    [
        ({"n": "3"}, (), "n: got '3', expected a number"),
        ({"n": True}, (), "n: got True, expected a number"),
        ({"i": 1.5}, (), "i: got 1.5, expected an integer"),
        ({"s": 3}, (), "s: got 3, expected a string"),
        ({"l": {}}, (), "l: got {}, expected a list"),
        ({"d": []}, (), "d: got [], expected a mapping"),
        ({}, ("s",), "s: got None, expected a string"),
        ({"s": None}, ("s",), "s: got None, expected a string"),
    ],
)
def test_fields_of_the_wrong_kind_are_one_line(record, required, piece):
    with pytest.raises(ConfigError) as refused:
        check_fields(record, "r.json", KINDS, "x.", required, fix="FIX")
    assert str(refused.value) == f"r.json: x.{piece}; fix: FIX"


def test_fields_of_their_kind_null_and_others_pass():
    record = {"n": float("nan"), "i": 3, "s": "a", "l": [], "d": {}, "other": object()}
    check_fields(record, "r.json", KINDS, required=("s",))
    check_fields({"n": None, "i": None}, "r.json", KINDS)
