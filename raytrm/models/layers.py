"""Shared layers of raytrm's models: norm, linear, embeddings, SwiGLU, RoPE and attention.

Weights are kept in fp32 (the master copy); a layer casts them to the dtype of its input only when that differs,
so a bf16 forward reads fp32 weights the way the TRM reference does, and an fp32 forward pays for no casts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from raytrm.models import cublaslt, gated, kernels, onednn, rotary_qkv


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, without a call or a copy when it already is."""
    return t if t.dtype == dtype else t.to(dtype)


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


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision tensors, the tensor's own dtype for fp32 and fp64."""
    return torch.promote_types(dtype, torch.float32)


def _rms_scale(h: torch.Tensor, eps: float, dim: int) -> torch.Tensor:
    """1 / sqrt(mean(h^2) + eps) along dim, accumulated in fp32 (or fp64), in one pass over h where it can be.

    On a CPU, vector_norm across the outer dimension of a matrix (TRM-MLP's norm over positions) runs 6 to 26 times
    slower than squaring and summing, so that reduction squares first; along the last dimension vector_norm's one
    pass is the faster.
    """
    acc = _accumulation_dtype(h.dtype)
    if h.device.type == "cpu" and dim % h.dim() != h.dim() - 1:
        squares = cast(h, acc).square().sum(dim, keepdim=True)
    else:
        squares = torch.linalg.vector_norm(h, dim=dim, keepdim=True, dtype=acc).square_()
    return squares.div_(h.shape[dim]).add_(eps).rsqrt_()


def _rms_norm_backward(g: torch.Tensor, y: torch.Tensor, r: torch.Tensor, dim: int) -> torch.Tensor:
    """The gradient of y = h * r(h) with respect to h: r * (g - y * mean(g * y)), three passes over y."""
    m = (g * y).mean(dim, keepdim=True)
    return torch.addcmul(g, y, m, value=-1).mul_(r)


class _RMSNorm(torch.autograd.Function):
    """rms_norm(x) with a hand-written backward: the norm, then one multiply, forward.

    fp32 and fp64 keep the output y and the scale r (the projection that reads y keeps it anyway). Half precision
    rounds once, from the fp32 product to x's dtype, as the plain formula does, and keeps x, from which backward
    recomputes the fp32 y: the gradient is the plain formula's, and no fp32 copy of the activation is kept.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float, dim: int) -> torch.Tensor:
        r = _rms_scale(x, eps, dim)
        y = torch.mul(x, r, out=torch.empty_like(x))
        ctx.half = r.dtype != x.dtype
        ctx.save_for_backward(x if ctx.half else y, r)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, r = ctx.saved_tensors
        y = saved * r if ctx.half else saved
        return cast(_rms_norm_backward(g, y, r, ctx.dim), g.dtype), None, None


def rms_norm(x: torch.Tensor, eps: float, dim: int = -1) -> torch.Tensor:
    """RMSNorm without a learned scale, computed in fp32 and returned in x's dtype (plain under torch.compile)."""
    if not torch.compiler.is_compiling():
        return _RMSNorm.apply(x, eps, dim)
    h = cast(x, torch.float32)
    h = h * torch.rsqrt(h.square().mean(dim, keepdim=True) + eps)
    return cast(h, x.dtype)


