"""`python -m benchmarks distributed --parts link` without the hosts: its modes, rates, reading of a run, rows and
refusal. The pair itself is exercised by tests/cluster/test_link.py."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import link, link_lora, link_models, link_runs
from benchmarks.cli import main
from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.models.transformer import Transformer
from tests.support import hosts


@pytest.mark.parametrize(("rate", "bits"), [("unshaped", None), ("20mbit", 20e6), ("1gbit", 1e9), ("2.5Mbit", 2.5e6)])
def test_rates_read_in_tc_notation(rate, bits):
    assert hosts.rate_bits(rate) == bits


@pytest.mark.parametrize("rate", ["20", "20mb", "fast", "-1mbit"])
def test_a_bad_rate_is_one_line(rate):
    with pytest.raises(UserError, match=rf"link rate '{rate}': expected unshaped or a number"):
        link.check_rates(["unshaped", rate])


def test_modes_become_the_training_fields():
    assert link_models.default_modes() == ["exact", "compressed", "local", "auto"]
    assert set(link_models.default_modes()) == set(cfg.SYNC_MODES)  # every mode the config has, baseline first
    assert link_models.mode_settings("local:8") == {"sync_mode": "local", "sync_every": 8}
    assert link_models.mode_settings("auto") == {"sync_mode": "auto"}
    for bad in ("local:0", "exact:4", "ring", "local:x"):
        with pytest.raises(UserError, match="expected one of exact, compressed, local, auto or local:H"):
            link_models.mode_settings(bad)


def test_the_lm_weighs_at_least_20m_parameters(tmp_path):
    model = link_models.lm_model(tmp_path)
    assert Transformer(cfg.from_dict(cfg.ModelConfig, model.experiment["model"])).num_parameters() >= 20_000_000
    assert (tmp_path / "corpus.py.txt").stat().st_size == link_models.LM_CORPUS_BYTES
    assert model.steps == 20 and model.warmup == 3 and model.global_batch == 32


def fake_run(tmp_path, steps, rate, workers=None, summary=None):
    """A run directory as `raytrm train` leaves it: a metrics row each step (and an event), and the summary."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    rows = [{"step": 1, "event": "rebalance"}]
    for step in range(1, steps + 1):
        row = {"step": step, "samples_per_sec": rate(step)}
        if workers:
            row["workers"] = workers(step)
        rows.append(row)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "summary.json").write_text(json.dumps({"workers": 2, "eval_cell_acc": 0.5, **(summary or {})}))
    return run


def test_a_run_is_timed_over_its_steps_after_the_warmup_as_total_samples_over_total_seconds(tmp_path):
    model = link_models.LinkModel("trm", {"training": {"steps": 8, "global_batch_size": 64}}, warmup=2, description="")
    # Rounds of 3 steps: two inner steps of 0.5 s, one with the exchange of 2 s; the warm-up steps are slower still.
    seconds = {1: 10.0, 2: 10.0, 3: 0.5, 4: 0.5, 5: 2.0, 6: 0.5, 7: 0.5, 8: 2.0}

    def workers(step):
        return [{"compute_s": 0.5, "sync_s": seconds[step] - 0.5}, {"compute_s": 0.4, "sync_s": seconds[step] - 0.4}]

    run = fake_run(tmp_path, 8, lambda s: 64 / seconds[s], workers)
    got = link_runs.read_run(run, model)
    assert got["samples_per_sec"] == pytest.approx(6 * 64 / 6.0)  # not the median step's 128
    # The slowest worker's sync over its step, summed: (0 + 0 + 1.5) x 2 / 6.0.
    assert got["sync_share"] == pytest.approx(3.0 / 6.0) and got["sync_share_from"] == "worker rows"
    assert got["quality"] == 0.5 and got["workers"] == 2 and got["timed_steps"] == 6 and got["chosen"] == ""


@pytest.mark.parametrize("share", [0.25, {"run": 0.25, "workers": [0.2, 0.3]}])
def test_the_summary_s_sync_share_and_choice_win(tmp_path, share):
    model = link_models.LinkModel("lm", {"training": {"steps": 4, "global_batch_size": 8}}, warmup=2, description="")
    summary = {"sync_share": share, "sync_mode": "local", "sync_every": 16, "eval_bits_per_byte": 3.5}
    got = link_runs.read_run(fake_run(tmp_path, 4, lambda s: 4.0, summary=summary), model)
    assert got["sync_share"] == 0.25 and got["sync_share_from"] == "summary"
    assert got["chosen"] == "local H=16" and got["quality"] == 3.5
    summary["sync_overlap"] = 2  # the round's sum travelled behind 2 steps
    got = link_runs.read_run(fake_run(tmp_path / "behind", 4, lambda s: 4.0, summary=summary), model)
    assert got["chosen"] == "local H=16 behind 2"
    summary["sync_choices"] = [{"step": 3, "mode": "exact"}, {"step": 28, "mode": "local"}]  # chosen again on drift
    got = link_runs.read_run(fake_run(tmp_path / "again", 4, lambda s: 4.0, summary=summary), model)
    assert got["chosen"] == "local H=16 behind 2 from step 28 (before: exact)"


