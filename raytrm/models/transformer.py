"""A small decoder-only transformer over bytes: a next-byte language model, or a document classifier.

nanoGPT's shape on raytrm's shared layers: token embedding, pre-norm blocks (RMSNorm, RoPE self-attention through
SDPA, SwiGLU), a final RMSNorm and a head. Activations are batch-first [B, L, D]. Single-device: whoever calls it
picks the device and the forward dtype; weights stay fp32 (layers cast them to the activations' dtype).

The language model attends causally and predicts every next byte. The classifier runs the same blocks without the
causal mask, so every position sees the whole document (which first-token pooling needs, and which makes the mean
richer), then pools. The shared Attention takes no padding mask, so a short document's pad positions are an ordinary
learned token that real positions can attend to: the representation still depends only on the document's bytes and
its length, deterministically, and pooling ignores pad positions.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from raytrm.config import ModelConfig
from raytrm.models.layers import Attention, Embedding, Linear, RotaryEmbedding, SwiGLU
from raytrm.models.ops import cast, rms_norm

logger = logging.getLogger(__name__)

BYTE_VOCAB = 256  # token ids are bytes; the classifier adds one pad id after them


class Block(nn.Module):
    """Pre-norm block on [B, L, D]: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, causal: bool) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.attn = Attention(config.hidden_size, config.num_heads, causal=causal)
        self.mlp = SwiGLU(config.hidden_size, config.expansion)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.dropout(self.attn(rms_norm(x, self.eps), rope))
        return x + self.dropout(self.mlp(rms_norm(x, self.eps)))


class Transformer(nn.Module):
    """Byte-level transformer; `num_classes` > 0 makes it a classifier (config.task == "classify").

    forward(inputs [B, L] int) returns logits [B, L, vocab_size] (language model) or [B, num_classes] (classifier).
    """

    def __init__(
        self,
        config: ModelConfig,
        vocab_size: int = BYTE_VOCAB,
        num_classes: int = 0,
        pad_id: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config, self.dtype, self.pad_id = config, dtype, pad_id
        self.classify = config.task == "classify"
        if self.classify and num_classes < 2:
            raise ValueError(f"a classifier needs at least 2 classes, got {num_classes}")
        hidden = config.hidden_size
        self.embed_scale = math.sqrt(hidden)  # unit-variance embeddings with a 1/sqrt(D) table, as in TRM
        self.embed_tokens = Embedding(vocab_size, hidden, init_std=1.0 / self.embed_scale)
        self.rotary = RotaryEmbedding(hidden // config.num_heads, config.seq_len, config.rope_theta)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, causal=not self.classify) for _ in range(config.layers))
        self.head: Linear | None = None
        if self.classify:
            self.head = Linear(hidden, num_classes, bias=True)
        elif not config.tie_embeddings:
            self.head = Linear(hidden, vocab_size)
        with torch.no_grad():
            # GPT-2's scaling of the projections into the residual stream: its variance grows with depth otherwise.
            for block in self.blocks:
                block.attn.o_proj.weight.mul_(1 / math.sqrt(2 * config.layers))
                block.mlp.down_proj.weight.mul_(1 / math.sqrt(2 * config.layers))
        logger.debug("transformer %s: %d parameters, forward dtype %s", config.task, self.num_parameters(), dtype)

    #: The region raytrm.train.compile compiles: the whole forward (its blocks differ only in their weights).
    compile_regions = ("forward",)
    #: ... and records with CUDA graphs on CUDA (training.compile auto): at small batches the compiled step is the
    #: host's launches.
    graph_regions = ("forward",)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.embed_scale * self.embed_tokens(inputs, self.dtype))
        rope = self.rotary()
        for block in self.blocks:
            if self.config.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        x = rms_norm(x, self.config.rms_norm_eps)
        if not self.classify:
            # Tied: the output head is the embedding table (the 1/sqrt(D) rows give logits of unit scale).
            return self.head(x) if self.head is not None else x @ cast(self.embed_tokens.weight, x.dtype).t()
        assert self.head is not None
        if self.config.pooling == "first":
            return self.head(x[:, 0])
        real = (inputs != self.pad_id).unsqueeze(-1) if self.pad_id is not None else torch.ones_like(x[..., :1])
        real = real.to(x.dtype)
        pooled = (x * real).sum(1) / real.sum(1).clamp_min(1)
        return self.head(pooled)
