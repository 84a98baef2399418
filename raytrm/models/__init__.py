"""raytrm's models in plain PyTorch: TRM (attention or mlp_t), a byte-level transformer, TRM's losses, shared layers,
their operations (ops; raytrm.fastpaths may serve the named ones on a device) and reference-checkpoint import/export."""

from raytrm.models.layers import (
    Attention,
    Embedding,
    Linear,
    RotaryEmbedding,
    SparseEmbedding,
    SwiGLU,
    swiglu_width,
    trunc_normal_,
)
from raytrm.models.losses import IGNORE_LABEL_ID, act_loss, stablemax_cross_entropy
from raytrm.models.ops import rms_norm
from raytrm.models.reference_layout import (
    from_reference_state_dict,
    load_reference_checkpoint,
    save_reference_checkpoint,
    to_reference_state_dict,
)
from raytrm.models.transformer import Transformer
from raytrm.models.trm import TRM, Carry, Exploration

__all__ = [
    "IGNORE_LABEL_ID",
    "TRM",
    "Attention",
    "Carry",
    "Embedding",
    "Exploration",
    "Linear",
    "RotaryEmbedding",
    "SparseEmbedding",
    "SwiGLU",
    "Transformer",
    "act_loss",
    "from_reference_state_dict",
    "load_reference_checkpoint",
    "rms_norm",
    "save_reference_checkpoint",
    "stablemax_cross_entropy",
    "swiglu_width",
    "to_reference_state_dict",
    "trunc_normal_",
]
