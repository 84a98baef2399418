"""metrics.jsonl keeps what a person reads in it: small values (an lr of 1e-12, an update ratio) to six significant
digits, the rest to six decimals, non-finite values as null."""

from __future__ import annotations

import math

from raytrm.train.run.metrics import MetricsLog, read_metrics


def test_small_values_keep_six_significant_digits_and_the_rest_six_decimals(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 1, "lr": 1e-12, "update_ratio": 3.14159265e-11, "loss": 2.5674361234, "rate": 71.01234567})
    log.write({"step": 2, "lr": 0.0, "loss": math.nan, "grad_norm": 0.00160734567})
    log.close()
    first, second = read_metrics(tmp_path / "metrics.jsonl")
    assert first == {"step": 1, "lr": 1e-12, "update_ratio": 3.14159e-11, "loss": 2.567436, "rate": 71.012346}
    assert second == {"step": 2, "lr": 0.0, "loss": None, "grad_norm": 0.00160735}
