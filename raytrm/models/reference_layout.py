"""Reference checkpoints in and out: raytrm's TRM state dict <-> the TinyRecursiveModels key layout.

The reference saves the raw state dict of its compiled loss head, so its keys read
`_orig_mod.model.inner.<name>` (or `model.inner.<name>` when saved without torch.compile). Names map one to one;
tensors pass through untouched, so a round trip is lossless.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from raytrm.errors import UserError

logger = logging.getLogger(__name__)

REFERENCE_PREFIX = "_orig_mod.model.inner."
_PREFIXES = (REFERENCE_PREFIX, "model.inner.")

# (raytrm name, reference name); {i} is a block index, {p} a projection inside the block.
_NAMES = (
    ("z_H_init", "H_init"),
    ("z_L_init", "L_init"),
    ("embed_tokens.weight", "embed_tokens.embedding_weight"),
    ("embed_pos.weight", "embed_pos.embedding_weight"),
    ("puzzle_emb.weight", "puzzle_emb.weights"),
    ("lm_head.weight", "lm_head.weight"),
    ("q_head.weight", "q_head.weight"),
    ("q_head.bias", "q_head.bias"),
    ("blocks.{i}.attn.{p}.weight", "L_level.layers.{i}.self_attn.{p}.weight"),
    ("blocks.{i}.mlp_t.{p}.weight", "L_level.layers.{i}.mlp_t.{p}.weight"),
    ("blocks.{i}.mlp.{p}.weight", "L_level.layers.{i}.mlp.{p}.weight"),
)


def _pattern(template: str) -> re.Pattern[str]:
    escaped = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>[a-z_]+_proj)")
    return re.compile(escaped)


_OURS_TO_REF = [(_pattern(ours), ref) for ours, ref in _NAMES]
_REF_TO_OURS = [(_pattern(ref), ours) for ours, ref in _NAMES]


def _rename(key: str, rules: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, template in rules:
        match = pattern.fullmatch(key)
        if match:
            return template.format(**match.groupdict())
    return None


def _strip_prefix(key: str) -> str | None:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


def to_reference_state_dict(
    state_dict: Mapping[str, torch.Tensor], prefix: str = REFERENCE_PREFIX
) -> dict[str, torch.Tensor]:
    """raytrm TRM state dict -> the reference's layout (same tensor objects, renamed)."""
    out = {}
    for key, tensor in state_dict.items():
        name = _rename(key, _OURS_TO_REF)
        if name is None:
            raise ValueError(f"'{key}' is not a key of raytrm's TRM state dict")
        out[prefix + name] = tensor
    return out


def from_reference_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reference-layout state dict (with or without `_orig_mod.`) -> raytrm's TRM names (same tensor objects)."""
    out = {}
    for key, tensor in state_dict.items():
        inner = _strip_prefix(key)
        name = None if inner is None else _rename(inner, _REF_TO_OURS)
        if name is None:
            raise UserError(
                f"unexpected key '{key}': not a TRM key of the reference layout "
                f"(expected names like '{REFERENCE_PREFIX}lm_head.weight'); is this a TinyRecursiveModels "
                "TRM checkpoint?"
            )
        out[name] = tensor
    return out


def _is_weight(value: object) -> bool:
    """A tensor that loads into a parameter: dense, real floating point, with its data (not a meta tensor)."""
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.layout == torch.strided
        and not value.is_meta
    )


def save_reference_checkpoint(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write model's weights as a reference checkpoint (what its pretrain.py saves and loads)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    torch.save(to_reference_state_dict(model.state_dict()), p)
    return p


def load_reference_checkpoint(path: str | os.PathLike, model: nn.Module, resize_puzzle_emb: bool = False) -> None:
    """Load a reference checkpoint into model; a wrong file is a UserError of one line saying what and how to fix.

    resize_puzzle_emb: when the puzzle table's row count differs (another dataset), start every row from the mean
    of the checkpoint's rows, as the reference's pretrain.py does, instead of refusing.
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such file; check the checkpoint path")
    try:
        raw = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(
            f"{p}: not a readable PyTorch checkpoint ({type(e).__name__}); expected a state dict saved by the "
            "TinyRecursiveModels pretrain.py"
        ) from None
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) and _is_weight(v) for k, v in raw.items()):
        raise UserError(
            f"{p}: not a state dict of names to floating-point tensors; expected a TinyRecursiveModels TRM checkpoint"
        )
    try:
        ours = from_reference_state_dict(raw)
    except UserError as e:
        raise UserError(f"{p}: {e}") from None

    expected = model.state_dict()
    for key in expected:
        if key not in ours:
            raise UserError(
                f"{p}: missing key '{REFERENCE_PREFIX}{_rename(key, _OURS_TO_REF)}'; the checkpoint was trained "
                "with another architecture: set model variant, pos_encodings, L_layers and puzzle_emb_len to "
                "match it"
            )
    for key in ours:
        if key not in expected:
            raise UserError(
                f"{p}: unexpected key '{REFERENCE_PREFIX}{_rename(key, _OURS_TO_REF)}'; the checkpoint was trained "
                "with another architecture: set model variant, pos_encodings, L_layers and puzzle_emb_len to "
                "match it"
            )
    for key, tensor in ours.items():
        want = expected[key].shape
        if tensor.shape == want:
            continue
        ref_key = REFERENCE_PREFIX + str(_rename(key, _OURS_TO_REF))
        if key == "puzzle_emb.weight" and tensor.shape[1:] == want[1:]:
            if resize_puzzle_emb:
                logger.warning(
                    "%s: puzzle table has %d rows, model %d: every row starts from their mean",
                    p,
                    tensor.shape[0],
                    want[0],
                )
                ours[key] = tensor.mean(dim=0, keepdim=True).expand(want).contiguous()
                continue
            raise UserError(
                f"{p}: '{ref_key}' has {tensor.shape[0]} puzzle identifiers, the dataset {want[0]}; use the "
                "checkpoint's dataset or pass resize_puzzle_emb=True to start from the mean embedding"
            )
        raise UserError(
            f"{p}: '{ref_key}' has shape {tuple(tensor.shape)}, this model expects {tuple(want)}; set hidden_size, "
            "num_heads, expansion and the dataset (vocab, seq_len) to the checkpoint's"
        )
    model.load_state_dict(ours)
    logger.info("loaded reference checkpoint %s (%d tensors)", p, len(ours))