def run(rate, mode, r, rate_s, quality, share=0.1, error=""):
    return link_runs.LinkRun("trm", rate, mode, r, 100.0, 1.0, rate_s, share, "summary", quality, error=error)


def test_rows_are_medians_over_rounds_against_the_unshaped_exact_row():
    runs = [
        run("unshaped", "exact", 0, 30.0, 0.50),
        run("unshaped", "exact", 1, 28.0, 0.52),
        run("unshaped", "exact", 2, 29.0, 0.51),
        run("20mbit", "exact", 0, 12.0, 0.51),
        run("20mbit", "local", 0, 27.0, 0.49),
        run("20mbit", "local", 1, 0.0, None, error="exited 1"),
    ]
    rows = {(r.rate, r.mode): r for r in link_runs.rows_of(runs)}
    assert rows["unshaped", "exact"].samples_per_sec == 29.0 and rows["unshaped", "exact"].ratio == 1.0
    assert rows["20mbit", "exact"].ratio == pytest.approx(12 / 29)
    local = rows["20mbit", "local"]
    assert local.samples_per_sec == 27.0 and local.runs == 2 and local.failed == 1
    assert local.quality_delta == pytest.approx(0.49 - 0.51)
    table = link_runs.format_rows(
        list(rows.values()),
        [{"name": "trm", "description": "TRM", "parameters": 1, "steps": 2, "samples": 128, "warmup": 1}],
    )
    assert "2, 1 failed" in table and "0.414" in table and "cell acc 0.4900" in table


def test_the_link_part_is_refused_in_one_line_where_hosts_cannot_be_made(monkeypatch, capsys):
    monkeypatch.setattr(link, "cannot_make_hosts", lambda: "making network namespaces needs root")
    assert main(["distributed", "--parts", "link"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [
        "benchmarks: error: --parts link builds two hosts from network namespaces, which it cannot here: making "
        "network namespaces needs root"
    ]


def test_hflora_is_over_100m_parameters_and_a_sync_sums_its_adapters_alone():
    layout = link_lora.Layout()
    assert layout.parameters() == 110_119_680  # the 12 layers of hidden 768 and the untied 16384-token head
    trained = link_lora.lora_parameters(layout, rank=8)
    assert trained == 12 * 2 * (8 * 768 + 768 * 8)  # q_proj and v_proj of each layer: A and B
    assert trained * 4 == 1_179_648  # fp32: 1.2 MB a sync, 0.27% of the model's bytes
    assert link_lora.lora_parameters(layout, 16, ("q_proj", "k_proj", "v_proj", "o_proj")) == 4 * trained
    with pytest.raises(ValueError, match=r"attention's projections only, not \['gate_proj'\]"):
        link_lora.lora_parameters(layout, 8, ("q_proj", "gate_proj"))


def test_model_sizes_count_what_trains_in_its_own_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3, bias=False))
    model[0].requires_grad_(False)
    model[1].to(torch.bfloat16)
    assert link_lora.model_sizes(model) == {"parameters": 10 * 20 + 20 + 60, "trainable": 60, "sync_bytes": 120}


