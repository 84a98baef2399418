"""The layers of raytrm's models: linear, embeddings, RoPE tables, the SwiGLU and attention (plain PyTorch; their
operations are raytrm.models.ops, where a device fast path may serve them).

Weights are kept in fp32 (the master copy); a layer casts them to the dtype of its input only when that differs,
so a bf16 forward reads fp32 weights the way the TRM reference does, and an fp32 forward pays for no casts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from raytrm import fastpaths
from raytrm.hardware import device as devices
from raytrm.models import ops
from raytrm.models.ops import cast


def trunc_normal_(tensor: torch.Tensor, std: float = 1.0, lower: float = -2.0, upper: float = 2.0) -> torch.Tensor:
    """Fill tensor from a normal truncated at [lower, upper] sigmas whose std after truncation is `std`.

    torch.nn.init.trunc_normal_ takes the std of the normal before truncation; the reference (like JAX/flax)
    rescales so the truncated distribution itself has the requested std, which we match.
    """
    with torch.no_grad():
        if std == 0:
            return tensor.zero_()
        # Variance of a standard normal truncated to [lower, upper].
        z = (math.erf(upper / math.sqrt(2)) - math.erf(lower / math.sqrt(2))) / 2
        pdf_lo = math.exp(-0.5 * lower**2) / math.sqrt(2 * math.pi)
        pdf_up = math.exp(-0.5 * upper**2) / math.sqrt(2 * math.pi)
        var = 1 - (upper * pdf_up - lower * pdf_lo) / z - ((pdf_lo - pdf_up) / z) ** 2
        scale = std / math.sqrt(var)
        # Inverse-CDF sampling: a uniform in erf-space maps to the truncated normal.
        tensor.uniform_(math.erf(lower / math.sqrt(2)), math.erf(upper / math.sqrt(2)))
        tensor.erfinv_().mul_(math.sqrt(2) * scale)
        return tensor.clamp_(lower * scale, upper * scale)


def swiglu_width(hidden_size: int, expansion: float) -> int:
    """Inner width of a SwiGLU: the 2/3 rule, then rounded up to a multiple of 256."""
    inner = round(expansion * hidden_size * 2 / 3)
    return -(-inner // 256) * 256


class Linear(nn.Module):
    """Linear layer with truncated LeCun-normal init (std 1/sqrt(fan_in)); bias, if any, starts at zero."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        fastpaths.prepare()  # before torch.compile traces the operations' conditions
        self.weight = nn.Parameter(trunc_normal_(torch.empty(out_features, in_features), std=in_features**-0.5))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else cast(self.bias, x.dtype)
        return ops.linear(x, cast(self.weight, x.dtype), bias)


class Embedding(nn.Module):
    """A table of vectors with truncated-normal init (fp32), looked up in the forward dtype."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(trunc_normal_(torch.empty(num_embeddings, embedding_dim), std=init_std))

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows of the table cast to dtype, as the reference's CastedEmbedding gathers them: the cast is of the
        table, not of the gathered rows (the same values), and the table's gradient is summed in dtype."""
        table = cast(self.weight, dtype)
        if ids.device.type == devices.CUDA and table.shape[0] <= SMALL_TABLE:
            return _SmallTableLookup.apply(ids, table)
        return F.embedding(ids, table)


#: Tables of at most this many rows (TRM's vocabularies, the byte transformer's 257) take their gradient on CUDA as
#: a product with the lookups' one-hot matrix (_SmallTableLookup).
SMALL_TABLE = 512


