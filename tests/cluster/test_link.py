"""The rig's link rate on two real hosts: a shaped link carries its rate in both directions, and
`python -m benchmarks distributed --parts link` runs end to end on a pair it makes itself, at one small
configuration."""

from __future__ import annotations

import functools
import json
import os
import subprocess

import pytest

from benchmarks import link
from benchmarks.cli import main

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_a_shaped_link_carries_its_rate_both_ways_and_unshaping_restores_it(pair):
    unshaped = pair.transfer_mbit("a")
    pair.set_rate("20mbit")
    assert all("tbf" in shown and "rate 20Mbit" in shown for shown in pair.qdiscs()), pair.qdiscs()
    shaped = [pair.transfer_mbit("a"), pair.transfer_mbit("b")]
    assert all(15 < got < 21 for got in shaped), shaped  # TCP gets nearly all of the rate, never more
    assert unshaped > 20 * max(shaped), (unshaped, shaped)
    pair.set_rate("unshaped")
    assert not any("tbf" in shown for shown in pair.qdiscs()), pair.qdiscs()
    assert pair.transfer_mbit("b") > 20 * max(shaped)


def namespaces() -> set[str]:
    """The namespaces this process made (others' tests may make theirs meanwhile)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    names = (line.split()[0] for line in listed.splitlines() if line.strip())
    return {name for name in names if name[3:].partition("-")[0] == str(os.getpid())}


def test_the_link_part_trains_on_its_own_pair_and_removes_it(pair, tmp_path, monkeypatch, capsys):
    """A small TRM (hidden 64: 0.4M parameters) at 20 Mbit/s, exact sync, on a pair the bench makes and removes; the
    pair fixture only proves this machine can make hosts (the ratios against unshaped runs: tests/benchmarks)."""
    before = namespaces()
    small = functools.partial(link.trm_model, hidden=64, batch=16, train_puzzles=200, augment=0)
    monkeypatch.setattr(link, "trm_model", small)
    out = tmp_path / "link.json"
    args = ["--link-models", "trm", "--link-rates", "20mbit", "--sync-modes", "exact", "--link-steps", "6"]
    args += ["--json", str(out)]
    assert main(["distributed", "--parts", "link", *args]) == 0
    assert namespaces() == before  # the bench's own hosts are gone with their processes
    printed = capsys.readouterr().out
    assert "trm: TRM mlp_t hidden 64, global batch 16" in printed and "96 samples" in printed
    result = json.loads(out.read_text())["results"]
    assert result["rows"] == []  # no other part was asked for
    (run,) = result["link"]["runs"]
    assert run["rate"] == "20mbit" and run["error"] == "" and run["workers"] == 2 and run["timed_steps"] == 4, run
    assert 15 < run["link_mbit"] < 21
    # 1.6 MB of gradients a step at 20 Mbit/s: most of the step waits on the link.
    assert run["sync_share"] > 0.3 and run["samples_per_sec"] > 0 and 0 < run["quality"] < 1
    (row,) = result["link"]["rows"]
    assert row["rate"] == "20mbit" and row["ratio"] is None  # no unshaped run to compare with
