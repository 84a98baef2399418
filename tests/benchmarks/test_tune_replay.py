"""The replay bench on a synthetic table (no measurement): every method runs and the table prints."""

from __future__ import annotations

import json
import math

from benchmarks.cli import main
from benchmarks.tune_measure import grid
from raytrm.tune.space import space_from_dict

SPACE = {
    "raytrm_space": 1,
    "base": {"model": {"hidden_size": 32}, "training": {"global_batch_size": 64, "threads": 1}},
    "params": {
        "training.micro_batch_size": {"type": "categorical", "choices": [4, 8, 16, 32, 64]},
        "model.H_cycles": {"type": "int", "low": 1, "high": 4},
        "training.threads": {"type": "int", "low": 1, "high": 2},
    },
    "startup_trials": 3,
}


def test_replay_prints_the_side_by_side(tmp_path, capsys):
    space = space_from_dict(SPACE, "<test>")
    rows = []
    for p in grid(space):
        mb, h, t = p["training.micro_batch_size"], p["model.H_cycles"], p["training.threads"]
        peak = 200 + mb * (10 + 4 * h)
        rows.append(
            {
                "params": p,
                "result": {
                    "quality": 0.9 - 0.05 * abs(math.log2(mb / 16)) - 0.06 * abs(h - 2) - 0.02 * (t == 1),
                    "peak_memory_mb": peak,
                    "memory_budget_mb": 1000,
                    "status": "ok" if peak <= 1000 else "over_budget",
                },
            }
        )
    table = tmp_path / "grid.json"
    table.write_text(json.dumps({"space": SPACE, "rows": rows}))
    assert main(["tune", "--table", str(table), "--seeds", "3", "--json", str(tmp_path / "o.json")]) == 0
    out = capsys.readouterr().out
    assert "grid 40 points, 8 trials each" in out and "raytrm" in out and "deepspeed-probe" in out
    assert len(json.loads((tmp_path / "o.json").read_text())["raytrm"]) == 3
