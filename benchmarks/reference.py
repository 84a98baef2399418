"""Drive the TRM reference's own training step, loaded at run time from a user's checkout, for
`python -m benchmarks trm`.

Nothing of the reference is shipped with raytrm: its `models/` package is imported from the directory the user names,
which is never written to. The reference does not run on a CPU as shipped; only its training script (`pretrain.py`)
holds what stops it (cuda device strings, the CUDA-only adam-atan2 optimizer, torch.compile), so that script is not
imported: this module plays its part. The model, its loss head (float64 stablemax, which a CPU runs), the sparse
SignSGD of the puzzle embedding and the EMA helper are the reference's own classes, built as `pretrain.py` builds them
but with the forward dtype raytrm picks for the device (float32 on a CPU) and torch's AdamW for the weights.

What `pretrain.py` does for speed, this does too: on CUDA the weights' optimizer is one fused kernel (AdamW's
`fused=True`, as adam-atan2's CUDA kernel is), and the next batch is gathered in page-locked memory while the device
runs a step (its DataLoader's worker, pin_memory and prefetch do that).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from raytrm import config as cfg
from raytrm.data.puzzle_format import PuzzleDataset, PuzzleMetadata
from raytrm.errors import UserError
from raytrm.hardware import device as devices

logger = logging.getLogger(__name__)

REFERENCE_REPO = "github.com/SamsungSAILMontreal/TinyRecursiveModels"
#: The reference's architecture file: `name` and `loss.name` pick its model and loss head classes.
ARCH_FILE = "config/arch/trm.yaml"
#: The top-level package the reference imports its own modules by.
PACKAGE = "models"
#: Modules the training step needs besides those `ARCH_FILE` names: `module:Class` under `PACKAGE`.
SPARSE_OPTIMIZER = "sparse_embedding:CastedSparseEmbeddingSignSGD_Distributed"
EMA_HELPER = "ema:EMAHelper"


@dataclass
class ReferenceClasses:
    """The reference's classes a training step uses, and the loss function its architecture file names."""

    model: type
    loss_head: type
    loss_type: str
    sparse_optimizer: type
    ema: type


def _clone_fix(root: Path) -> str:
    return f"fix: pass --reference a checkout of {REFERENCE_REPO} (git clone https://{REFERENCE_REPO} {root})"


def _rearrange(tensor: torch.Tensor, pattern: str) -> torch.Tensor:
    """einops.rearrange for pure axis permutations ('B S H D -> B H S D'), the only patterns the reference uses."""
    left, right = (side.split() for side in pattern.split("->"))
    if sorted(left) != sorted(right) or len(set(left)) != len(left) or not all(a.isidentifier() for a in left):
        raise UserError(
            f"the TRM reference calls einops.rearrange with {pattern!r}, more than an axis permutation, and einops is"
            " not installed; fix: pip install einops"
        )
    return tensor.permute(*(left.index(axis) for axis in right))


def _einops_stand_in() -> types.ModuleType:
    module = types.ModuleType("einops", "raytrm's stand-in for einops.rearrange (axis permutations only)")
    module.rearrange = _rearrange  # type: ignore[attr-defined]
    return module


