"""The hf family: a user's transformers classifier or language model, whole or with LoRA, trained by the one Trainer.
The cut of a global batch and the padding never change the gradient, resume is exact (with LoRA the checkpoint holds
the adapters and the head only), the run leaves a model directory transformers serves, and each wrong input is one
line. The records come from a stand-in of raytrm.data.hf_records (tests/unit/families/hf_stand_in.py)."""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from raytrm import config as cfg
from raytrm.data.loader import batch_indices
from raytrm.errors import ConfigError, UserError
from raytrm.families import family
from raytrm.families.hf import HFTask, compiled_regions
from raytrm.families.hf_model import MAC_ENVIRONMENT, TOKENIZER_FILES, prepare_environment, save_model_dir
from raytrm.families.task import macro_f1
from raytrm.train import checkpoint as ckpt
from raytrm.train import side_by_side
from raytrm.train.compile import compile_regions, plan_compile
from raytrm.train.run.metrics import read_metrics
from raytrm.train.run.size_rule import size_rule
from raytrm.train.run.training import run_training
from raytrm.train.trainer import Trainer
from tests.support.resume import assert_same_run
from tests.unit.families import hf_stand_in


def grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None}


def packed_slices(lengths: list[int], budget: int) -> list[slice]:
    """Reference: the records in order, a micro-batch closed where one more record would pad it past `budget` tokens
    (its records x its longest)."""
    parts, start, longest = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i + 1 - start) * max(longest, n) > budget:
            parts.append(slice(start, i))
            start, longest = i, 0
        longest = max(longest, n)
    return [*parts, slice(start, len(lengths))]


def packed_widths(lengths: list[int], budget: int) -> list[int]:
    """The width each of packed_slices' micro-batches runs at: its longest record."""
    return [max(lengths[part]) for part in packed_slices(lengths, budget)]


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and "fix" in text, text
    return text


# -- the family and its defaults ------------------------------------------------------------------------------------


def test_the_family_registers_its_data_defaults_and_learning_rate(hf_dirs, tmp_path):
    hf = family("hf")
    assert hf.data_kinds == ("records",) and hf.finish is not None
    assert family("trm").finish is None and family("transformer").finish is None
    with pytest.raises(ConfigError, match=r"model\.path.*--model-path"):
        cfg.from_dict(cfg.ExperimentConfig, hf.embedded_default)
    given = {**hf.embedded_default, "model": {**hf.embedded_default["model"], "path": str(hf_dirs["classify"])}}
    config = cfg.from_dict(cfg.ExperimentConfig, given)
    assert (config.training.lr, config.training.dataloader_workers, config.model.lora_rank) == (2e-5, 0, None)
    # The size rule leaves a model the user brings at the anchor's lr, whatever its width.
    for width in (32, 768, 4096):
        assert size_rule(cfg.ModelConfig(name="hf", path="x", hidden_size=width))[0] == 2e-5