class _SmallTableLookup(torch.autograd.Function):
    """F.embedding(ids, table), the table's gradient as the product onehot(ids)^T @ grad: for a table of few rows
    PyTorch's embedding backward sorts the ids and sums each row's segment, several times slower on a GPU than the
    product. Summed in fp32 inside the product and rounded once to the table's dtype, as that backward rounds, in
    another order."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.rows = table.shape[0]
        return F.embedding(ids, table)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        (ids,) = ctx.saved_tensors
        rows = ctx.rows + -ctx.rows % 8  # the one-hot's rows of 16 bytes: cuBLAS's aligned kernels
        onehot = (ids.reshape(-1, 1) == torch.arange(rows, device=ids.device)).to(grad.dtype)
        return None, (onehot.t() @ grad.reshape(-1, grad.shape[-1]))[: ctx.rows]


class SparseEmbedding(nn.Module):
    """A zero-initialised table trained outside autograd's parameter list, one row per identifier.

    The table is a persistent buffer, so it is in the state dict but not in `parameters()`: the main optimizer
    never sees it (and it is not counted as a parameter). In training, each forward gathers the rows it needs
    into a fresh leaf tensor that receives their gradient; those leaves pile up across accumulated micro-batches
    until a sparse optimizer (raytrm.train.optim.SignSGD) consumes them with `sparse_grad()` and
    `clear_grad()`, so 4 micro-batches of 8 give the same update as one batch of 32.
    """

    weight: torch.Tensor

    # More forwards than any accumulation uses: reaching it means nobody consumes the gradients (a leak).
    max_pending = 1024

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(num_embeddings, embedding_dim))
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight[ids]  # advanced indexing: a copy, so a leaf of its own
        if self.training and torch.is_grad_enabled():
            if len(self._pending) >= self.max_pending:
                raise RuntimeError(
                    f"{len(self._pending)} forwards of a sparse embedding without an optimizer step: call "
                    "SignSGD.step() or zero_grad() (or SparseEmbedding.clear_grad()) after each step"
                )
            rows.requires_grad_()
            self._pending.append((ids, rows))
        return rows

    def sparse_grad(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids [N], grads [N, dim]) of every row gathered since the last clear, or None if none has a gradient."""
        seen = [(ids, rows.grad) for ids, rows in self._pending if rows.grad is not None]
        if not seen:
            return None
        return torch.cat([ids for ids, _ in seen]), torch.cat([grad for _, grad in seen])

    def clear_grad(self) -> None:
        self._pending.clear()

    def adopt_pending(self, other: SparseEmbedding) -> None:
        """Take over the rows another embedding on the same table gathered (a replica's), after this one's own."""
        self._pending.extend(other._pending)
        other._pending.clear()


class RotaryEmbedding(nn.Module):
    """RoPE tables (cos, sin) for positions [0, max_positions), in fp32, in the rotate-half layout."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin


class SwiGLU(nn.Module):
    """down(silu(gate) * up), with gate and up from one fused projection."""

    def __init__(self, hidden_size: int, expansion: float) -> None:
        super().__init__()
        inner = swiglu_width(hidden_size, expansion)
        self.gate_up_proj = Linear(hidden_size, 2 * inner)
        self.down_proj = Linear(inner, hidden_size)

    def _weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return cast(self.gate_up_proj.weight, dtype), cast(self.down_proj.weight, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.swiglu(x, *self._weights(x.dtype))

    def add_norm(self, x: torch.Tensor, eps: float, then: torch.Tensor | None = None) -> torch.Tensor:
        """rms_norm(x + self(x), eps): the SwiGLU with the residual add and norm after it (a post-norm block's); plus
        `then`, where given, as a separate add would give it."""
        return ops.swiglu_add_norm(x, *self._weights(x.dtype), eps, then)

    def forward_columns(self, x: torch.Tensor) -> torch.Tensor:
        """The same map applied to every column of a 2-D x [hidden, N], i.e. forward(x.T).T without transposes."""
        return ops.swiglu_columns(x, *self._weights(x.dtype))

    def mix_norm(self, cols: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(cols + self.forward_columns(cols), eps, dim=0): TRM-MLP's position mixing over cols [positions,
        N] with the residual add and the norm over positions."""
        return ops.mix_positions_norm(cols, *self._weights(cols.dtype), eps)


class Attention(nn.Module):
    """Multi-head self-attention on x [B, L, D] with a fused qkv projection, optional RoPE and PyTorch's SDPA."""

    def __init__(self, hidden_size: int, num_heads: int, causal: bool = False) -> None:
        super().__init__()
        assert hidden_size % num_heads == 0, "hidden_size must be a multiple of num_heads"
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.causal = causal
        self.qkv_proj = Linear(hidden_size, 3 * hidden_size)
        self.o_proj = Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if rope is None:
            qk, v = ops.split_heads(self.qkv_proj(x), self.num_heads)
            q, k = qk.split(self.num_heads, dim=-2)
            out = ops.attend(q, k, v, self.causal)
        else:
            w_qkv = cast(self.qkv_proj.weight, x.dtype)
            out = ops.attention(x, w_qkv, rope[0], rope[1], self.num_heads, self.causal)
        return self.o_proj(out)