class _AddRMSNorm(torch.autograd.Function):
    """rms_norm(x + f) in fp32 with a hand-written backward.

    Autograd's version of the same formula keeps the sum, its square and the scale, and runs about six passes over
    the activation in backward; this one keeps only the output y and the scale r, and runs three, using
    d/dh = r * (g - y * mean(g * y)). On a CPU, where these passes are bound by memory bandwidth, that is a few
    percent of a TRM step.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, f: torch.Tensor, eps: float, dim: int) -> torch.Tensor:
        h = x + f
        # The norm needs no squared copy of h; then h is ours to scale in place.
        r = _rms_scale(h, eps, dim)
        y = h.mul_(r)
        ctx.save_for_backward(y, r)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, r = ctx.saved_tensors
        grad = _rms_norm_backward(g, y, r, ctx.dim)
        return grad, grad, None, None


def add_rms_norm(x: torch.Tensor, f: torch.Tensor, eps: float, dim: int = -1) -> torch.Tensor:
    """rms_norm(x + f, eps, dim): a residual add and the norm after it, fused where the states are fp32 (or fp64).

    Under torch.compile the plain formula is traced instead: inductor fuses it and derives its backward itself, and
    a hand-written autograd.Function would only cut the graph.
    """
    if x.dtype == f.dtype and x.dtype in (torch.float32, torch.float64) and not torch.compiler.is_compiling():
        return _AddRMSNorm.apply(x, f, eps, dim)
    # Half-precision states add in their dtype, as the reference does, then normalise in fp32.
    return rms_norm(x + f, eps, dim)


class _SwiGLUGate(torch.autograd.Function):
    """silu(gate) * up for gate and up the two halves of one projection, split along dim.

    Autograd's version saves silu(gate) beside the projection and ends its backward by concatenating the two halves'
    gradients into a new tensor; this one saves only the projection, recomputes silu(gate) in backward, and writes
    both halves' gradients straight into one buffer.
    """

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, dim: int) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim)
        ctx.save_for_backward(gate_up)
        ctx.dim = dim
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, ctx.dim)
        grad = torch.empty_like(gate_up)
        grad_gate, grad_up = grad.chunk(2, ctx.dim)
        torch.ops.aten.silu_backward.grad_input(g * up, gate, grad_input=grad_gate)
        torch.ops.aten.silu.out(gate, out=grad_up)
        grad_up.mul_(g)
        return grad, None


def swiglu_gate(gate_up: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """silu(gate) * up, where gate and up are the two halves of gate_up along dim.

    On CUDA in half precision a Triton operator computes it, eager or compiled (raytrm.models.kernels); elsewhere,
    plain under torch.compile and an autograd function with a hand-written backward without.
    """
    if kernels.fused_gate_available(gate_up, dim):
        return kernels.swiglu_gate(gate_up, dim)
    if torch.compiler.is_compiling():
        gate, up = gate_up.chunk(2, dim)
        return F.silu(gate) * up
    return _SwiGLUGate.apply(gate_up, dim)


def swiglu_width(hidden_size: int, expansion: float) -> int:
    """Inner width of a SwiGLU: the 2/3 rule, then rounded up to a multiple of 256."""
    inner = round(expansion * hidden_size * 2 / 3)
    return -(-inner // 256) * 256


class Linear(nn.Module):
    """Linear layer with truncated LeCun-normal init (std 1/sqrt(fan_in)); bias, if any, starts at zero.

    In fp32 on an AMD x86-64 CPU its products run on oneDNN (raytrm.models.onednn), faster than MKL's there; in half
    precision on an NVIDIA GPU, on cuBLASLt with the algorithm measured fastest for each shape (raytrm.models.cublaslt).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        onednn.register_flops()
        cublaslt.register()
        self.weight = nn.Parameter(trunc_normal_(torch.empty(out_features, in_features), std=in_features**-0.5))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else cast(self.bias, x.dtype)
        weight = cast(self.weight, x.dtype)
        out_features = weight.shape[0]
        padding = -out_features % 8
        if padding and x.device.type == "cuda" and x.dtype in (torch.float16, torch.bfloat16):
            # Outputs of a width that is no multiple of 8 (TRM's heads: the vocabulary's 11, halting's 2) come from
            # zero rows padded to one: cuBLAS's kernels for unaligned widths took 60 to 83 us a call at Sudoku's
            # batch on an H200; aligned, the vocabulary head's forward over every position takes 28, its gradients'
            # products under 11 each.
            weight = F.pad(weight, (0, 0, 0, padding))
            bias = None if bias is None else F.pad(bias, (0, padding))
            return self._product(x, weight, bias)[..., :out_features]
        return self._product(x, weight, bias)

    @staticmethod
    def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is None and cublaslt.serves(x, weight):
            return cublaslt.linear(x, weight)
        return onednn.linear(x, weight, bias)


class Embedding(nn.Module):
    """A table of vectors with truncated-normal init (fp32), looked up in the forward dtype."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(trunc_normal_(torch.empty(num_embeddings, embedding_dim), std=init_std))

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows of the table cast to dtype, as the reference's CastedEmbedding gathers them: the cast is of the
        table, not of the gathered rows (the same values), and the table's gradient is summed in dtype."""
        table = cast(self.weight, dtype)
        if ids.device.type == "cuda" and table.shape[0] <= SMALL_TABLE:
            return _SmallTableLookup.apply(ids, table)
        return F.embedding(ids, table)


#: Tables of at most this many rows (TRM's vocabularies, the byte transformer's 257) take their gradient on CUDA as
#: a product with the lookups' one-hot matrix (_SmallTableLookup).
SMALL_TABLE = 512


