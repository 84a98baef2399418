"""The Trainer on the transformer: it learns (LM and classifier beat their baselines), accumulation changes how a
batch is cut but never the update, resume is exact, and the CLI prints the transformer's scores."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from raytrm import config as cfg
from raytrm.cli import main
from raytrm.train import checkpoint as ckpt
from raytrm.train.run.metrics import read_metrics
from raytrm.train.run.training import run_training
from raytrm.train.trainer import Trainer
from tests.support.resume import assert_same_run

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "log", "big", "small", "red", "quickly"]
WORDS += ["slowly", "and", "then"]


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYTRM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """A word-salad LM corpus (structure within words, none between them) and a labelled set whose label is
    written in which letters a document favours."""
    root = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(0)
    sentences = (" ".join(rng.choice(WORDS, rng.integers(4, 9))) + ".\n" for _ in range(2500))
    (root / "words.txt").write_text("".join(sentences))
    favoured = {"north": "aeiou", "south": "xyzqw", "east": "lmnrs"}
    labels = rng.choice(list(favoured), 300, p=[0.5, 0.3, 0.2])
    records = []
    for label in labels:
        letters = [
            rng.choice(list(favoured[label])) if rng.random() < 0.35 else chr(rng.integers(97, 123)) for _ in range(48)
        ]
        records.append({"text": "".join(letters), "label": str(label)})
    (root / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


@pytest.fixture
def small(corpora):
    def make(task: str = "lm", model: dict | None = None, **training) -> cfg.ExperimentConfig:
        path = corpora / ("words.txt" if task == "lm" else "docs.jsonl")
        data = {
            "model": {
                "name": "transformer",
                "task": task,
                "hidden_size": 48,
                "num_heads": 4,
                "layers": 2,
                "seq_len": 32,
                **(model or {}),
            },
            "data": {"name": "text", "path": str(path)},
            "training": {
                "global_batch_size": 32,
                "lr": 3e-3,
                "warmup_steps": 10,
                "weight_decay": 0.1,
                "threads": 1,
                "log_interval": 1,
                "seed": 3,
                # fp32 on the CPU unless a test asks for CUDA: the exactness these tests hold is fp32's (on a GPU the
                # step runs in bf16, and the embedding's backward adds its rows in no fixed order)
                "device": "cpu",
                **training,
            },
        }
        return cfg.from_dict(cfg.ExperimentConfig, data)

    return make


def grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("task", ["lm", "classify"])
def test_accumulation_gives_the_same_gradient(small, task):
    whole = Trainer(small(task, global_batch_size=32, grad_accum_steps=1))
    parts = Trainer(small(task, global_batch_size=32, grad_accum_steps=4))
    assert (whole.micro_batch, parts.micro_batch) == (32, 8)
    for _ in range(3):
        loss_a, metrics_a = whole.forward_backward()
        loss_b, metrics_b = parts.forward_backward()
        assert loss_a == pytest.approx(loss_b, rel=1e-5)
        assert metrics_a == pytest.approx(metrics_b, rel=1e-5)
        ga, gb = grads(whole), grads(parts)
        for key in ga:
            scale = float(ga[key].abs().max())
            torch.testing.assert_close(ga[key], gb[key], rtol=1e-4, atol=1e-5 * scale, msg=key)
        whole.optimizer_step()
        parts.optimizer_step()
    for (key, a), b in zip(whole.model.state_dict().items(), parts.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=3e-5, msg=key)  # Adam: at most ~lr per step from rounding


@pytest.mark.parametrize("task", ["lm", "classify"])
def test_resume_is_exact(small, tmp_path, task):
    # Dropout draws from torch's generator, so an exact resume also needs its state back.
    model = {"dropout": 0.1}
    straight = run_training(small(task, model, steps=6), tmp_path / "straight")
    run_training(small(task, model, steps=3), tmp_path / "split")
    resumed = run_training(small(task, model, steps=6), tmp_path / "split", resume=True)
    assert resumed["resumed_from_step"] == 3
    a, b = assert_same_run(tmp_path / "straight", tmp_path / "split")
    assert a["step"] == b["step"] == 6 and a["carry"] is None and a["ema"] is not None
    scores = [k for k in straight if k.startswith("eval_")]
    assert scores and all(straight[k] == resumed[k] for k in scores)


@pytest.mark.slow
def test_language_model_beats_the_unigram_baseline(small, tmp_path):
    # The word salad's unigram entropy is about 4.2 bits per byte; knowing its 17 words brings this model to about
    # 1.0 in 150 steps. A 1.5-bit margin is far above the noise: the held-out estimate covers ~3,500 bytes (its
    # standard error is a few hundredths of a bit) and the run is seeded, so it moves only with floating-point
    # differences between machines.
    summary = run_training(small("lm", steps=150, log_interval=10), tmp_path / "lm")
    assert summary["eval_bits_per_byte"] < summary["eval_unigram_bits_per_byte"] - 1.5
    assert summary["tokens_per_sec"] == pytest.approx(summary["samples_per_sec"] * 32)
    records = [r for r in read_metrics(tmp_path / "lm" / "metrics.jsonl") if "bits_per_byte" in r]
    assert records[-1]["bits_per_byte"] < records[0]["bits_per_byte"] - 1.0  # step 10 against step 150


@pytest.mark.slow
def test_classifier_beats_the_majority_class(small, tmp_path):
    # Documents favour their label's letters 35% of the time; the majority class holds half of them. Each of the 30
    # held-out documents is 48 letters, enough for the favoured letters to show: a trained classifier gets nearly
    # all right, and the 0.25 margin is more than 3 standard errors of a 30-document accuracy.
    summary = run_training(small("classify", steps=120, log_interval=40, lr=3e-3), tmp_path / "classify")
    assert summary["eval_documents"] == 30
    assert summary["eval_accuracy"] > summary["eval_majority_acc"] + 0.25
    assert summary["eval_macro_f1"] > 0.6


def test_the_cli_trains_a_transformer_and_prints_its_scores(corpora, tmp_path, capsys):
    flags = ["--hidden-size", "32", "--layers", "1", "--seq-len", "16", "--global-batch", "8", "--steps", "3"]
    code = main(
        [
            "train",
            "--model",
            "transformer",
            "--data",
            str(corpora / "words.txt"),
            *flags,
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "bits per byte" in out and "unigram" in out
    code = main(
        [
            "train",
            "--model",
            "transformer",
            "--task",
            "classify",
            "--data",
            str(corpora / "docs.jsonl"),
            *flags,
            "--quiet",
            "--out",
            str(tmp_path / "cls"),
        ]
    )
    assert code == 0
    assert "majority class" in capsys.readouterr().out


@pytest.mark.slow
def test_memory_adaptation_and_out_of_memory_redo_change_nothing_learned(small, tmp_path, fail_forward):
    from raytrm.hardware.pressure import MemoryReading
    from raytrm.models.transformer import Transformer
    from raytrm.train.memory.governor import GovernorSettings

    class ScriptedPressure:
        calls = 0

        def read(self, detailed: bool = False) -> MemoryReading:
            self.calls += 1
            return MemoryReading(pressure={2: "warn"}.get(self.calls))

    plain = run_training(small("lm", steps=7), tmp_path / "plain")
    # The allocator refuses two micro-batches: the 3rd forward (step 1, at the first probe's micro-batch 4) and the
    # 70th (step 4, after pressure shrank the cut and calm grew it).
    fail_forward(Transformer, at=(3, 70), message="MPS backend out of memory (scripted)")
    adapted = run_training(
        small("lm", steps=7, memory_budget_mb=20000),
        tmp_path / "adapted",
        memory_reader=ScriptedPressure(),
        governor_settings=GovernorSettings(grow_after=1),
    )
    kinds = [r["event"] for r in read_metrics(tmp_path / "adapted" / "metrics.jsonl") if "event" in r]
    assert kinds == ["out-of-memory", "shrink", "grow", "out-of-memory"], kinds
    assert adapted["samples_seen"] == plain["samples_seen"] == 7 * 32
    a = ckpt.latest_good_checkpoint(tmp_path / "plain" / "checkpoints")
    b = ckpt.latest_good_checkpoint(tmp_path / "adapted" / "checkpoints")
    for name, value in a["model"].items():  # Adam: rounding-level differences, on the scale of its step
        torch.testing.assert_close(b["model"][name], value, rtol=0, atol=1e-2 * 3e-3, msg=lambda m, k=name: f"{k}: {m}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_on_cuda_the_graphed_forward_trains_to_the_eager_numbers_within_bf16_noise(small, checkpointing):
    losses = {}
    for mode in ("off", "auto"):
        torch._dynamo.reset()
        # Two micro-batches a step: the second's replay must leave the first's accumulated gradients alone.
        config = small(model={"gradient_checkpointing": checkpointing}, device="cuda", compile=mode, grad_accum_steps=2)
        trainer = Trainer(config)
        try:
            assert trainer.dtype == torch.bfloat16 and len(trainer.slices()) == 2
            losses[mode] = [trainer.train_step().loss for _ in range(4)]
            if mode == "auto":
                assert trainer.compiled == ["forward"]
                region = trainer.model.forward.__wrapped__
                assert region.clone_outputs and region.failed is None  # recorded by CUDA graphs, and it ran
        finally:
            trainer.close()
    # bf16 rounds differently in fused kernels; the four steps' losses agree to bf16's ~3 significant digits.
    assert losses["auto"] == pytest.approx(losses["off"], rel=2e-2)
