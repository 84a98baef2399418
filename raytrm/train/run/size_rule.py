"""The learning rate and warm-up for a model's size: what `raytrm train` uses when flags move its embedded default
to another width, depth or batch, unless --lr is given.

Each family's embedded default was tuned at one width (its anchor). Adam moves every weight by about lr a step
whatever its gradient's scale, so a layer n inputs wide moves its outputs more per step the wider it is: a wider
model at the anchor's lr takes larger steps, and past some width lands on the plateau where it predicts the labels'
frequencies whatever its input. How fast lr must fall with width depends on the block's mixer:

- TRM-attention: lr as 1/width, as muP scales Adam's lr for hidden matrices. At 1/sqrt(width) the widest default
  measured (512) had only just left the plateau after 60 steps; from 1/width up to about twice it, it learns there,
  and 1/width, the low end, is where its loss fell without the spikes seen above it.
- TRM-MLP: the anchor's lr at every width. An MLP across positions learned at the anchor's lr at every width
  measured (up to 8 times the anchor's), and more there than at 1/sqrt(width)'s lower lr.
- transformer: lr as 1/sqrt(width).

lr never goes above the anchor's, and the warm-up stays the anchor's; depth and batch leave both alone.
docs/performance.md has the table the rule was chosen from, and the runs it was checked against.
"""

from __future__ import annotations

from raytrm import config as cfg
from raytrm.families import family


def size_rule(model: cfg.ModelConfig) -> tuple[float, int, str]:
    """(lr, warm-up steps, the rule in words) for a model of this family, variant and width."""
    known = family(model.name)
    anchor, (kind, exponent), width = known.anchor, known.lr_exponent(model), model.hidden_size
    lr = anchor.lr * min(1.0, (anchor.width / width) ** exponent)
    if exponent and width > anchor.width:
        scale = {1.0: f"{anchor.width}/{width}", 0.5: f"sqrt({anchor.width}/{width})"}.get(
            exponent, f"({anchor.width}/{width})^{exponent:g}"
        )
        rule = f"{anchor.lr:g} x {scale} for {kind}"
    elif exponent:
        rule = f"{anchor.lr:g}, the default's (never above it)"
    else:
        rule = f"{anchor.lr:g}, the default's, at every width for {kind}"
    return lr, anchor.warmup_steps, f"{rule}, warm-up {anchor.warmup_steps} steps"
