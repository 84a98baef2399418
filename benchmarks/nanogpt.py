"""A plain nanoGPT-style byte-level language model and its training step: the reference of
`python -m benchmarks transformer`.

Written here from nanoGPT's architecture (karpathy/nanoGPT, model.py and train.py), not imported from it: learned
token and position embeddings, pre-norm blocks of LayerNorm without bias, causal self-attention through one fused qkv
projection and SDPA, a GELU MLP of width 4D, a final LayerNorm and a head tied to the token embedding. No dropout, no
biases (nanoGPT's `bias=False`). The step is train.py's: random windows of the corpus, the forward under autocast
where the forward dtype is not float32, backward, optional gradient clipping, AdamW (fused on CUDA) with decay on the
matrices only.

The bench gives it raytrm's shape, batch, device and forward dtype, so a difference in tokens/s is the two
implementations' own: raytrm's blocks (RMSNorm, RoPE, SwiGLU), its loader, metrics and EMA against nanoGPT's.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raytrm import config as cfg
from raytrm.hardware import device as devices

logger = logging.getLogger(__name__)

BYTE_VOCAB = 256
INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """nanoGPT's model config, at byte vocabulary and without dropout or biases."""

    seq_len: int
    layers: int
    heads: int
    hidden: int
    vocab_size: int = BYTE_VOCAB

    @classmethod
    def like(cls, model: cfg.ModelConfig) -> GPTConfig:
        """The shape of raytrm's transformer config: width, depth, heads and sequence length."""
        return cls(seq_len=model.seq_len, layers=model.layers, heads=model.num_heads, hidden=model.hidden_size)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.c_attn = nn.Linear(config.hidden, 3 * config.hidden, bias=False)
        self.c_proj = nn.Linear(config.hidden, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden, 4 * config.hidden, bias=False)
        self.c_proj = nn.Linear(4 * config.hidden, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden, bias=False)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden, bias=False)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """forward(idx [B, T], targets [B, T] or None) returns (logits [B, T, vocab], mean cross-entropy or None)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.seq_len, config.hidden)
        self.h = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden, bias=False)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # tied: one table, counted once
        self.apply(self._init_weights)
        # GPT-2's scaling of the projections into the residual stream, so its variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=INIT_STD / math.sqrt(2 * config.layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def configure_optimizer(model: GPT, train: cfg.TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """nanoGPT's AdamW: weight decay on the matrices and embeddings, none on the norms; fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = {"fused": True} if device.type == devices.CUDA else {"foreach": True}
    return torch.optim.AdamW(groups, lr=train.lr, betas=tuple(train.betas), eps=1e-8, **fused)


class NanoGPTTrainer:
    """nanoGPT's training step on raytrm's experiment: its shape, batch, optimizer settings and seed.

    corpus: the bytes to draw windows from. dtype: the forward dtype raytrm's Trainer picked; anything but float32
    runs the forward under autocast, as nanoGPT runs bfloat16. compile_model: torch.compile the model, as nanoGPT's
    `compile=True`.
    """

    def __init__(
        self,
        experiment: cfg.ExperimentConfig,
        corpus: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        compile_model: bool = False,
    ) -> None:
        train = experiment.training
        self.config = GPTConfig.like(experiment.model)
        self.device, self.dtype, self.batch_size = device, dtype, train.global_batch_size
        self.grad_clip = train.grad_clip
        self.data = torch.from_numpy(np.fromfile(corpus, dtype=np.uint8))
        if len(self.data) <= self.config.seq_len:
            raise ValueError(f"{corpus}: {len(self.data)} bytes, fewer than a window of {self.config.seq_len + 1}")
        self.generator = torch.Generator().manual_seed(train.seed)
        self._span = torch.arange(self.config.seq_len + 1)
        torch.manual_seed(train.seed)
        self.model = GPT(self.config).to(device)
        self.model.train()
        if compile_model:
            # nanoGPT's torch.compile(model), in place: a wrapper module would make the FLOP counter's global module
            # hooks fire twice per call (and torch warn so).
            self.model.compile()
        self.optimizer = configure_optimizer(self.model, train, device)
        logger.info("nanoGPT reference: %d parameters, forward %s", self.model.num_parameters(), dtype)

    def get_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows of seq_len + 1 bytes, gathered on the CPU and moved to the device: (inputs, next bytes)."""
        starts = torch.randint(len(self.data) - self.config.seq_len, (self.batch_size,), generator=self.generator)
        windows = self.data[starts[:, None] + self._span].long()
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _forward_context(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The mean cross-entropy of a batch, without a gradient."""
        with torch.no_grad(), self._forward_context():
            return self.model(*batch)[1]

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One optimizer step on a batch (default: fresh random windows); returns its loss, detached.

        The loss stays on the device: reading it waits for the step, which nanoGPT does only when it logs.
        """
        x, y = self.get_batch() if batch is None else batch
        with self._forward_context():
            _, loss = self.model(x, y)
        loss.backward()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()