@contextlib.contextmanager
def _reference_imports(root: Path) -> Iterator[None]:
    """`root` first on sys.path and its `models` package importable, without writing bytecode into `root`.

    Any other module named `models` is set aside meanwhile, so the reference's own imports find its files, and the
    reference's modules leave sys.modules afterwards, so a second checkout loads its own.
    """

    def ours(name: str) -> bool:
        return name == PACKAGE or name.startswith(PACKAGE + ".")

    saved = {name: sys.modules.pop(name) for name in [n for n in sys.modules if ours(n)]}
    stand_ins = {}
    if "einops" not in sys.modules and importlib.util.find_spec("einops") is None:
        logger.info("einops is not installed: the reference's axis permutations use raytrm's stand-in")
        stand_ins["einops"] = _einops_stand_in()
    sys.modules.update(stand_ins)
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    dont_write_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # leave the checkout untouched
    try:
        yield
    finally:
        sys.dont_write_bytecode = dont_write_bytecode
        with contextlib.suppress(ValueError):
            sys.path.remove(str(root))
        for name in [n for n in sys.modules if ours(n)]:
            del sys.modules[name]
        for name in stand_ins:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def _load_class(root: Path, identifier: str, source: str) -> type:
    """The class `module:Class` (or `module@Class`, as the reference's configs write it) under `PACKAGE`."""
    module_name, _, class_name = identifier.replace("@", ":").partition(":")
    path = root / PACKAGE / Path(*module_name.split("."))
    try:
        module = importlib.import_module(f"{PACKAGE}.{module_name}")
    except ModuleNotFoundError as e:
        if e.name and (e.name == PACKAGE or e.name.startswith(PACKAGE + ".")):
            raise UserError(
                f"{path}.py: not found (named by {source}), so {root} is not a TRM reference checkout;"
                f" {_clone_fix(root)}"
            ) from e
        missing = e.name or str(e)
        raise UserError(
            f"{root}: importing the TRM reference's {PACKAGE}.{module_name} needs the package {missing!r}, which is"
            f" not installed; fix: pip install {missing}"
        ) from e
    except (ImportError, SyntaxError) as e:
        raise UserError(f"{root}: importing {path}.py failed ({e}); {_clone_fix(root)}") from e
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise UserError(f"{path}.py: no class {class_name!r} (named by {source}); {_clone_fix(root)}")
    return cls


def _read_arch(root: Path) -> dict:
    path = root / ARCH_FILE
    if not root.is_dir():
        raise UserError(f"{root}: no such directory; {_clone_fix(root)}")
    if not path.is_file():
        raise UserError(f"{root}: no {ARCH_FILE}, so this is not a TRM reference checkout; {_clone_fix(root)}")
    try:
        arch = yaml.safe_load(path.read_text())
        names = (arch["name"], arch["loss"]["name"], arch["loss"]["loss_type"])
    except (yaml.YAMLError, KeyError, TypeError) as e:
        raise UserError(
            f"{path}: expected `name` and `loss: {{name, loss_type}}` as the reference writes them ({e!r});"
            f" {_clone_fix(root)}"
        ) from e
    if not all(isinstance(n, str) for n in names):
        raise UserError(f"{path}: `name`, `loss.name` and `loss.loss_type` must be strings; {_clone_fix(root)}")
    return arch


def _classes(root: Path, arch: dict) -> ReferenceClasses:
    source = str(root / ARCH_FILE)
    return ReferenceClasses(
        model=_load_class(root, arch["name"], source),
        loss_head=_load_class(root, arch["loss"]["name"], source),
        loss_type=arch["loss"]["loss_type"],
        sparse_optimizer=_load_class(root, SPARSE_OPTIMIZER, "benchmarks.reference"),
        ema=_load_class(root, EMA_HELPER, "benchmarks.reference"),
    )


def load_reference_classes(root: str | Path) -> ReferenceClasses:
    """The reference's TRM model, loss head, puzzle-embedding optimizer and EMA helper, imported from `root`."""
    root = Path(root).expanduser().resolve()
    arch = _read_arch(root)
    with _reference_imports(root):
        return _classes(root, arch)


def reference_arch(model: cfg.ModelConfig, batch: int, meta: PuzzleMetadata, dtype: torch.dtype) -> dict:
    """The reference model's config dict for raytrm's `model` config, as `pretrain.py`'s create_model builds it."""
    return {
        "batch_size": batch,
        "seq_len": meta.seq_len,
        "vocab_size": meta.vocab_size,
        "num_puzzle_identifiers": meta.num_puzzle_identifiers,
        "puzzle_emb_ndim": model.hidden_size if model.puzzle_emb_len else 0,
        "puzzle_emb_len": model.puzzle_emb_len,
        "H_cycles": model.H_cycles,
        "L_cycles": model.L_cycles,
        "H_layers": 0,
        "L_layers": model.L_layers,
        "hidden_size": model.hidden_size,
        "expansion": model.expansion,
        "num_heads": model.num_heads,
        "pos_encodings": model.pos_encodings,
        "rms_norm_eps": model.rms_norm_eps,
        "rope_theta": model.rope_theta,
        "halt_max_steps": model.halt_max_steps,
        "halt_exploration_prob": model.halt_exploration_prob,
        "forward_dtype": str(dtype).removeprefix("torch."),
        "mlp_t": model.variant == "mlp_t",
        "no_ACT_continue": True,
        "causal": False,
    }


