"""The optimizers and their schedule: AdamW or AdamATan2 for the weights (`build_optimizer`), the learning rate by
step (`lr_at`: warm-up, then constant or cosine), and a weight EMA. (SignSGD, the puzzle table's optimizer, sits
beside the table: raytrm.models.sign_sgd.)

AdamATan2 follows the adam-atan2 package the reference trains with (a CUDA-only kernel): Adam whose update is
atan2(m, sqrt(v)) instead of m / (sqrt(v) + eps), so it needs no epsilon. ModelEMA follows its EMAHelper.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from raytrm import config as cfg
from raytrm.hardware import device as devices
from raytrm.models.sign_sgd import evaluate_closure


def build_optimizer(model: nn.Module, train: cfg.TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """The weights' optimizer the config names, at its peak learning rate (the schedule sets it each step)."""
    kind = AdamATan2 if train.optimizer == "adam_atan2" else torch.optim.AdamW
    # On CUDA, AdamW's fused kernel updates every weight in a few launches, where the default launches a dozen
    # per-tensor-list kernels from the host, one by one, with the GPU idle between them.
    extra = {} if kind is AdamATan2 else {"eps": 1e-8, "fused": True if device.type == devices.CUDA else None}
    return kind(model.parameters(), lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay, **extra)


def step_weights(
    optimizer: torch.optim.Optimizer, model: nn.Module, lr: float, grad_clip: float | None, *, watch: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One step of the weights' optimizer at lr, the gradients zeroed after; returns the gradient's norm before
    clipping (clipped to grad_clip where set) and, when watched, the update/weight ratio (both on the device)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    # The norm before clipping is the one clipping computes anyway; without clipping, one read of the gradients.
    if grad_clip:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    else:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else None
    watched = [p.detach() for p in model.parameters() if p.grad is not None] if watch else []
    before = [w.clone() for w in watched] if watched else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, update_ratio(before, watched) if before is not None else None


def lr_at(step: int, train: cfg.TrainConfig, total_steps: int | None) -> float:
    """Linear warm-up to lr, then constant or cosine down to min_lr_ratio * lr."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if train.schedule == "cosine" and total_steps:
        progress = min(1.0, (step - train.warmup_steps) / max(1, total_steps - train.warmup_steps))
        floor = train.min_lr_ratio
        return train.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
    return train.lr


class AdamATan2(torch.optim.Optimizer):
    """Adam with an atan2 update and decoupled weight decay, no epsilon.

    Per step t: p *= 1 - lr * wd; m = lerp(m, g, 1 - b1); v = b2 v + (1 - b2) g^2;
    p -= lr / (1 - b1^t) * atan2(m, sqrt(v) / sqrt(1 - b2^t)).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 1e-2,
    ) -> None:
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}: expected >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas {betas}: expected two values in [0, 1)")
        if weight_decay < 0:
            raise ValueError(f"invalid weight_decay {weight_decay}: expected >= 0")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamATan2 does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                p.mul_(1 - lr * wd)
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = v.sqrt().div_(math.sqrt(1 - beta2**t))
                p.add_(torch.atan2(m, denom), alpha=-lr / (1 - beta1**t))
        return loss


