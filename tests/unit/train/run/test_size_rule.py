"""The size rule: lr by family, TRM variant and width, never above the anchor's; the warm-up stays the anchor's."""

from __future__ import annotations

import pytest

from raytrm.config import ModelConfig
from raytrm.families import family
from raytrm.train.run.size_rule import size_rule


@pytest.mark.parametrize(
    ("variant", "width", "lr"),
    [
        ("attention", 64, 3e-3),
        ("attention", 128, 1.5e-3),
        ("attention", 256, 7.5e-4),
        ("attention", 512, 3.75e-4),
        ("mlp_t", 64, 3e-3),
        ("mlp_t", 256, 3e-3),
        ("mlp_t", 512, 3e-3),
    ],
)
def test_trm_lr_falls_as_1_over_width_with_attention_and_not_with_the_mlp(variant, width, lr):
    got, warmup, _ = size_rule(ModelConfig(variant=variant, hidden_size=width))
    assert got == pytest.approx(lr) and warmup == family("trm").anchor.warmup_steps


def test_the_transformer_lr_falls_as_1_over_sqrt_width():
    anchor = family("transformer").anchor
    lr, warmup, why = size_rule(ModelConfig(name="transformer", hidden_size=4 * anchor.width))
    assert lr == pytest.approx(anchor.lr / 2) and warmup == anchor.warmup_steps
    assert why == f"{anchor.lr:g} x sqrt({anchor.width}/{4 * anchor.width}) for transformer, warm-up 50 steps"


@pytest.mark.parametrize("variant", ["attention", "mlp_t"])
def test_narrower_than_the_anchor_keeps_the_anchors_lr(variant):
    lr, _, _ = size_rule(ModelConfig(variant=variant, hidden_size=32))
    assert lr == family("trm").anchor.lr


def test_the_rule_in_words_names_the_variant_and_the_scale():
    assert size_rule(ModelConfig(variant="attention", hidden_size=512))[2] == (
        "0.003 x 64/512 for trm/attention, warm-up 20 steps"
    )
    assert size_rule(ModelConfig(variant="mlp_t", hidden_size=512))[2] == (
        "0.003, the default's, at every width for trm/mlp_t, warm-up 20 steps"
    )
