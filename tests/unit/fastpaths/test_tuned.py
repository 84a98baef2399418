"""Choices kept between processes (raytrm.fastpaths.tuned): read back, merged across writers, a damaged store
measured again, named by what the choices depend on."""

from __future__ import annotations

from raytrm.constants import CACHE_DIR_ENV
from raytrm.fastpaths.tuned import TunedChoices, store_path


def test_a_choice_is_kept_for_the_next_process_and_two_writers_merge(tmp_path):
    path = tmp_path / "store.json"
    first, second = TunedChoices(path), TunedChoices(path)  # two processes that opened the store at once
    assert first.get("a") == (False, None)
    first.put("a", [1, 2, 3])
    second.put("b", None)  # torch.mm won: a choice too
    later = TunedChoices(path)
    assert later.get("a") == (True, [1, 2, 3]) and later.get("b") == (True, None)


def test_a_damaged_store_is_measured_again(tmp_path, caplog):
    path = tmp_path / "store.json"
    path.write_text("{not json")
    store = TunedChoices(path)
    assert store.get("a") == (False, None) and "measured again" in caplog.text
    store.put("a", 1)
    assert TunedChoices(path).get("a") == (True, 1)


def test_a_store_is_named_by_what_its_choices_depend_on(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    path = store_path("cublaslt", "NVIDIA H200", "driver12080", "cublaslt130001")
    assert path == tmp_path / "tuned" / "cublaslt" / "NVIDIA_H200-driver12080-cublaslt130001.json"