class ModelEMA:
    """Exponential moving average of a model's trainable parameters: shadow = decay * shadow + (1 - decay) * p.

    Buffers (the puzzle table, the initial states) are not averaged, as in the reference. With `warmup`, update n
    uses min(decay, (1 + n) / (10 + n)): a short run then averages its trained weights instead of keeping ~90% of
    the initial ones, and after a few thousand steps the decay is the reference's constant.
    """

    def __init__(self, model: nn.Module, decay: float = 0.999, warmup: bool = False) -> None:
        self.decay = decay
        self.warmup = warmup
        self.updates = 0
        self.shadow: dict[str, torch.Tensor] = {
            name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad
        }

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the model's current parameters in; call after each optimizer step."""
        self.fold(model.named_parameters())

    @torch.no_grad()
    def fold(self, named: Iterable[tuple[str, torch.Tensor]], times: int = 1) -> None:
        """Fold these (name, value) parameters in `times` times, as that many steps that ended on them would: with
        the same value each time, the decays multiply (one pass over the weights, the same as one update for one)."""
        kept = 1.0
        for _ in range(times):
            kept *= min(self.decay, (1 + self.updates) / (10 + self.updates)) if self.warmup else self.decay
            self.updates += 1
        for name, p in named:
            if name in self.shadow:
                self.shadow[name].mul_(kept).add_(p.detach(), alpha=1 - kept)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Overwrite the model's parameters with the averages."""
        for name, p in model.named_parameters():
            if name in self.shadow:
                p.copy_(self.shadow[name])

    @contextlib.contextmanager
    def swapped(self, model: nn.Module) -> Iterator[nn.Module]:
        """Inside the block the model holds the averaged weights (for evaluation); its own come back after."""
        with torch.no_grad():
            saved = {name: p.detach().clone() for name, p in model.named_parameters() if name in self.shadow}
        self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in saved:
                        p.copy_(saved[name])

    def state_dict(self) -> dict[str, Any]:
        return {
            "decay": self.decay,
            "warmup": self.warmup,
            "updates": self.updates,
            "shadow": {k: v.clone() for k, v in self.shadow.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = set(self.shadow) - set(state["shadow"])
        if missing:
            raise KeyError(f"EMA state lacks parameters {sorted(missing)}")
        self.decay = float(state["decay"])
        self.warmup = bool(state.get("warmup", False))
        self.updates = int(state.get("updates", 0))
        with torch.no_grad():
            for name, value in state["shadow"].items():
                if name in self.shadow:
                    self.shadow[name].copy_(value)


def update_ratio(before: list[torch.Tensor], after: list[torch.Tensor]) -> torch.Tensor:
    """||after - before|| / ||after|| over all the tensors taken as one vector (on the device, not read)."""

    def norm(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors]))

    update = norm([a - b for a, b in zip(after, before, strict=True)])
    return update / norm(after).clamp_min(torch.finfo(torch.float32).tiny)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """optimizer.load_state_dict, then the checks torch leaves to the first step, which would fail deep inside it.

    Numeric hyperparameters stay numbers (lr, eps) or tuples of as many numbers (betas), switches keep this run's
    values (amsgrad, maximize); every parameter's state is
    a mapping of the same keys: its step count a number or a 0-d tensor, every other entry (the moments) a tensor of
    the parameter's shape.
    """
    before = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for old, group in zip(before, optimizer.param_groups, strict=True):
        for key, value in old.items():
            if key not in group:  # torch takes the saved groups whole: a key they lack is gone until a step needs it
                raise KeyError(f"optimizer hyperparameter {key!r} is missing")
            new = group[key]
            if _number(value) and not _number(new):
                raise TypeError(f"optimizer hyperparameter {key!r}: got {new!r}, expected a number")
            if isinstance(value, bool) and new is not None and new is not value:  # amsgrad needs a state of its own
                raise ValueError(f"optimizer hyperparameter {key!r}: got {new!r}, this run's optimizer has {value!r}")
            if isinstance(value, tuple) and not (
                isinstance(new, (tuple, list)) and len(new) == len(value) and all(map(_number, new))
            ):
                raise ValueError(f"optimizer hyperparameter {key!r}: got {new!r}, expected {len(value)} numbers")
    keys = None
    for group in optimizer.param_groups:
        for param in group["params"]:
            saved = optimizer.state.get(param)
            if saved is not None and not isinstance(saved, dict):
                raise TypeError(f"optimizer state of a parameter: got {type(saved).__name__}, expected a mapping")
            if not saved:
                continue
            keys = set(saved) if keys is None else keys
            if set(saved) != keys:
                raise KeyError(f"optimizer state of a parameter holds {sorted(saved)}, the others {sorted(keys)}")
            for key, value in saved.items():
                tensor = isinstance(value, torch.Tensor)
                if key == "step" and (_number(value) or (tensor and value.shape == ())):
                    continue
                if key != "step" and tensor and value.shape == param.shape:
                    continue
                what = tuple(value.shape) if tensor else type(value).__name__
                raise ValueError(f"optimizer state {key!r} of a {tuple(param.shape)} parameter: got {what}")