class _SmallTableLookup(torch.autograd.Function):
    """F.embedding(ids, table), the table's gradient as the product onehot(ids)^T @ grad: for a table of few rows
    PyTorch's embedding backward sorts the ids and sums each row's segment, 199-202 us at TRM's Sudoku batch on an
    H200 (62,208 lookups of 11 rows), where the product takes 24. Summed in fp32 inside the product and rounded
    once to the table's dtype, as that backward rounds, in another order."""

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


class _Rotary(torch.autograd.Function):
    """x rotated by position, from the first halves of rotate-half tables; backward is the inverse rotation.

    With c and s the tables' halves, the rotation is (x1 c - x2 s, x2 c + x1 s): two fused multiply-adds per half,
    written into one output, where the textbook x cos + rotate_half(x) sin negates, concatenates and multiplies
    whole copies (and autograd undoes each of those in backward). Half-precision x rotates in fp32 and is rounded
    once, as the textbook formula computed in fp32 is.
    """

    @staticmethod
    def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        if c.dtype != x.dtype:
            # One cast each way: kernels mixing a half-precision x with fp32 tables run slower on a GPU (H200:
            # 0.97 ms against 0.80 ms for the cast, the rotation and the cast back, at [64, 1024, 16, 64]).
            return _Rotary._rotate(x.to(c.dtype), c, s).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        out1, out2 = out.chunk(2, dim=-1)
        torch.mul(x1, c, out=out1).addcmul_(x2, s, value=-1)
        torch.mul(x2, c, out=out2).addcmul_(x1, s)
        return out

    @staticmethod
    def forward(ctx, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(c, s)
        return _Rotary._rotate(x, c, s)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        c, s = ctx.saved_tensors
        return _Rotary._rotate(g, c, -s), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., head_dim] by position; cos and sin broadcast against x. In fp32, returned in x's dtype.

    The tables are in the rotate-half layout of RotaryEmbedding (both halves of the last dimension equal).
    Half-precision inputs rotate in fp32, as the reference does.
    """
    half = x.shape[-1] // 2
    if not torch.compiler.is_compiling():
        acc = _accumulation_dtype(x.dtype)
        return _Rotary.apply(x, cast(cos[..., :half], acc), cast(sin[..., :half], acc))
    # Under torch.compile the textbook formula, which inductor fuses into one kernel.
    h = cast(x, torch.float32)
    h1, h2 = h.chunk(2, dim=-1)
    return cast(h * cos + torch.cat((-h2, h1), dim=-1) * sin, x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate) * up), with gate and up from one fused projection."""

    def __init__(self, hidden_size: int, expansion: float) -> None:
        super().__init__()
        inner = swiglu_width(hidden_size, expansion)
        kernels.register()  # the gate's operator, where Triton is installed
        gated.register()  # the gate/up product with its gate, where a Hopper GPU and nvcc are
        self.gate_up_proj = Linear(hidden_size, 2 * inner)
        self.down_proj = Linear(inner, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._gated(x)
        return self._down(self.gate_up_proj(x)) if y is None else y

    def add_norm(self, x: torch.Tensor, eps: float, then: torch.Tensor | None = None) -> torch.Tensor:
        """rms_norm(x + self(x), eps): the SwiGLU with the residual add and norm after it (a post-norm block's); plus
        `then`, where given, as a separate add would give it."""
        f = self._gated(x)
        if f is None:
            gate_up = self.gate_up_proj(x)
            w_down = self.down_proj.weight
            if self.down_proj.bias is None and kernels.fused_swiglu_down_norm_available(x, gate_up, w_down.shape, then):
                # On CUDA, without a graph: the add and norm (and then's add) in the down projection's epilogue too.
                return kernels.swiglu_down_norm(gate_up, cast(w_down, x.dtype), x, eps, then)
            f = self._down(gate_up)
        y = add_rms_norm(x, f, eps)
        return y if then is None else y + then

    def _gated(self, x: torch.Tensor) -> torch.Tensor | None:
        """The SwiGLU of x with its gate/up product and gate in one kernel (raytrm.models.gated), where that serves
        x (bf16 on a Hopper GPU, hidden 512): without a gradient its h goes to the down projection; with one, h and
        gate_up, and the down projection's backward kernel gives gate_up's gradient (kernels.swiglu_down_after_gate).
        None elsewhere: the product and the gate apart (add_norm, _down)."""
        w_gate_up = self.gate_up_proj.weight
        if self.gate_up_proj.bias is not None or self.down_proj.bias is not None or not gated.serves(x, w_gate_up):
            return None
        w_gate_up = cast(w_gate_up, x.dtype)
        if not torch.is_grad_enabled():
            return self.down_proj(gated.gated_swiglu(x, w_gate_up)[0])
        if not kernels.fused_swiglu_down_after_gate_available(x):
            return None
        h, gate_up = gated.gated_swiglu(x, w_gate_up, keep_gate_up=True)
        return kernels.swiglu_down_after_gate(gate_up, h, cast(self.down_proj.weight, x.dtype))

    def _down(self, gate_up: torch.Tensor) -> torch.Tensor:
        w_down = self.down_proj.weight
        if self.down_proj.bias is None and kernels.fused_swiglu_down_available(gate_up, w_down.shape):
            # On CUDA: the gate inside the down projection's product (forward) or its epilogue (backward).
            return kernels.swiglu_down(gate_up, cast(w_down, gate_up.dtype))
        return self.down_proj(swiglu_gate(gate_up, dim=-1))

    def forward_columns(self, x: torch.Tensor) -> torch.Tensor:
        """The same map applied to every column of a 2-D x [hidden, N], i.e. forward(x.T).T without transposes.

        Mixing along a leading dimension this way is a plain matrix product on a contiguous tensor.
        """
        gate_up = torch.mm(cast(self.gate_up_proj.weight, x.dtype), x)
        return torch.mm(cast(self.down_proj.weight, x.dtype), swiglu_gate(gate_up, dim=0))


def mix_columns_in_blocks(mlp: SwiGLU, cols: torch.Tensor, eps: float, block: int) -> torch.Tensor:
    """add_rms_norm(cols, mlp.forward_columns(cols), eps, dim=0) for cols [positions, N], `block` columns at a time.

    Every column is mixed and normalised alone, so this is the whole-matrix formula; only the BLAS may sum a narrow
    block's products in another order, and the weights' gradients add up block by block (within fp32 rounding).
    What changes is that a block's [2 * inner, block] gate/up product stays in the CPU's cache for the gate, the
    second product and the norm, forward and backward, where the whole one (32 MB at Sudoku's 97 positions, batch
    16, hidden 512) does not.
    """
    if cols.shape[1] <= block:
        return add_rms_norm(cols, mlp.forward_columns(cols), eps, dim=0)
    parts = cols.split(block, dim=1)
    return torch.cat([add_rms_norm(part, mlp.forward_columns(part), eps, dim=0) for part in parts], dim=1)


class Attention(nn.Module):
    """Multi-head self-attention on x [B, L, D] with a fused qkv projection, optional RoPE and PyTorch's SDPA."""

    def __init__(self, hidden_size: int, num_heads: int, causal: bool = False) -> None:
        super().__init__()
        assert hidden_size % num_heads == 0, "hidden_size must be a multiple of num_heads"
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.causal = causal
        kernels.register()  # the RoPE operator, where Triton is installed
        gated.register()  # the projection with RoPE in its epilogue (rotary_qkv), where a Hopper GPU and nvcc are
        self.qkv_proj = Linear(hidden_size, 3 * hidden_size)
        self.o_proj = Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        H, L = self.num_heads, x.shape[1]
        w_qkv = self.qkv_proj.weight
        if (
            rope is not None
            and self.qkv_proj.bias is None
            and rotary_qkv.serves(x, w_qkv, rope[0], rope[1], H, self.causal)
        ):
            # q and k rotated in the projection's epilogue, so the attention's kernels take them as they are.
            return self.o_proj(rotary_qkv.attention(x, cast(w_qkv, x.dtype), rope[0], rope[1], H))
        qkv = self.qkv_proj(x)
        if rope is not None and kernels.fused_attention_available(qkv, self.head_dim, self.causal):
            return self.o_proj(kernels.rope_attention(qkv, rope[0], rope[1], H))
        if rope is not None and kernels.fused_rope_available(qkv, self.head_dim):
            q, k, v = kernels.rope_qkv(qkv, rope[0], rope[1], H)
        else:
            qkv = qkv.unflatten(-1, (3 * H, self.head_dim))
            v = qkv[..., 2 * H :, :]
            qk = qkv[..., : 2 * H, :]
            if rope is not None:
                # q and k share the rotation, so they are rotated in one pass.
                qk = apply_rotary(qk, rope[0][:L, None], rope[1][:L, None])
            q, k = qk.split(H, dim=-2)
        # SDPA takes [B, heads, L, head_dim]; these transposes are views, in the strides its kernels read natively.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal
        )
        return self.o_proj(out.transpose(1, 2).flatten(-2))
