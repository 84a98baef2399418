"""Whether a loaded checkpoint fits the run that would restore it: checked in one place, before anything is restored.

A checksum says a file is the one that was written, not that it was written for this run. Two things are checked,
each refused in one line with its own fix:

- the experiment it was written for: every field that differs from the run's config, with the checkpoint's value
  and the config's. The checkpoint is fine; the fix is the config (or a new run).
- every tensor it holds against the shape this config builds: the model, the optimizers' moments, the EMA, TRM's
  carry, the RNG states, a local round's state (its parameters, momentum, pending update, each worker's parameters,
  optimizer and sparse rows) and each worker's error-feedback residual. Its config matches, so the file is broken
  or foreign; the fix is an earlier checkpoint (or a new run).

Trainer.load_state_dict calls it first, so every resume and export checks; a distributed run's driver calls it too,
before any worker starts (raytrm.train.run.training.check_resume). The steps a checkpoint claims are checked where it
is read (raytrm.train.checkpoint.load_checkpoint).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from raytrm import config as cfg
from raytrm.errors import SHOWN_FIELDS, ConfigError, UserError

#: Training fields in which a checkpoint may differ from the run that restores it: how long the run goes on, and
#: each machine's settings (a worker of a distributed run takes them from its own tier or profile).
MAY_DIFFER = {name for _, name in cfg.RESUMABLE_CHANGES} | set(cfg.MACHINE_SETTINGS)

_MISSING = object()


def check_checkpoint_fits(state: dict[str, Any], trainer: Any, config: cfg.ExperimentConfig | None = None) -> None:
    """Refuse, in one line, a loaded checkpoint that was written for another experiment than config (the trainer's
    own by default), or whose tensors are not the shapes the trainer's model, optimizers and carry have.

    trainer: the raytrm.train.trainer.Trainer that would restore it (not imported here: it calls this).
    """
    header = state.get("_header") or {}
    path = Path(str(header.get("path", "checkpoint")))
    config = config or trainer.config
    source = str(trainer.run_dir / "config.yaml") if trainer.run_dir else "the run's config"
    _check_config(state.get("config", _MISSING), config, path, source)
    wrong = _Shapes()
    _expect_trainer(wrong, state, trainer)
    if wrong.found:
        shown = "; ".join(wrong.found[:3]) + (f" (and {len(wrong.found) - 3} more)" if len(wrong.found) > 3 else "")
        raise UserError(
            f"{path}: {shown}; its config matches {source}, so the file itself is broken or was not written by raytrm "
            f"train: move it out of {path.parent} to resume from the checkpoint before it, or start a new run with "
            "another --out"
        )


def _check_config(saved: Any, config: cfg.ExperimentConfig, path: Path, source: str) -> None:
    """Every field of the experiment the checkpoint was written for that differs from config, in one line."""
    broken = (
        f"move it out of {path.parent} to resume from the checkpoint before it, or start a new run with another --out"
    )
    if not isinstance(saved, Mapping):
        raise UserError(
            f"{path}: holds no run config (found {_what(saved)}); it was not written by raytrm train: {broken}"
        )
    try:
        theirs = cfg.to_dict(cfg.from_dict(cfg.ExperimentConfig, dict(saved), str(path)))
    except UserError as e:
        why = f"{e.path}: expected {e.expected}" if isinstance(e, ConfigError) else str(e)
        raise UserError(f"{path}: the config it holds does not read ({why}); the file is broken: {broken}") from None
    mine = cfg.to_dict(config)
    differ = [
        f"{section}.{name} is {theirs[section][name]!r} in the checkpoint, {value!r} in {source}"
        for section in ("model", "data", "training")
        for name, value in mine[section].items()
        if not (section == "training" and name in MAY_DIFFER) and theirs[section][name] != value
    ]
    if differ:
        fields = "those fields" if len(differ) > 1 else "that field"
        more = f" (and {len(differ) - SHOWN_FIELDS} more fields)" if len(differ) > SHOWN_FIELDS else ""
        raise UserError(
            f"{path}: written for another experiment than {source}: {'; '.join(differ[:SHOWN_FIELDS])}{more}; the "
            f"checkpoint is fine: set {fields} in {source} back to the checkpoint's value to resume it, or start a "
            "new run with another --out"
        )


def _what(value: Any) -> str:
    """A found value, as an error names it."""
    if value is _MISSING:
        return "nothing"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} item{'' if len(value) == 1 else 's'}"
    return f"a {type(value).__name__}"


class _Shapes:
    """Collects what a state holds that does not have the expected shape, each as `key: found, expected`."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def wrong(self, key: str, value: Any, expected: str) -> None:
        self.found.append(f"{key} holds {_what(value)}, this config builds {expected}")

    def tensor(self, key: str, value: Any, shape: Sequence[int]) -> None:
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
            self.wrong(key, value, f"a tensor of shape {tuple(shape)}")

    def mapping(self, key: str, value: Any, shapes: Mapping[str, Sequence[int]]) -> None:
        """Exactly these names, each a tensor of its shape."""
        if not isinstance(value, Mapping):
            self.wrong(key, value, f"a mapping of {len(shapes)} tensors")
            return
        for name, shape in shapes.items():
            self.tensor(f"{key}.{name}", value.get(name, _MISSING), shape)
        extra = [name for name in value if name not in shapes]
        if extra:
            self.wrong(f"{key}.{extra[0]}", value[extra[0]], "no such tensor")

    def sequence(self, key: str, value: Any, shapes: Sequence[Sequence[int]]) -> None:
        """As many tensors as shapes, in order, each of its shape."""
        if not isinstance(value, (list, tuple)) or len(value) != len(shapes):
            self.wrong(key, value, f"a list of {len(shapes)} tensors")
            return
        for i, (item, shape) in enumerate(zip(value, shapes, strict=True)):
            self.tensor(f"{key}[{i}]", item, shape)

    def optimizer(self, key: str, value: Any, groups: Sequence[Sequence[Sequence[int]]]) -> None:
        """An optimizer's state dict: its groups' parameter counts, and each parameter's moments of its shape."""
        if not isinstance(value, Mapping) or not isinstance(value.get("param_groups"), list):
            self.wrong(key, value, "an optimizer's state")
            return
        counts = [
            len(g["params"]) if isinstance(g, Mapping) and isinstance(g.get("params"), list) else None
            for g in value["param_groups"]
        ]
        expected = [len(g) for g in groups]
        if counts != expected:
            self.found.append(f"{key}.param_groups hold {counts} parameters, this config builds {expected}")
            return
        shapes = [shape for group in groups for shape in group]
        per_param = value.get("state")
        if not isinstance(per_param, Mapping):
            self.wrong(f"{key} state", per_param, "a mapping of parameter states")
            return
        for index, entry in per_param.items():
            if not isinstance(index, int) or not 0 <= index < len(shapes):
                self.wrong(f"{key} state[{index!r}]", entry, f"states of parameters 0..{len(shapes) - 1}")
                continue
            if not isinstance(entry, Mapping):
                continue  # not a shape: the optimizer's own load refuses it
            for name, moment in entry.items():
                if name != "step" and isinstance(moment, torch.Tensor):
                    self.tensor(f"{key} state[{index}].{name}", moment, shapes[index])