def test_a_chosen_mode_is_read_with_its_reason_and_bytes_and_logged_for_auto_runs(tmp_path):
    model = link_models.LinkModel("hflora", {"training": {"steps": 4, "global_batch_size": 8}}, 2, "")
    why = "link 19.0 Mbit/s and 1.00 ms a sum, ...; local rounds of H=5, the exchange behind 1 step(s) wait 0.4%"
    choices = [{"event": "sync-choice", "mode": "local", "model_mb": 1.18}, {"mode": "local", "model_mb": 1.179648}]
    summary = {"sync_mode": "local", "sync_every": 5, "sync_overlap": 1, "sync_reason": why, "eval_loss": 9.5}
    got = link_runs.read_run(fake_run(tmp_path, 4, lambda s: 2.0, summary={**summary, "sync_choices": choices}), model)
    assert got["chosen"] == "local H=5 behind 1" and got["reason"] == why and got["sync_mb"] == 1.179648
    assert got["quality"] == 9.5  # the hf LM's held-out loss
    figures = {k: got[k] for k in ("samples_per_sec", "sync_share", "quality", "chosen", "reason")}
    auto = link_runs.LinkRun("hflora", "20mbit", "auto", 0, 19.0, 1.0, **figures)
    assert link_runs.run_line(auto).endswith(f"; chose local H=5 behind 1: {why}")
    exact = link_runs.LinkRun("hflora", "20mbit", "exact", 0, 19.0, 1.0, 2.0, 0.2, "summary", 9.5, "exact", "set")
    assert "chose" not in link_runs.run_line(exact)


def test_the_table_gives_a_lora_model_s_trainable_parameters_and_sync_bytes_in_aligned_columns():
    runs = [
        link_runs.LinkRun("trm", "unshaped", "exact", 0, 900.0, 1.0, 30.0, 0.02, "summary", 0.5),
        link_runs.LinkRun("hflora", "unshaped", "exact", 0, 900.0, 1.0, 2.0, 0.01, "summary", 9.6),
        link_runs.LinkRun("hflora", "20mbit", "auto", 0, 19.0, 1.0, 1.9, 0.02, "summary", 9.62, "local H=5"),
    ]
    models = [
        {"name": "trm", "description": "TRM", "parameters": 10, "trainable": 10, "sync_bytes": 40},
        {"name": "hflora", "description": "LM", "parameters": 110_414_592, "trainable": 294_912},
    ]
    for m in models:
        m.update(steps=20, samples=160, warmup=3)
    models[1]["sync_bytes"] = 1_179_648
    lines = link_runs.format_rows(link_runs.rows_of(runs), models).splitlines()
    assert lines[0] == "trm: TRM, 10 parameters, 0.00 MB summed a sync, 20 steps (160 samples), timed after step 3"
    assert lines[1].startswith("hflora: LM, 110,414,592 parameters (294,912 trainable), 1.18 MB summed a sync, 20")
    assert lines[2].startswith("model  link ") and lines[3].startswith("trm    unshaped ")
    assert lines[5].startswith("hflora 20mbit    auto ") and "loss 9.6200" in lines[5] and "+0.0200" in lines[5]
    assert lines[2].index("link") == lines[3].index("unshaped") == lines[5].index("20mbit") == len("hflora ")


@pytest.mark.slow
def test_hflora_s_experiment_builds_its_base_once_and_trains_with_lora_alone(tmp_path, monkeypatch):
    """A tiny layout of the hflora model on a small records file: the directory the bench builds loads as the hf
    family's model, its count is Layout's, only LoRA trains, and two steps of its experiment run in one process."""
    pytest.importorskip("peft")
    import numpy as np

    from raytrm.cli import main as raytrm_main
    from tests.support.hf_models import WORDS

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("RAYTRM_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    records = tmp_path / "docstrings" / "records.csv"
    records.parent.mkdir()
    lines = ["text,label", *(f"{' '.join(rng.choice(WORDS, 40))},x" for _ in range(200))]
    records.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr("benchmarks.hf_corpus.build_corpus", lambda out_dir: records)
    layout = link_lora.Layout(hidden=32, layers=2, heads=2, intermediate=64, vocab=300, positions=64)
    model = link_models.hflora_model(tmp_path, steps=2, seq_len=16, batch=4, layout=layout)
    base = tmp_path / "hflora-base"
    assert model.name == "hflora" and model.experiment["model"]["path"] == str(base)
    weights = next(base.glob("*.safetensors"))
    built = weights.stat().st_mtime_ns
    assert link_models.hflora_model(tmp_path, layout=layout).steps == 20  # the same recipe: reused, not rebuilt
    assert weights.stat().st_mtime_ns == built

    sizes = link_models.sizes(model, tmp_path)
    trained = link_lora.lora_parameters(layout, rank=8)
    assert sizes == {"parameters": layout.parameters() + trained, "trainable": trained, "sync_bytes": 4 * trained}

    config = tmp_path / "hflora.yaml"
    cfg.write_yaml(cfg.from_dict(cfg.ExperimentConfig, model.experiment, "the hflora model"), config)
    assert raytrm_main(["train", "--config", str(config), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval_loss"] > 0  # QUALITY's field for hflora
    assert link_models.QUALITY["hflora"][0] in summary
