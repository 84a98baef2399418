"""The learning rate and warm-up for a model's size: what `raytrm train` uses when flags move its embedded default
to another width, depth or batch, unless --lr is given.

Each family's embedded default was tuned at one width (its anchor). Adam moves every weight by about lr a step
whatever its gradient's scale, so a layer n inputs wide moves its outputs more per step the wider it is: a wider
model at the anchor's lr takes larger steps, and past some width (with TRM's deeper recursion) lands on the plateau
where it predicts the labels' frequencies whatever its input. The rule scales lr as 1/sqrt(width) from the anchor,
never above the anchor's lr, and keeps the anchor's warm-up; depth and batch leave it alone. docs/performance.md has
the table it was chosen from, and the runs it was checked against.
"""

from __future__ import annotations

import math
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
    lr = anchor.lr * min(1.0, math.sqrt(anchor.width / width))
    rule = f"{anchor.lr:g} x sqrt({anchor.width}/{width})" if width > anchor.width else f"{anchor.lr:g}, the default's"
    return lr, anchor.warmup_steps, f"{rule}, warm-up {anchor.warmup_steps} steps"