def model_state(trainer: Any) -> dict[str, torch.Tensor]:
    """The model's part of a checkpoint: what trains, where the task says (its `trained_state`: LoRA's adapters and a
    classifier's head, whose base weights come from the model's own directory), else the model's whole state."""
    trained = getattr(trainer.task, "trained_state", None)
    return trained() if trained is not None else trainer.model.state_dict()


def _shapes(params: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in params]


def _optimizer_groups(optimizer: torch.optim.Optimizer) -> list[list[tuple[int, ...]]]:
    return [_shapes(group["params"]) for group in optimizer.param_groups]


def _carry_shapes(trainer: Any) -> dict[str, tuple[int, ...]] | None:
    """The shape of each of the carry's tensors over the whole global batch (None where the model has no carry)."""
    model = trainer.model
    if not hasattr(model, "initial_carry"):
        return None
    batch = trainer.global_batch
    meta = {
        name: torch.empty(batch, *shape, dtype=torch.long, device="meta")
        for name, shape in (("inputs", (model.seq_len,)), ("labels", (model.seq_len,)), ("puzzle_identifiers", ()))
    }
    return {name: tuple(t.shape) for name, t in model.initial_carry(meta).to_dict().items()}


def _expect_trainer(wrong: _Shapes, state: dict[str, Any], trainer: Any) -> None:
    """Every tensor of the trainer's state and of its parts' (see the module docstring) against the trainer's."""
    model = trainer.model
    wrong.mapping("model", state.get("model", _MISSING), {k: tuple(v.shape) for k, v in model_state(trainer).items()})
    wrong.optimizer("optimizer", state.get("optimizer", _MISSING), _optimizer_groups(trainer.optimizer))
    if trainer.sparse_optimizer is not None and state.get("sparse_optimizer") is not None:
        wrong.optimizer("sparse_optimizer", state["sparse_optimizer"], _optimizer_groups(trainer.sparse_optimizer))
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    ema = {name: tuple(p.shape) for name, p in trainable}
    if trainer.ema is not None and state.get("ema") is not None:
        _expect_ema(wrong, "ema", state["ema"], ema)
    carry = _carry_shapes(trainer)
    if carry is not None and state.get("carry") is not None:
        wrong.mapping("carry", state["carry"], carry)
    rng = state.get("rng", _MISSING)
    expected_rng = {"torch": tuple(torch.get_rng_state().shape)}
    expected_rng.update({k: tuple(v.shape) for k, v in trainer.task.rng_state().items()})
    wrong.mapping("rng", rng, expected_rng)
    shares = state.get("shares", [trainer.global_batch])
    if (
        not (isinstance(shares, list) and shares and all(isinstance(b, int) and b >= 0 for b in shares))
        or sum(shares) != trainer.global_batch
    ):
        wrong.found.append(
            f"shares holds {shares!r:.60}, this config builds shares of the global batch {trainer.global_batch}"
        )
    sync = state.get("sync")
    if isinstance(sync, Mapping):
        params = _shapes([p for _, p in trainable])
        _expect_rounds(wrong, sync.get("rounds"), params, ema, trainer)
        residuals = sync.get("residuals")
        if isinstance(residuals, list):
            size = sum(p.numel() for _, p in trainable)
            for i, residual in enumerate(residuals):
                if residual is not None:
                    wrong.tensor(f"sync.residuals[{i}]", residual, (size,))
        elif residuals is not None:
            wrong.wrong("sync.residuals", residuals, "a list of each worker's residual")


