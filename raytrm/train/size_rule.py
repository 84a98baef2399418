"""The learning rate and warm-up for a model's size: what `raytrm train` uses when flags move its embedded default
to another width, depth or batch, unless --lr is given.

Each family's embedded default was tuned at one width (its anchor). Adam moves every weight by about lr a step
whatever its gradient's scale, so a layer n inputs wide moves its outputs about n times lr: a wider model at the
anchor's lr takes larger steps, and past some width it lands on the plateau where it predicts the labels' frequencies
(issue 18's H200 run at hidden 512). The rule holds lr x width at the anchor's value (muP's scaling for Adam); the
table it was chosen from is in docs/performance.md.
"""

from __future__ import annotations

from typing import NamedTuple

from raytrm import config as cfg


class Anchor(NamedTuple):
    """Where a family's embedded default was tuned: its width, learning rate and warm-up steps."""

    width: int
    lr: float
    warmup_steps: int


ANCHORS = {"trm": Anchor(64, 3e-3, 20), "transformer": Anchor(128, 2e-3, 50)}


def size_rule(model: cfg.ModelConfig) -> tuple[float, int, str]:
    """(lr, warm-up steps, the rule in words) for a model of this family and width."""
    anchor = ANCHORS[model.name]
    width = model.hidden_size
    lr = anchor.lr * anchor.width / width
    return lr, anchor.warmup_steps, f"{anchor.lr:g} x {anchor.width}/{width} (lr x width held at the default's)"
