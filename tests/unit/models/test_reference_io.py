"""Reference checkpoints: the exact key layout, a lossless round trip, and one-line errors for wrong files."""

from __future__ import annotations

import pytest
import torch

from raytrm.config import ModelConfig
from raytrm.errors import UserError
from raytrm.models import (
    TRM,
    from_reference_state_dict,
    load_reference_checkpoint,
    save_reference_checkpoint,
    to_reference_state_dict,
)

P = "_orig_mod.model.inner."
CONFIG = {"hidden_size": 32, "num_heads": 4, "L_layers": 2, "H_cycles": 1, "L_cycles": 1, "puzzle_emb_len": 2}


def model(variant="attention", pos="rope", puzzles=3, seed=0, **overrides) -> TRM:
    torch.manual_seed(seed)
    config = ModelConfig(variant=variant, pos_encodings=pos, **{**CONFIG, **overrides})
    return TRM(config, vocab_size=11, seq_len=5, num_puzzle_identifiers=puzzles)


def test_export_uses_the_reference_names():
    keys = set(to_reference_state_dict(model().state_dict()))
    block = [
        f"L_level.layers.{i}.{name}.weight"
        for i in range(2)
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    ]
    expected = [
        "H_init",
        "L_init",
        "embed_tokens.embedding_weight",
        "lm_head.weight",
        "q_head.weight",
        "q_head.bias",
        "puzzle_emb.weights",
        *block,
    ]
    assert keys == {P + k for k in expected}
    mlp_t = set(to_reference_state_dict(model("mlp_t", "learned").state_dict()))
    assert P + "L_level.layers.1.mlp_t.gate_up_proj.weight" in mlp_t and P + "embed_pos.embedding_weight" in mlp_t


@pytest.mark.parametrize(("variant", "pos"), [("attention", "rope"), ("mlp_t", "none"), ("mlp_t", "learned")])
def test_round_trip_is_lossless(tmp_path, variant, pos):
    source = model(variant, pos)
    reference = {k: v.clone() + torch.randn_like(v) for k, v in to_reference_state_dict(source.state_dict()).items()}
    path = tmp_path / "step_100"
    torch.save(reference, path)
    target = model(variant, pos, seed=1)
    load_reference_checkpoint(path, target)
    loaded = target.state_dict()
    for key, value in from_reference_state_dict(reference).items():
        assert torch.equal(loaded[key], value), key
    again = to_reference_state_dict(target.state_dict())
    assert again.keys() == reference.keys()
    assert all(torch.equal(again[k], reference[k]) for k in reference)
    out = save_reference_checkpoint(target, tmp_path / "out" / "ckpt")
    assert all(torch.equal(v, reference[k]) for k, v in torch.load(out, weights_only=True).items())


def test_prefix_without_torch_compile_and_bf16_initial_states(tmp_path):
    source = model()
    reference = to_reference_state_dict(source.state_dict(), prefix="model.inner.")
    reference["model.inner.H_init"] = reference["model.inner.H_init"].bfloat16()  # the reference stores them so
    torch.save(reference, tmp_path / "ckpt")
    target = model(seed=1)
    load_reference_checkpoint(tmp_path / "ckpt", target)
    assert torch.equal(target.z_H_init, source.z_H_init.bfloat16().float())
    assert torch.equal(target.lm_head.weight, source.lm_head.weight)


def _one_line_error(path, target) -> str:
    with pytest.raises(UserError) as info:
        load_reference_checkpoint(path, target)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def test_wrong_files_give_one_line_errors(tmp_path):
    good = to_reference_state_dict(model().state_dict())
    cases = {
        "missing": {k: v for k, v in good.items() if "o_proj" not in k},
        "shape": {**good, P + "lm_head.weight": torch.zeros(11, 64)},
        "unexpected": {**good, P + "L_level.layers.2.mlp.down_proj.weight": torch.zeros(1)},
        "foreign": {"encoder.weight": torch.zeros(1)},
    }
    messages = {}
    for name, state in cases.items():
        torch.save(state, tmp_path / name)
        messages[name] = _one_line_error(tmp_path / name, model())
    assert f"missing key '{P}L_level.layers.0.self_attn.o_proj.weight'" in messages["missing"]
    assert "(11, 64)" in messages["shape"] and "(11, 32)" in messages["shape"] and "hidden_size" in messages["shape"]
    assert "unexpected key" in messages["unexpected"] and "L_layers" in messages["unexpected"]
    assert "encoder.weight" in messages["foreign"]
    assert "no such file" in _one_line_error(tmp_path / "absent", model())
    (tmp_path / "garbage").write_text("not a checkpoint")
    assert "not a readable PyTorch checkpoint" in _one_line_error(tmp_path / "garbage", model())


def test_puzzle_table_of_another_dataset(tmp_path):
    source = model(puzzles=5)
    with torch.no_grad():
        source.puzzle_emb.weight.normal_()
    torch.save(to_reference_state_dict(source.state_dict()), tmp_path / "ckpt")
    message = _one_line_error(tmp_path / "ckpt", model(puzzles=3))
    assert "5 puzzle identifiers" in message and "resize_puzzle_emb=True" in message
    target = model(puzzles=3)
    load_reference_checkpoint(tmp_path / "ckpt", target, resize_puzzle_emb=True)
    mean = source.puzzle_emb.weight.mean(0)
    assert all(torch.equal(row, mean) for row in target.puzzle_emb.weight)