class ReferenceTrainer:
    """The reference's training step (`pretrain.py`'s train_batch, with EMA) on one device, on a raytrm dataset."""

    def __init__(
        self,
        root: str | Path,
        experiment: cfg.ExperimentConfig,
        data_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        compile_model: bool = False,
    ) -> None:
        if devices.loss_dtype(device) != torch.float64:
            raise UserError(
                f"the TRM reference computes its loss in float64, which {device.type} lacks;"
                " fix: run the bench with --device cpu"
            )
        train = experiment.training
        self.device, self.batch_size = device, train.global_batch_size
        self.data = PuzzleDataset(data_dir, "train")
        self.rng = np.random.default_rng(train.seed)
        root = Path(root).expanduser().resolve()
        reference = _read_arch(root)
        arch = reference_arch(experiment.model, self.batch_size, self.data.metadata, dtype)
        torch.manual_seed(train.seed)
        # Built while its modules are importable, as pretrain.py builds it: under the device, so its buffers land there.
        with _reference_imports(root):
            classes = _classes(root, reference)
            with device:
                self.model = classes.loss_head(classes.model(arch), loss_type=classes.loss_type)
        self.model.train()
        if compile_model:
            # The loss head compiled whole, as pretrain.py runs it (unless DISABLE_COMPILE); in place, so the FLOP
            # counter's module hooks see one module, not a wrapper and the module inside it.
            self.model.compile()
        # torch.compile traces on the first step, and its guards check the reference's modules on every step: they
        # stay importable, the same module objects, until close().
        self._imports = contextlib.ExitStack()
        if compile_model:
            self._imports.enter_context(_reference_imports(root))
        # pretrain.py: SignSGD on the puzzle-embedding buffers, the weights' optimizer on model.parameters().
        self.optimizers: list[torch.optim.Optimizer] = [
            torch.optim.AdamW(
                self.model.parameters(),
                lr=train.lr,
                betas=tuple(train.betas),
                weight_decay=train.weight_decay,
                fused=True if device.type == devices.CUDA else None,
            )
        ]
        if arch["puzzle_emb_ndim"]:
            self.optimizers.insert(
                0,
                classes.sparse_optimizer(
                    self.model.model.puzzle_emb.buffers(),
                    lr=train.puzzle_emb_lr,
                    weight_decay=train.puzzle_emb_weight_decay,
                    world_size=1,
                ),
            )
        self.ema = None
        if train.ema:
            self.ema = classes.ema(mu=train.ema_decay)
            self.ema.register(self.model)
        self.carry = None
        self._next: dict[str, torch.Tensor] | None = None
        self.num_parameters = sum(p.numel() for p in self.model.parameters())

    def close(self) -> None:
        self._imports.close()

    def _gather(self) -> dict[str, torch.Tensor]:
        """The next batch on the host (page-locked on CUDA)."""
        idx = self.rng.choice(len(self.data), size=self.batch_size, replace=len(self.data) < self.batch_size)
        return {k: devices.page_locked(torch.from_numpy(v), self.device) for k, v in self.data.batch(idx).items()}

    def train_step(self) -> dict[str, float]:
        """One optimizer step as the reference takes it; returns its summed metrics."""
        host, self._next = self._next or self._gather(), None
        batch = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
        if self.carry is None:
            with self.device:
                self.carry = self.model.initial_carry(batch)
        self.carry, loss, metrics, _, _ = self.model(carry=self.carry, batch=batch, return_keys=[])
        ((1 / self.batch_size) * loss).backward()
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad()
        if self.ema is not None:
            self.ema.update(self.model)
        self._next = self._gather()
        keys = sorted(metrics)
        values = torch.stack([metrics[k] for k in keys]).cpu().numpy() if keys else []
        return dict(zip(keys, map(float, values), strict=True))