def test_the_macos_settings_are_raytrms(hf_config, monkeypatch, caplog, tmp_path):
    env: dict[str, str] = {}
    assert prepare_environment("darwin", env) == MAC_ENVIRONMENT
    assert env == {"PYTORCH_ENABLE_MPS_FALLBACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    mine = {"TOKENIZERS_PARALLELISM": "true"}
    assert prepare_environment("darwin", mine) == {"PYTORCH_ENABLE_MPS_FALLBACK": "1"}
    assert mine["TOKENIZERS_PARALLELISM"] == "true"  # the user's own setting stays
    linux: dict[str, str] = {}
    assert prepare_environment("linux", linux) == {} and linux == {}

    # Loader workers: 0 on a Mac, from the embedded default; asked for by hand, the run says why not.
    from raytrm.hardware import probe
    from raytrm.train.run.experiment import resolve_experiment
    from tests.unit.hardware.test_mac_tiers import MACS, mac_runner, no_device

    sysctl, profiler = MACS["m1-pro-mbp"][:2]
    mac = probe.detect(platform="darwin", mac_run=mac_runner(sysctl, profiler), device_facts=no_device)
    monkeypatch.setattr(probe, "detect", lambda: mac)
    records = tmp_path / "r.jsonl"
    records.write_text('{"text": "the cat", "label": "neg"}\n')
    config = hf_config()
    overrides = {"model": {"name": "hf", "path": config.model.path}, "data": {"path": str(records)}}
    resolved, _ = resolve_experiment(config_file=None, profile_file=None, out=None, resume=False, overrides=overrides)
    assert (resolved.training.dataloader_workers, resolved.training.threads) == (0, 8)
    with caplog.at_level(logging.WARNING, logger="raytrm.families.hf"):
        HFTask(hf_config(dataloader_workers=2), torch.device("cpu"), torch.float32, torch.float64, platform="darwin")
    assert "dataloader_workers 2 on macOS" in caplog.text and "set it to 0" in caplog.text
    caplog.clear()
    HFTask(hf_config(dataloader_workers=2), torch.device("cpu"), torch.float32, torch.float64, platform="linux")
    assert "macOS" not in caplog.text


# -- exactness ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("task", "accumulation", "lora"), [("classify", 4, None), ("classify", 16, 4), ("lm", 4, 4)])
def test_the_cut_and_the_padding_leave_the_gradient_unchanged(hf_config, task, accumulation, lora):
    """1 micro-batch against a classifier's micro-batches of 4 records at max length (4 x 48 padded tokens, short
    records packed more to one) and of one record each (no padding at all), and a language model's 4 windows: the
    same gradient."""
    whole = Trainer(hf_config(task, {"lora_rank": lora}, still=True, grad_accum_steps=1))
    parts = Trainer(hf_config(task, {"lora_rank": lora}, still=True, grad_accum_steps=accumulation))
    if task == "classify":
        assert (parts.cut.unit, parts.micro_batch) == ("tokens", 48 * 16 // accumulation)
        if accumulation == 16:
            parts.set_micro_batch(1)  # a budget under any two records: each alone
    widths: list[int] = []
    real = parts.model.forward

    def watched(*args, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        return real(*args, **kwargs)

    parts.model.forward = watched
    for step in range(3):
        indices = batch_indices(len(whole.train_data), 16, 3, step)
        batch = {k: torch.from_numpy(v) for k, v in whole.train_data.batch(indices).items()}
        widths.clear()
        loss_a, metrics_a = whole.forward_backward(batch)
        loss_b, metrics_b = parts.forward_backward(batch)
        if task == "classify":
            lengths = batch["lengths"].tolist()
            assert max(lengths) >= 4 * min(lengths)  # records of very different lengths share the batch
            # Each micro-batch runs at its own longest record, not the batch's, holding as many records as fit.
            assert widths == packed_widths(lengths, parts.micro_batch)
            assert len(widths) == 16 if accumulation == 16 else 1 < len(widths) < accumulation
        else:
            assert widths == [16] * accumulation
        assert loss_a == pytest.approx(loss_b, rel=1e-5)
        assert metrics_a == pytest.approx(metrics_b, rel=1e-5)
        ga, gb = grads(whole), grads(parts)
        assert ga.keys() == gb.keys() and ga
        # Against the largest gradient's scale: attention's key bias moves no softmax, and its gradient is rounding.
        scale = max(float(g.abs().max()) for g in ga.values())
        for key in ga:
            torch.testing.assert_close(ga[key], gb[key], rtol=1e-4, atol=1e-6 * scale, msg=key)
        whole.optimizer_step()
        parts.optimizer_step()


@pytest.mark.parametrize("lora", [None, 4])
def test_on_cuda_the_whole_forward_is_compiled_and_nowhere_else(hf_config, lora):
    """The family names the model's forward for CUDA's plan only; through the compiled region (a stand-in compiler
    here) the model's logits and its gradient path are the eager model's."""
    assert compiled_regions("cuda") == ("forward",)
    assert compiled_regions("cpu") == compiled_regions("mps") == ()
    trainer = Trainer(hf_config("classify", {"lora_rank": lora}, still=True))
    model = trainer.model
    assert trainer.compiled == [] and model.compile_regions == ()
    ids = torch.randint(5, 50, (3, 7))
    mask = torch.ones_like(ids)
    expected = model(input_ids=ids, attention_mask=mask).logits
    calls: list[dict] = []

    def stand_in(fn, **kwargs):
        def run(*args, **inner):
            calls.append(inner)
            return fn(*args, **inner)

        return run

    model.compile_regions = compiled_regions("cuda")
    assert compile_regions(model, plan_compile("auto", "cuda"), compiler=stand_in) == ["forward"]
    got = model(input_ids=ids, attention_mask=mask).logits
    assert len(calls) == 1 and calls[0]["input_ids"] is ids
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    assert any(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.skipif(
    not side_by_side.available(torch.device("cpu"), compiled=False), reason="needs OpenMP and MKL (per-thread counts)"
)
def test_a_cpus_threads_share_a_classifiers_records_by_their_tokens(hf_config):
    """One micro-batch on two threads side by side: each thread's share is cut to its own longest record where the
    padded tokens are most even (not at half the records, which leaves one thread the long ones), and the gradient
    is the one micro-batch's."""
    alone = Trainer(hf_config(still=True, threads=1))
    side = Trainer(hf_config(still=True, threads=2))
    shapes: list[tuple[int, int]] = []
    side.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    uneven = 0
    try:
        for step in range(3):
            shapes.clear()
            lengths, loss_a, loss_b = _one_step_each(alone, side, step)
            shares = side_by_side.balanced_shares(lengths, 2)
            assert sorted(shapes) == sorted((s.stop - s.start, lengths[s.start]) for s in shares)
            by_count = max(side_by_side.padded_cost(lengths, s) for s in (slice(0, 8), slice(8, 16)))
            uneven += max(side_by_side.padded_cost(lengths, s) for s in shares) < by_count
            _assert_same_step(alone, side, loss_a, loss_b)
    finally:
        side.close()
        alone.close()
    assert uneven  # the stand-in's records are of very different lengths: halves by count would wait on the long


def _one_step_each(alone: Trainer, side: Trainer, step: int) -> tuple[list[int], float, float]:
    """The same global batch through a one-thread Trainer and a two-thread one: its records' lengths, both losses."""
    indices = batch_indices(len(alone.train_data), 16, 3, step)
    batch = {k: torch.from_numpy(v) for k, v in alone.train_data.batch(indices).items()}
    torch.set_num_threads(1)
    loss_a, _ = alone.forward_backward(batch)
    torch.set_num_threads(2)
    loss_b, _ = side.forward_backward(batch)
    return batch["lengths"].tolist(), loss_a, loss_b


def _assert_same_step(alone: Trainer, side: Trainer, loss_a: float, loss_b: float) -> None:
    """Both took the same loss and gradient (to fp32 rounding); then both step."""
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    ga, gb = grads(alone), grads(side)
    scale = max(float(g.abs().max()) for g in ga.values())
    for key in ga:
        torch.testing.assert_close(ga[key], gb[key], rtol=1e-4, atol=1e-6 * scale, msg=key)
    alone.optimizer_step()
    side.optimizer_step()


@pytest.mark.skipif(
    not side_by_side.available(torch.device("cpu"), compiled=False), reason="needs OpenMP and MKL (per-thread counts)"
)
def test_a_token_cut_on_two_threads_runs_each_micro_batch_split_within_its_budget(hf_config):
    """Micro-batches of 2 records at max length (96 padded tokens) on two threads: each micro-batch of the token cut
    runs as one round, split where its padded tokens are most even, so what runs at once never pads past 96 tokens;
    the gradient is the one micro-batch's."""
    from raytrm.train.micro_batches import token_parts

    alone = Trainer(hf_config(still=True, threads=1))
    side = Trainer(hf_config(still=True, threads=2, grad_accum_steps=8))
    assert (side.cut.unit, side.micro_batch) == ("tokens", 96)
    shapes: list[tuple[int, int]] = []
    side.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        for step in range(3):
            shapes.clear()
            lengths, loss_a, loss_b = _one_step_each(alone, side, step)
            parts, expected, in_flight = packed_slices(lengths, 96), [], 0
            for part in parts:
                shares = side_by_side.balanced_shares(lengths[part], min(2, part.stop - part.start))
                expected += [(s.stop - s.start, lengths[part][s.start]) for s in shares]
                in_flight = max(in_flight, sum((s.stop - s.start) * lengths[part][s.start] for s in shares))
            assert token_parts(lengths, 96) == parts and 1 < len(parts) < 8  # fewer than 8 of 2 records: packed
            assert sorted(shapes) == sorted(expected) and len(shapes) > len(parts)  # some rounds split in two
            assert side.cut.in_flight == in_flight <= 96
            _assert_same_step(alone, side, loss_a, loss_b)
    finally:
        side.close()
        alone.close()


def test_a_batch_at_its_widest_runs_every_record_at_max_length_with_the_same_gradient(hf_config):
    """The memory governor fits its steps' peaks on batches at their widest: the records padded to model.seq_len
    cost what the longest possible records would, and the padding is masked, so the step learns the same."""
    plain, wide = Trainer(hf_config(still=True)), Trainer(hf_config(still=True))
    widths: list[int] = []
    wide.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    wide.widest = True
    try:
        indices = batch_indices(len(plain.train_data), 16, 3, 0)
        batch = {k: torch.from_numpy(v) for k, v in plain.train_data.batch(indices).items()}
        assert batch["input_ids"].shape[1] < 48  # the stand-in's records are shorter than max length
        loss_plain, _ = plain.forward_backward(batch)
        loss_wide, _ = wide.forward_backward(batch)
        assert widths and set(widths) == {48}  # every micro-batch at model.seq_len
        assert loss_wide == pytest.approx(loss_plain, rel=1e-5)
        ga, gb = grads(plain), grads(wide)
        scale = max(float(g.abs().max()) for g in ga.values())
        for key in ga:
            torch.testing.assert_close(gb[key], ga[key], rtol=1e-4, atol=1e-6 * scale, msg=key)
    finally:
        plain.close(), wide.close()


def test_a_memory_budget_runs_the_steps_it_fits_on_at_their_widest_and_the_others_as_drawn(hf_config):
    from raytrm.train.loop import Hook, Loop
    from raytrm.train.run.memory_budget import MemoryBudget
    from raytrm.train.run.stop_rules import StepLimit

    trainer = Trainer(hf_config(steps=10, memory_budget_mb=16384, threads=1))
    widths: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    budget = MemoryBudget.adapting(trainer)
    steps: list[tuple[bool, bool, list[int]]] = []  # (the governor measures it, run at its widest, its widths)

    class Watch(Hook):
        def before_step(self, loop: Loop) -> None:
            self.flags = (budget.governor.measuring, trainer.widest)
            widths.clear()

        def end_step(self, loop: Loop, step: Any) -> list:
            steps.append((*self.flags, list(widths)))
            return []

    try:
        Loop(trainer, [budget, Watch(), StepLimit(10)]).run()
    finally:
        trainer.close()
    assert all(measuring == wide for measuring, wide, _ in steps)  # the fitted steps, and only those, at their widest
    assert any(wide for _, wide, _ in steps) and not steps[-1][1]  # probed and approached, then settled
    assert all(set(w) == {48} for _, wide, w in steps if wide)  # every micro-batch of a fitted step at max length
    assert all(max(w) < 48 for _, wide, w in steps if not wide)  # the others cut to their own longest record


def test_a_budget_cuts_a_classifier_in_padded_tokens_fitted_on_records_at_max_length(hf_config, monkeypatch):
    """The governor counts a classifier's cut in padded tokens: its probes are whole records at max length (48), its
    points the tokens a step had in flight, and the cut its fit chooses packs more of the real, shorter records into
    a micro-batch than fit at max length. Peaks are scripted (1000 MiB + 0.5 MiB a token in flight), so the choice is
    exact: (0.9 x 1340 - 1000) / 0.5 = 412 tokens, 8 records at max length. A step that peaks above that line but
    under the high-water mark (as the heap's history can make one) has the heap given back before the next step."""
    from raytrm.train import loop as loop_module
    from raytrm.train.loop import Hook, Loop
    from raytrm.train.run.memory_budget import MemoryBudget
    from raytrm.train.run.stop_rules import StepLimit

    trainer = Trainer(hf_config(steps=10, memory_budget_mb=1340, threads=1))
    budget = MemoryBudget.adapting(trainer)
    assert budget is not None and budget.governor.unit == "tokens"
    shapes: list[tuple[int, int]] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    steps: list[tuple[bool, int, int, list[tuple[int, int]]]] = []  # (widest, cut, tokens in flight, shapes)

    class ScriptedPeak(Hook):
        def before_step(self, loop: Loop) -> None:
            shapes.clear()

        def after_step(self, loop: Loop, step: Any) -> None:
            crept = 1240 if trainer.step == 8 else 0  # over 0.9 x 1340 = 1206 MiB, under 0.95 x 1340 = 1273 MiB
            step.peak_bytes = int((crept or 1000 + 0.5 * trainer.cut.in_flight) * 2**20)
            steps.append((trainer.widest, trainer.micro_batch, trainer.cut.in_flight, list(shapes)))

    released: list[int] = []
    monkeypatch.setattr(loop_module, "trim_heap", lambda: released.append(trainer.step))
    try:
        Loop(trainer, [ScriptedPeak(), budget, StepLimit(10)], measure_peak=False).run()
    finally:
        trainer.close()
    governor = budget.governor
    assert [cut for _, cut, _, _ in steps[:3]] == [48, 96, 192]  # 1 (the warm-up), 2 and 4 records at max length
    assert all(size % 48 == 0 for wide, _, size, _ in steps if wide)  # the fitted steps: whole records in flight
    assert governor.fit is not None and governor.fit.per_sample_bytes == pytest.approx(0.5 * 2**20, rel=1e-3)
    assert trainer.micro_batch == governor.target == 412 and budget.summary()["micro_batch_unit"] == "tokens"
    settled = [shape for wide, cut, _, seen in steps if not wide and cut == 412 for shape in seen]
    assert settled and all(n * width <= 412 or n == 1 for n, width in settled)
    assert max(n for n, _ in settled) > 412 // 48  # short records: more to a micro-batch than at max length
    assert all(e["unit"] == "tokens" for e in governor.events)
    assert released == [8] and budget.summary()["heap_releases"] == 1 and trainer.micro_batch == 412


@pytest.mark.parametrize(
    ("task", "lora", "accumulation"), [("classify", None, 1), ("classify", 4, 1), ("lm", 4, 1), ("classify", None, 8)]
)
def test_resume_is_exact_and_a_lora_checkpoint_holds_what_trains(hf_config, tmp_path, task, lora, accumulation):
    """N steps and N more resumed are 2N steps bit for bit; with accumulation, a classifier's cut in padded tokens
    (2 records at max length) packs each step's records anew, and a resume cuts them as the straight run did."""
    # The models keep their dropout (0.1): an exact resume also needs torch's generator back.
    model = {"lora_rank": lora, "lora_dropout": 0.1 if lora else 0.0}
    config = lambda steps: hf_config(task, model, steps=steps, eval_interval=2, grad_accum_steps=accumulation)  # noqa: E731
    straight = run_training(config(4), tmp_path / "straight")
    run_training(config(2), tmp_path / "split")
    resumed = run_training(config(4), tmp_path / "split", resume=True)
    assert straight["micro_batches"] == resumed["micro_batches"]
    if accumulation > 1:  # the last step's micro-batches: records packed into 96 padded tokens, more than 2 each
        assert sum(straight["micro_batches"]) == 16 and len(straight["micro_batches"]) < accumulation
    assert resumed["resumed_from_step"] == 2
    a, b = assert_same_run(tmp_path / "straight", tmp_path / "split")
    assert a["step"] == b["step"] == 4 and a["ema"] is not None
    scores = [k for k in straight if k.startswith("eval_")]
    assert scores and all(straight[k] == resumed[k] for k in scores)
    assert (tmp_path / "split" / "model" / "config.json").exists() and not (
        tmp_path / "split" / "model.partial"
    ).exists()
    trainer = Trainer(hf_config(task, model))
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    if lora:
        # The adapters and a classifier's head: every tensor that trains, and nothing else.
        assert set(a["model"]) == trainable
        assert all("lora_" in k or "modules_to_save" in k for k in a["model"])
        assert any("modules_to_save" in k for k in a["model"]) == (task == "classify")
        assert sum(v.numel() for v in a["model"].values()) < 0.2 * sum(p.numel() for p in trainer.model.parameters())
    else:
        assert set(a["model"]) == set(trainer.model.state_dict())


def test_the_forward_runs_in_the_trainers_dtype_over_fp32_weights_and_the_loss_in_fp32(hf_config):
    trainer = Trainer(hf_config(model={"lora_rank": 4}, dtype="bfloat16", ema=False))
    assert trainer.dtype == torch.bfloat16
    batch = {k: torch.from_numpy(v) for k, v in trainer.train_data.batch(np.arange(4)).items()}
    logits = trainer.task.forward(trainer.model, batch, slice(None), None)
    assert logits.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    step = trainer.task.begin_step(batch, 4, slice(0, 4))
    loss, sums = trainer.task.micro_step(batch, slice(0, 4), step)
    assert loss.dtype == sums["loss_sum"].dtype == torch.float32 and math.isfinite(float(loss))
    assert float(loss) == pytest.approx(float(sums["loss_sum"]) / 4)


def test_a_lora_checkpoint_holding_the_base_weights_too_is_refused_in_one_line(hf_config, tmp_path):
    run_training(hf_config(model={"lora_rank": 4}, steps=1), tmp_path / "run")
    state = ckpt.latest_good_checkpoint(tmp_path / "run" / "checkpoints")
    trainer = Trainer(hf_config(model={"lora_rank": 4}), tmp_path / "run")
    trainer.load_state_dict(state)  # what it saved fits
    base = "base_model.model.bert.embeddings.word_embeddings.weight"
    state["model"][base] = trainer.model.state_dict()[base]
    with pytest.raises(
        UserError, match=rf"model\.{base} holds a tensor of shape .*, this config builds no such tensor"
    ):
        trainer.load_state_dict(state)


# -- LoRA -------------------------------------------------------------------------------------------------------------


def test_lora_starts_as_the_base_model_and_trains_only_its_adapters_and_head(hf_config, hf_dirs):
    from transformers import AutoModelForSequenceClassification

    trainer = Trainer(hf_config(model={"lora_rank": 4, "lora_alpha": 8}, still=True, ema=False))
    base = AutoModelForSequenceClassification.from_pretrained(hf_dirs["classify-still"]).eval()
    batch = {k: torch.from_numpy(v) for k, v in trainer.test_data.batch(np.arange(8)).items()}
    trainer.model.eval()
    with torch.no_grad():
        lora = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        plain = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(lora, plain)  # B starts at zero: the adapters add exactly nothing
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert any("lora_A" in n for n in trainable) and any("classifier.modules_to_save" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.model.train()
    trainer.train_step()
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], value) for n, value in frozen.items())
    assert any(float(after[n].abs().max()) > 0 for n in trainable if "lora_B" in n)


def test_a_classifier_of_other_labels_gets_a_new_head_and_says_so(hf_config, caplog):
    from transformers.utils import logging as hf_logging

    said: list[str] = []
    heard = logging.Handler()
    heard.emit = lambda record: said.append(record.getMessage())  # what transformers' own logger lets through
    logging.getLogger("transformers").addHandler(heard)
    opener = hf_stand_in.opener(("neg", "pos", "meh"), relabel=lambda i, label: "meh" if i % 4 == 0 else label)
    try:
        with caplog.at_level(logging.INFO, logger="raytrm.families.hf_model"):
            trainer = Trainer(hf_config(opener=opener))
    finally:
        logging.getLogger("transformers").removeHandler(heard)
    assert "head has 2 outputs, the data 3 labels (neg, pos, meh): a new head" in caplog.text
    # said once, in raytrm's line: transformers' own report of the new head and its progress bars stay off, and its
    # settings are the user's again afterwards
    assert not [line for line in said if "LOAD REPORT" in line], said
    assert hf_logging.get_verbosity() == hf_logging.WARNING and hf_logging.is_progress_bar_enabled()
    assert trainer.model.config.id2label == {0: "neg", 1: "pos", 2: "meh"}
    assert trainer.model.classifier.weight.shape == (3, 32)
    assert trainer.train_step().metrics["ce_loss"] > 0


# -- the model directory --------------------------------------------------------------------------------------------


def test_the_run_leaves_a_model_directory_that_transformers_loads_and_serves(hf_config, tmp_path):
    from transformers import AutoModelForSequenceClassification, pipeline

    trainer = Trainer(hf_config(model={"lora_rank": 4}, ema=False, lr=1e-2))
    for _ in range(3):
        trainer.train_step()
    family("hf").finish(trainer.task, tmp_path)
    out = tmp_path / "model"
    assert not (out / "adapter_config.json").exists() and (out / "config.json").exists()  # merged by default
    assert {p.name for p in out.iterdir()} & set(TOKENIZER_FILES)
    loaded = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert loaded.config.id2label == {0: "neg", 1: "pos"}
    batch = {k: torch.from_numpy(v) for k, v in trainer.test_data.batch(np.arange(16)).items()}
    trainer.model.eval()
    with torch.no_grad():
        trained = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        merged = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(merged, trained, rtol=1e-5, atol=1e-6)
    # The adapters moved the model away from its start, so the merged weights are the trained ones, not the base's.
    assert any("lora_B" in n and float(p.abs().max()) > 0 for n, p in trainer.model.named_parameters())
    serve = pipeline("text-classification", model=str(out), tokenizer=str(out), device="cpu")
    answer = serve("the warm sun sat on a mat")[0]
    assert answer["label"] in {"neg", "pos"}
    encoded = trainer.task.tokenizer("the warm sun sat on a mat", return_tensors="pt")
    with torch.no_grad():
        probs = loaded(**encoded).logits.softmax(-1)[0]
    assert answer["score"] == pytest.approx(float(probs.max()), rel=1e-5)
    assert answer["label"] == loaded.config.id2label[int(probs.argmax())]
    # Unmerged, the directory holds the adapters, which transformers loads onto model.path's weights.
    adapters = save_model_dir(trainer.model, trainer.task.tokenizer, tmp_path / "adapters", merge=False)
    assert (adapters / "adapter_config.json").exists() and not (adapters / "model.safetensors").exists()
    with torch.no_grad():
        again = AutoModelForSequenceClassification.from_pretrained(adapters).eval()
        logits = again(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(logits, trained, rtol=1e-5, atol=1e-6)


def test_the_run_writes_the_weights_its_final_evaluation_scored(hf_config, tmp_path):
    from transformers import AutoModelForSequenceClassification

    run_training(hf_config(steps=3, ema=True), tmp_path / "run")
    state = ckpt.latest_good_checkpoint(tmp_path / "run" / "checkpoints")
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "model")
    weights = dict(loaded.named_parameters())
    for name, shadow in state["ema"]["shadow"].items():
        assert torch.equal(weights[name].detach(), shadow), name
    assert not torch.equal(state["model"]["classifier.weight"], state["ema"]["shadow"]["classifier.weight"])


# -- evaluation -----------------------------------------------------------------------------------------------------


def test_the_classifier_scores_the_held_out_records_and_its_confusion(hf_config):
    trainer = Trainer(hf_config(ema=False, lr=3e-3))
    for _ in range(5):
        trainer.train_step()
    scores = trainer.evaluate()
    # Each held-out record alone, unpadded: the predictions the scores must come from.
    data, model = trainer.test_data, trainer.model.eval()
    pred, true = [], []
    with torch.no_grad():
        for i in range(len(data)):
            ids = torch.tensor([data.ids[i]])
            pred.append(int(model(input_ids=ids).logits.argmax(-1)))
            true.append(int(data.labels[i]))
    pred_a, true_a = np.array(pred), np.array(true)
    confusion = [[int(((true_a == t) & (pred_a == p)).sum()) for p in range(2)] for t in range(2)]
    majority = int(np.bincount(trainer.train_data.labels).argmax())
    assert scores["eval_confusion"] == confusion and scores["eval_labels"] == ["neg", "pos"]
    assert scores["eval_accuracy"] == pytest.approx(float((pred_a == true_a).mean()))
    assert scores["eval_macro_f1"] == pytest.approx(macro_f1(pred_a, true_a, 2))
    assert scores["eval_majority_acc"] == pytest.approx(float((true_a == majority).mean()))
    assert scores["eval_documents"] == len(data) == 16


def test_the_language_model_scores_loss_and_perplexity_per_token(hf_config):
    trainer = Trainer(hf_config("lm", ema=False))
    result = trainer.train_step()
    assert result.metrics["perplexity"] == pytest.approx(math.exp(result.metrics["lm_loss"]))
    assert trainer.tokens_per_sample == 16
    scores = trainer.evaluate()
    data, model = trainer.test_data, trainer.model.eval()
    batch = data.batch(np.arange(len(data)))
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(batch["input_ids"])).logits
    labels = torch.from_numpy(batch["labels"])
    nats = float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
    assert scores["eval_tokens"] == labels.numel() == len(data) * 16
    assert scores["eval_loss"] == pytest.approx(nats / labels.numel(), rel=1e-5)
    assert scores["eval_perplexity"] == pytest.approx(math.exp(scores["eval_loss"]))


def test_a_tuners_quality_is_macro_f1_for_a_classifier_and_the_probability_of_the_right_token_for_a_model(hf_config):
    from raytrm.train.run.evaluations import evaluate_quality

    lm = Trainer(hf_config("lm", ema=False))
    measured = evaluate_quality(lm, None, "")
    assert measured["quality"] == pytest.approx(math.exp(-measured["eval"]["eval_loss"]))
    assert measured["quality_stderr"] is None
    classifier = Trainer(hf_config("classify", ema=False))
    measured = evaluate_quality(classifier, None, "")
    assert measured["quality"] == measured["eval"]["eval_macro_f1"]
    assert evaluate_quality(classifier, None, "eval_accuracy")["quality"] == measured["eval"]["eval_accuracy"]


def test_the_classifier_learns_its_records(hf_config, tmp_path):
    # 'pos' records hold the word 'sun', 'neg' ones do not: a word the tiny tokenizer knows, so a classifier that
    # reads its input gets nearly every held-out record right, where the majority class holds about 60% of them.
    opener = hf_stand_in.opener(count=256, held_out=64)
    config = hf_config(opener=opener, steps=80, lr=3e-3, ema=False, log_interval=20, eval_interval=40)
    summary = run_training(config, tmp_path / "run")
    assert summary["eval_documents"] == 64
    assert summary["eval_accuracy"] > summary["eval_majority_acc"] + 0.2
    # The final evaluation's confusion matrix and its axes reach summary.json; the rows of metrics.jsonl stay numbers.
    recorded = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert recorded["eval_labels"] == ["neg", "pos"]
    assert recorded["eval_confusion"] == summary["eval_confusion"] and np.sum(recorded["eval_confusion"]) == 64
    evaluated = [row for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval_accuracy" in row]
    assert [row["step"] for row in evaluated] == [40, 80]
    assert not [key for row in evaluated for key, value in row.items() if isinstance(value, (list, dict))]


# -- bad input: one line each -----------------------------------------------------------------------------------------


def test_a_path_that_does_not_exist_is_one_line(hf_config, tmp_path):
    with pytest.raises(ConfigError) as error:
        Trainer(hf_config(model={"path": str(tmp_path / "nowhere")}))
    assert f"{tmp_path / 'nowhere'}: model.path: got 'no such directory'" in one_line(error)


def test_a_hub_name_is_left_to_transformers_which_stays_offline(hf_config):
    with pytest.raises(UserError) as error:
        Trainer(hf_config(model={"path": "nobody-here/no-model"}))
    text = one_line(error)
    assert text.startswith("nobody-here/no-model: model.path is not a directory here") and "HF_HUB_OFFLINE" in text


def test_a_directory_without_a_tokenizer_is_one_line(hf_config, hf_dirs, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf_dirs["classify"] / name, bare / name)
    with pytest.raises(ConfigError) as error:
        Trainer(hf_config(model={"path": str(bare)}))
    text = one_line(error)
    assert "a directory of config.json, model.safetensors" in text and "tokenizer.save_pretrained(DIR)" in text


def test_a_model_the_task_cannot_serve_is_one_line(hf_config, hf_dirs, tmp_path):
    from transformers import ViTConfig

    # An encoder asked for a language model: transformers has a causal class for BERT, but its outputs see ahead.
    with pytest.raises(ConfigError) as error:
        Trainer(hf_config("lm", model={"path": str(hf_dirs["classify"])}))
    assert "model.task: got 'lm, for a bidirectional bert model', expected a causal language model" in one_line(error)
    # A model type with no sequence classifier (nor language model) at all.
    vision = tmp_path / "vision"
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(vision)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dirs["classify"] / name, vision / name)
    for task in ("classify", "lm"):
        with pytest.raises(ConfigError) as error:
            Trainer(hf_config(task, model={"path": str(vision)}))
        expected = f"model.task: got '{task}, for a vit model', expected a model type transformers builds"
        assert expected in one_line(error)


def test_more_tokens_than_the_model_has_positions_is_one_line(hf_config):
    with pytest.raises(ConfigError) as error:
        Trainer(hf_config(model={"seq_len": 256}))
    assert "model.seq_len: got 256, expected at most the 128 positions the model embeds" in one_line(error)


def test_lora_targets_the_model_lacks_are_one_line_naming_its_layers(hf_config):
    with pytest.raises(ConfigError) as error:
        Trainer(hf_config(model={"lora_rank": 4, "lora_targets": ["nope"]}))
    text = one_line(error)
    assert "model.lora_targets: got ['nope']" in text and "query" in text and "value" in text


def test_the_missing_extra_is_one_line_naming_it(hf_config, monkeypatch):
    config = hf_config()
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    with pytest.raises(UserError) as error:
        Trainer(config)
    assert 'peft is not installed; fix: pip install "raytrm[hf]"' in str(error.value)


def test_a_missing_records_file_is_one_line(tmp_path):
    require = family("hf").require_data
    with pytest.raises(ConfigError, match=r"data\.path: got None.*fix: give --data FILE"):
        require(cfg.DataConfig(name="records"))
    missing = str(tmp_path / "none.csv")
    with pytest.raises(ConfigError, match=r"none\.csv: data\.path: got 'no such file'"):
        require(cfg.DataConfig(name="records", path=missing))
    (tmp_path / "train.csv").write_text("text,label\nthe cat,neg\n")
    with pytest.raises(ConfigError, match=r"data\.validation_path: got 'no such file'"):
        require(cfg.DataConfig(name="records", path=str(tmp_path / "train.csv"), validation_path=missing))