def _expect_ema(wrong: _Shapes, key: str, value: Any, shapes: dict[str, tuple[int, ...]]) -> None:
    if not isinstance(value, Mapping):
        wrong.wrong(key, value, "an EMA's state")
        return
    wrong.mapping(f"{key}.shadow", value.get("shadow", _MISSING), shapes)


def _expect_rounds(
    wrong: _Shapes, rounds: Any, params: list[tuple[int, ...]], ema: dict[str, tuple[int, ...]], trainer: Any
) -> None:
    """A local round's state (raytrm.sync.local.Local.state_dict): every parameter-shaped list, each
    worker's parameters, optimizer and the sparse table's rows it moved."""
    if rounds is None:
        return
    if not isinstance(rounds, Mapping):
        wrong.wrong("sync.rounds", rounds, "a local round's state")
        return
    wrong.sequence("sync.rounds.globals", rounds.get("globals", _MISSING), params)
    for name in ("momentum", "pending"):
        if rounds.get(name) is not None:
            wrong.sequence(f"sync.rounds.{name}", rounds[name], params)
    if rounds.get("ema") is not None:
        _expect_ema(wrong, "sync.rounds.ema", rounds["ema"], ema)
    workers = rounds.get("workers", _MISSING)
    if not isinstance(workers, list) or not workers:
        wrong.wrong("sync.rounds.workers", workers, "a list of each worker's state")
        return
    tables = [e.weight for e in trainer.sparse_optimizer.embeddings] if trainer.sparse_optimizer is not None else []
    for i, worker in enumerate(workers):
        key = f"sync.rounds.workers[{i}]"
        if not isinstance(worker, Mapping):
            wrong.wrong(key, worker, "a worker's state")
            continue
        wrong.sequence(f"{key}.params", worker.get("params", _MISSING), params)
        if worker.get("sent") is not None:
            wrong.sequence(f"{key}.sent", worker["sent"], params)
        wrong.optimizer(f"{key}.optimizer", worker.get("optimizer", _MISSING), _optimizer_groups(trainer.optimizer))
        rows = worker.get("rows")
        if rows is None:
            continue
        if not isinstance(rows, list) or len(rows) != len(tables):
            wrong.wrong(f"{key}.rows", rows, f"the moved rows of {len(tables)} sparse table(s)")
            continue
        for k, (table_rows, table) in enumerate(zip(rows, tables, strict=True)):
            ids = table_rows.get("ids", _MISSING) if isinstance(table_rows, Mapping) else _MISSING
            n = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 1 else 0
            wrong.mapping(
                f"{key}.rows[{k}]", table_rows, {"ids": (n,), "base": (n, table.shape[1]), "now": (n, table.shape[1])}
            )
