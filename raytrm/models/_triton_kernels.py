"""Triton kernels (imported only where Triton is installed); see raytrm.models.kernels for what they compute.

Under Triton's CPU interpreter (INTERPRETED), products take fp32 operands (its bf16 products are wrong) and the
rounding to bf16 is done on the bits (it truncates); on a GPU both are the hardware's.
"""

import triton
import triton.language as tl

from raytrm.models.kernels import interpreted


@triton.jit
def _rounded(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """v (fp32) rounded to dtype, to nearest even, and back to fp32."""
    if INTERPRETED:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def _sigmoid(v, INTERPRETED: tl.constexpr):
    """sigmoid(v) in fp32 from the hardware's approximate 2^x and 1/x (each within 2 ulp of fp32, far inside the
    bf16 rounding that follows).

    tl.sigmoid's 1 / (1 + exp(-v)) is a full division. With it, on an H200 at Sudoku's shapes, the fused mixing ran
    0.505 ms against 0.419 (the same error against exact products), the feature gate 0.207 against 0.175 ms and its
    backward 0.315 against 0.285, the mixing gate 0.337 against 0.297 and its backward 0.528 against 0.494 (the gates
    to the same bits)."""
    if INTERPRETED:
        return 1.0 / (1.0 + tl.exp(-v))
    else:
        e = tl.exp2(-1.4426950408889634 * v)
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def _gated(gate, up, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """silu(gate) * up (fp32), rounded to dtype where the plain formula rounds: silu(gate), then the product."""
    silu = _rounded(gate * _sigmoid(gate, INTERPRETED), dtype, INTERPRETED)
    return _rounded(silu * up, dtype, INTERPRETED)


@triton.jit
def _gate_gradients(gate, up, g, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """The gradients of silu(gate) * up (fp32 operands) for its gradient g: d gate = (g * up) * s * (1 + gate *
    (1 - s)) and d up = silu(gate) * g, with s = sigmoid(gate), rounded where the plain formulas' backward rounds
    (g * up, silu(gate) and each result)."""
    s = _sigmoid(gate, INTERPRETED)
    g_up = _rounded(g * up, dtype, INTERPRETED)
    grad_gate = _rounded(g_up * s * (1 + gate * (1 - s)), dtype, INTERPRETED)
    grad_up = _rounded(_rounded(gate * s, dtype, INTERPRETED) * g, dtype, INTERPRETED)
    return grad_gate, grad_up


@triton.jit
def _add_rms_norm(x, f, length, eps, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """rms_norm(x + f) along the rows of fp32 tiles as the eager formulas compute it: the sum rounded to dtype, the
    norm over `length` entries in fp32 (a row's entries past it are zeros), the result rounded to dtype."""
    s = _rounded(x + f, dtype, INTERPRETED)
    r = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / length + eps)
    return _rounded(s * r[:, None], dtype, INTERPRETED)


@triton.jit
def _operand(v, INTERPRETED: tl.constexpr):
    """v as an operand of tl.dot."""
    if INTERPRETED:
        return v.to(tl.float32)
    else:
        return v


# Tiles of 64 inner rows (BLOCK_I, passed by the caller) were the fastest of 99 tiles measured on an H200 at
# Sudoku's shape (97 positions, 393,216 columns, inner 512): 0.51 to 0.53 ms for these four, 0.54 ms and more for the
# rest. They differ only in columns per program, warps and pipeline stages, which leave the order of every sum
# alone: on the H200 the four gave the same bits at three shapes, so a run's numbers do not depend on the pick.
_CONFIGS = [
    triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
    for n, w, s in ((128, 8, 4), (64, 4, 2), (128, 8, 2), (128, 8, 3))
]
#: Inner rows per step of the kernel's loop: fixed, since it sets the order of the second product's sum.
BLOCK_I = 64


@triton.autotune(configs=_CONFIGS[1:2] if interpreted() else _CONFIGS, key=["N", "L", "I"])
@triton.jit
def mix_positions_norm_kernel(
    x_ptr,
    w_gate_up_t_ptr,
    w_down_t_ptr,
    y_ptr,
    N,
    L,
    I,  # noqa: E741 (the SwiGLU's inner width)
    eps,
    BLOCK_L: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_I: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """y = rms_norm(x + w_down @ (silu(gate) * up), over rows), [gate; up] = w_gate_up @ x, for a block of columns.

    x and y are [L, N]; the weights come transposed and zero-padded to BLOCK_L positions: w_gate_up_t [BLOCK_L, 2I]
    and w_down_t [I, BLOCK_L]. A block of columns is the rows of the products ([BLOCK_N, BLOCK_L] @
    [BLOCK_L, BLOCK_I], then [BLOCK_N, BLOCK_I] @ [BLOCK_I, BLOCK_L]), the long side the tensor cores want.
    """
    dtype = y_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_L)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (cols < N)[:, None] & (rows < L)[None, :]
    x = tl.load(x_ptr + rows[None, :] * N + cols[:, None], mask=mask, other=0.0)  # [BLOCK_N, BLOCK_L]
    x_operand = _operand(x, INTERPRETED)
    acc = tl.zeros((BLOCK_N, BLOCK_L), dtype=tl.float32)
    inner = tl.arange(0, BLOCK_I)
    for start in range(0, I, BLOCK_I):
        k = start + inner
        w_gate = tl.load(w_gate_up_t_ptr + rows[:, None] * (2 * I) + k[None, :])  # [BLOCK_L, BLOCK_I]
        w_up = tl.load(w_gate_up_t_ptr + rows[:, None] * (2 * I) + (k + I)[None, :])
        w_down = tl.load(w_down_t_ptr + k[:, None] * BLOCK_L + rows[None, :])  # [BLOCK_I, BLOCK_L]
        # Rounded where the plain formula rounds: the projection, then the gate (_gated).
        gate = _rounded(tl.dot(x_operand, _operand(w_gate, INTERPRETED)), dtype, INTERPRETED)
        up = _rounded(tl.dot(x_operand, _operand(w_up, INTERPRETED)), dtype, INTERPRETED)
        h = _gated(gate, up, dtype, INTERPRETED).to(dtype)
        acc = tl.dot(_operand(h, INTERPRETED), _operand(w_down, INTERPRETED), acc)
    # The residual adds in the states' dtype; the norm over positions accumulates in fp32.
    y = _add_rms_norm(x.to(tl.float32), _rounded(acc, dtype, INTERPRETED), L, eps, dtype, INTERPRETED).to(dtype)
    tl.store(y_ptr + rows[None, :] * N + cols[:, None], y, mask=mask)


@triton.jit
def _gate_tile(pid, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program pid's tile of a [R, C] gate: its rows (int64), its columns, and the mask of those inside."""
    column_blocks = tl.cdiv(C, BLOCK_C)
    r = (pid // column_blocks).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (pid % column_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    return r, c, (r < R)[:, None] & (c < C)[None, :]


# Tiles of 16 rows x 256 columns: on an H200 the fastest of seven shapes at both of TRM's gates, measured with
# tl.sigmoid (0.186 ms at the feature SwiGLU's [74,496, 2 x 1536], 0.311 ms at the mixing's [2 x 512, 393,216];
# inductor's plain formula 0.216 and 0.435 ms, one row a program 0.216 and 0.340 ms).
GATE_BLOCK_R, GATE_BLOCK_C, GATE_WARPS = 16, 256, 4


@triton.jit
def swiglu_gate_kernel(
    gate_up_ptr,
    out_ptr,
    R,
    C,
    row_stride,
    up_offset,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """out[r, c] = silu(gate) * up, gate at gate_up[r * row_stride + c] and up up_offset after it; out is [R, C].

    One program per tile of BLOCK_R rows and BLOCK_C columns. In fp32, rounded where the plain formula rounds:
    silu(gate), then the product.
    """
    dtype = out_ptr.dtype.element_ty
    r, c, mask = _gate_tile(tl.program_id(0), R, C, BLOCK_R, BLOCK_C)
    offset = r[:, None] * row_stride + c[None, :]
    gate = tl.load(gate_up_ptr + offset, mask=mask).to(tl.float32)
    up = tl.load(gate_up_ptr + offset + up_offset, mask=mask).to(tl.float32)
    tl.store(out_ptr + r[:, None] * C + c[None, :], _gated(gate, up, dtype, INTERPRETED).to(dtype), mask=mask)


@triton.jit
def swiglu_gate_backward_kernel(
    gate_up_ptr,
    grad_ptr,
    grad_gate_up_ptr,
    R,
    C,
    row_stride,
    up_offset,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The gradient of swiglu_gate_kernel's output with respect to gate_up, laid out as gate_up (same tiles; the
    formulas are _gate_gradients')."""
    dtype = grad_gate_up_ptr.dtype.element_ty
    r, c, mask = _gate_tile(tl.program_id(0), R, C, BLOCK_R, BLOCK_C)
    offset = r[:, None] * row_stride + c[None, :]
    gate = tl.load(gate_up_ptr + offset, mask=mask).to(tl.float32)
    up = tl.load(gate_up_ptr + offset + up_offset, mask=mask).to(tl.float32)
    g = tl.load(grad_ptr + r[:, None] * C + c[None, :], mask=mask).to(tl.float32)
    grad_gate, grad_up = _gate_gradients(gate, up, g, dtype, INTERPRETED)
    tl.store(grad_gate_up_ptr + offset, grad_gate.to(dtype), mask=mask)
    tl.store(grad_gate_up_ptr + offset + up_offset, grad_up.to(dtype), mask=mask)


#: How the SwiGLU's down projection runs with the gate in it: (rows, columns, inner step) of a tile, warps, pipeline
#: stages. Measured on an H100 at TRM's shape ([74,496 x 2 x 1536] gate_up, 512 outputs; 2026-11-25, build scripts
#: timing medians of do_bench over three inputs; every configuration gave the same bits as the gate operator with
#: cuBLAS's product), the fastest of the tilings tried (64 to 256 rows, 64 to 512 columns, inner steps of 32 to 128,
#: 4 or 8 warps, 2 to 4 stages; persistent or not, with and without Triton's warp specialisation):
#: - forward (the gate on the way in): 0.345 ms against 0.393 for the gate operator (0.232) and cuBLAS (0.166). A
#:   one-op sigmoid (tanh.approx) took 0.334 ms, moving some results by a bf16 step; a reciprocal by Newton's
#:   iterations instead of the hardware's, 0.348; persistent programs, 0.46 ms and more.
#: - backward (the gate's backward in the epilogue of the input gradient's product): 0.510 ms against 0.577 for
#:   cuBLAS (0.194) and the gate's backward operator. With its tiles loaded and stored as TMA copies (tensor
#:   descriptors), 0.443 ms at 3 stages against 0.516-0.524 with pointer loads at 4, to the same bits (2026-11-25,
#:   build/down_tma_probe.py; 4 stages 0.516, tiles of 128 rows or 256 columns 0.54 ms and more). The forward's
#:   loads as TMA copies were no faster (0.351 ms against 0.351-0.363).
#: The backward's tiles are the autotuner's pick of SWIGLU_DOWN_BACKWARD's, which give the same bits (their inner
#: steps alike): on an H200 tiles of 128 rows took 388.9 us against 409.6 (2026-11-26, build/config_sweep.py, the
#: fastest of 24), where the H100 above had them slower.
SWIGLU_DOWN = (128, 256, 64, 8, 3)
SWIGLU_DOWN_BACKWARD = ((64, 128, 64, 4, 3), (128, 128, 64, 4, 3))
#: Row blocks of the backward's tiles that run side by side, sharing the weight's column blocks in L2.
SWIGLU_DOWN_GROUP = 8


#: The same with the residual add and RMSNorm in the epilogue (NORM): (rows, inner step) of a tile holding whole
#: rows, warps, stages. 0.389 ms against 0.426 for the kernel above and inductor's add and norm, on the H100 at TRM's
#: shape (build/down_norm_probe.py; 64 rows with inner steps of 32 took 0.49 to 0.51 ms, 32 or 128 rows 0.74 ms and
#: more).
SWIGLU_DOWN_NORM = (64, 64, 8, 3)


@triton.jit
def swiglu_down_kernel(
    gate_up_ptr, w_ptr, out_ptr, x_ptr, then_ptr, M, N, F, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM: tl.constexpr, THEN_ADD: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """out [M, N] = (silu(gate) * up) @ w^T for gate_up [M, 2 * F] (gate, then up, in each row) and w [N, F]: the
    down projection with the gate computed on the way in (_gated, rounded as the gate operator's), so that the
    gate's [M, F] output never goes to memory. With NORM (then BLOCK_N >= N: a tile holds whole rows), out is
    rms_norm(x + that) instead, x [M, N], added in out's dtype and normalised in fp32 as the plain formulas do; with
    THEN_ADD too, out is that norm plus then [M, N], added in out's dtype (the next network's input, which would
    otherwise be a pass of its own). A program takes a tile; a row block's tiles are neighbours, so its gate_up comes
    from memory once. F must be a multiple of BLOCK_K."""
    dtype = out_ptr.dtype.element_ty
    column_blocks = tl.cdiv(N, BLOCK_N)
    rows = ((tl.program_id(0) // column_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    columns = (tl.program_id(0) % column_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    row_mask = (rows < M)[:, None]
    column_mask = (columns < N)[None, :]
    gate_ptr = gate_up_ptr + rows[:, None] * (2 * F) + inner[None, :]
    w_t_ptr = w_ptr + columns[None, :] * F + inner[:, None]  # [BLOCK_K, BLOCK_N] of w^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, F, BLOCK_K):
        gate = tl.load(gate_ptr + k, mask=row_mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptr + k + F, mask=row_mask, other=0.0).to(tl.float32)
        h = _operand(_gated(gate, up, dtype, INTERPRETED).to(dtype), INTERPRETED)
        acc = tl.dot(h, _operand(tl.load(w_t_ptr + k, mask=column_mask, other=0.0), INTERPRETED), acc)
    mask = row_mask & column_mask
    out = _rounded(acc, dtype, INTERPRETED)
    if NORM:
        x = tl.load(x_ptr + rows[:, None] * N + columns[None, :], mask=mask, other=0.0).to(tl.float32)
        out = _add_rms_norm(x, out, N, eps, dtype, INTERPRETED)
        if THEN_ADD:
            then = tl.load(then_ptr + rows[:, None] * N + columns[None, :], mask=mask, other=0.0).to(tl.float32)
            out = _rounded(out + then, dtype, INTERPRETED)
    tl.store(out_ptr + rows[:, None] * N + columns[None, :], out.to(dtype), mask=mask)


#: swiglu_down_kernel with NORM on GPUs that copy tiles with TMA: (rows, inner step) of a tile, warps, stages. Its
#: weight comes in as TMA copies and its epilogue reads x and then and writes out as TMA copies, where the pointer
#: loads' address arithmetic held the programs back. On an H200 at TRM-attention's Sudoku shape (2026-11-26,
#: build/wtma/probe2.py: medians of do_bench over three inputs, three passes, the same bits): 350-363 us a call against
#: 401-420 for swiglu_down_kernel with NORM; with the weight alone by TMA 370-394; with gate_up's loads masked (rows
#: not a multiple of the tile's) 355-387; with gate_up by TMA too, 413-416 (gate and up as two copies a step,
#: build/wtma/probe3.py); x and then loaded before the last inner step, 370-384; 2 stages 514; inner steps of 32, 408
#: and more.
SWIGLU_DOWN_NORM_TMA = (64, 64, 8, 3)


@triton.jit
def swiglu_down_norm_kernel(
    gate_up_ptr, w, x, then, out, M, F, eps, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    THEN_ADD: tl.constexpr, EVEN: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """swiglu_down_kernel's NORM (and THEN_ADD) output, the same bits, with w, x, then and out as descriptors: w [N,
    F] viewed as [N / BOX, BOX, F] (block [N / BOX, BOX, BLOCK_K]), the others [M, N] viewed as [M, N / BOX, BOX]
    (block [BLOCK_M, N / BOX, BOX]), BOX at most 256 (a TMA copy's limit). A program takes BLOCK_M whole rows; EVEN
    when M is a multiple of BLOCK_M (gate_up's loads unmasked)."""
    dtype: tl.constexpr = out.dtype
    row = tl.program_id(0) * BLOCK_M
    rows = (row + tl.arange(0, BLOCK_M)).to(tl.int64)
    gate_ptr = gate_up_ptr + rows[:, None] * (2 * F) + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros((BLOCK_M, N), dtype=tl.float32)
    for k in range(0, F, BLOCK_K):
        if EVEN:
            gate = tl.load(gate_ptr + k).to(tl.float32)
            up = tl.load(gate_ptr + k + F).to(tl.float32)
        else:
            gate = tl.load(gate_ptr + k, mask=(rows < M)[:, None], other=0.0).to(tl.float32)
            up = tl.load(gate_ptr + k + F, mask=(rows < M)[:, None], other=0.0).to(tl.float32)
        h = _operand(_gated(gate, up, dtype, INTERPRETED).to(dtype), INTERPRETED)
        w_t = tl.trans(w.load([0, 0, k]).reshape(N, BLOCK_K))
        acc = tl.dot(h, _operand(w_t, INTERPRETED), acc)
    # x is read after the loop and then after the norm, so that neither is held through the loop (with both read
    # together the program spilled).
    residual = x.load([row, 0, 0]).reshape(BLOCK_M, N).to(tl.float32)
    y = _add_rms_norm(residual, _rounded(acc, dtype, INTERPRETED), N, eps, dtype, INTERPRETED)
    if THEN_ADD:
        y = _rounded(y + then.load([row, 0, 0]).reshape(BLOCK_M, N).to(tl.float32), dtype, INTERPRETED)
    out.store([row, 0, 0], y.to(dtype).reshape(out.block_shape))


def _down_blocks(nargs: dict) -> None:
    """The autotuner's hook before a launch of swiglu_down_backward_kernel: its descriptors' blocks set to the
    config's tiles."""
    m, n, k = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["grad"].block_shape = [m, k]
    nargs["w"].block_shape = [k, n]
    nargs["gate_up"].block_shape = nargs["grad_gate_up"].block_shape = [m, 1, n]


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s, pre_hook=_down_blocks)
        for m, n, k, w, s in (SWIGLU_DOWN_BACKWARD[:1] if interpreted() else SWIGLU_DOWN_BACKWARD)
    ],
    key=["M", "N", "F"],
)
@triton.jit
def swiglu_down_backward_kernel(
    grad, w, gate_up, grad_gate_up, M, N, F, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """grad_gate_up [M, 2 * F] (laid out as gate_up) for grad [M, N], the gradient of swiglu_down_kernel's output:
    the gate's gradient grad @ w (w [N, F]), rounded to gate_up's dtype as a product's output is, goes through the
    gate's backward (_gate_gradients) in the product's epilogue, so that it never goes to memory. A program takes a
    tile of [M, F]; GROUP row blocks' tiles run side by side, sharing w's column blocks. The tensors come as
    descriptors, of blocks [BLOCK_M, BLOCK_K] (grad), [BLOCK_K, BLOCK_N] (w) and [BLOCK_M, 1, BLOCK_N] (gate_up and
    grad_gate_up viewed as [M, 2, F]: gate, then up)."""
    dtype: tl.constexpr = grad_gate_up.dtype
    row_blocks, column_blocks = tl.cdiv(M, BLOCK_M), tl.cdiv(F, BLOCK_N)
    group, within = tl.program_id(0) // (GROUP * column_blocks), tl.program_id(0) % (GROUP * column_blocks)
    group_rows = tl.minimum(row_blocks - group * GROUP, GROUP)
    row = (group * GROUP + within % group_rows) * BLOCK_M
    column = (within // group_rows) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, N, BLOCK_K):
        acc = tl.dot(_operand(grad.load([row, k]), INTERPRETED), _operand(w.load([k, column]), INTERPRETED), acc)
    gate = gate_up.load([row, 0, column]).reshape(BLOCK_M, BLOCK_N).to(tl.float32)
    up = gate_up.load([row, 1, column]).reshape(BLOCK_M, BLOCK_N).to(tl.float32)
    grad_gate, grad_up = _gate_gradients(gate, up, _rounded(acc, dtype, INTERPRETED), dtype, INTERPRETED)
    grad_gate_up.store([row, 0, column], grad_gate.to(dtype).reshape(BLOCK_M, 1, BLOCK_N))
    grad_gate_up.store([row, 1, column], grad_up.to(dtype).reshape(BLOCK_M, 1, BLOCK_N))


@triton.jit
def _rotated_back(g1, g2, c, s, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """The halves g1, g2 (fp32) of a gradient of rotated q or k rotated back (by -angle), each rounded once to
    dtype."""
    r1 = _rounded(g1 * c + g2 * s, dtype, INTERPRETED).to(dtype)
    r2 = _rounded(g2 * c - g1 * s, dtype, INTERPRETED).to(dtype)
    return r1, r2


@triton.jit
def _store_rotated_back(ptr, g1, g2, c, s, mask, HALF: tl.constexpr, INTERPRETED: tl.constexpr):
    """_rotated_back's halves stored at ptr (the first half's columns) and HALF after it."""
    r1, r2 = _rotated_back(g1, g2, c, s, ptr.dtype.element_ty, INTERPRETED)
    tl.store(ptr, r1, mask=mask)
    tl.store(ptr + HALF, r2, mask=mask)


#: Tokens per program of the RoPE kernels (each takes every head of one of q, k and v).
ROPE_BLOCK_T = 16


@triton.jit
def rope_qkv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    T,
    L,
    H,
    table_stride,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """q and k rotated by position, v copied, from qkv [T, 3 * H * 2 * HALF] (T = batch x L tokens) into q, k, v
    [T, H, 2 * HALF]. Program (i, part) takes BLOCK_T tokens of part 0 (q), 1 (k) or 2 (v).

    The rotation, (x1 c - x2 s, x2 c + x1 s) from the first halves of the rotate-half tables (rows table_stride
    apart), is in fp32 and rounded once, as _Rotary's.
    """
    part = tl.program_id(1)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, HALF)[None, None, :]
    mask = (t < T) & (h < H)
    src = qkv_ptr + t * (6 * H * HALF) + (part * H + h) * (2 * HALF) + d
    dst = t * (2 * H * HALF) + h * (2 * HALF) + d
    x1 = tl.load(src, mask=mask)
    x2 = tl.load(src + HALF, mask=mask)
    if part == 2:
        tl.store(v_ptr + dst, x1, mask=mask)
        tl.store(v_ptr + dst + HALF, x2, mask=mask)
    else:
        dtype = x1.dtype
        row = (t % L) * table_stride + d
        c = tl.load(cos_ptr + row, mask=mask).to(tl.float32)
        s = tl.load(sin_ptr + row, mask=mask).to(tl.float32)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        if part == 0:  # noqa: SIM108 (an if statement, as in the backward kernel)
            out = q_ptr + dst
        else:
            out = k_ptr + dst
        tl.store(out, _rounded(a * c - b * s, dtype, INTERPRETED).to(dtype), mask=mask)
        tl.store(out + HALF, _rounded(b * c + a * s, dtype, INTERPRETED).to(dtype), mask=mask)


@triton.jit
def rope_qkv_backward_kernel(
    grad_q_ptr,
    grad_k_ptr,
    grad_v_ptr,
    cos_ptr,
    sin_ptr,
    grad_qkv_ptr,
    T,
    L,
    H,
    table_stride,
    q_stride_b,
    q_stride_l,
    q_stride_h,
    k_stride_b,
    k_stride_l,
    k_stride_h,
    v_stride_b,
    v_stride_l,
    v_stride_h,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """grad_qkv [T, 3 * H * 2 * HALF] from the gradients of rope_qkv_kernel's q, k, v ([batch, L, H, 2 * HALF] in any
    strides with the last one 1): q's and k's rotated back (the rotation by -angle), v's copied."""
    part = tl.program_id(1)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, HALF)[None, None, :]
    mask = (t < T) & (h < H)
    batch, position = t // L, t % L
    dst = grad_qkv_ptr + t * (6 * H * HALF) + (part * H + h) * (2 * HALF) + d
    if part == 0:
        src = grad_q_ptr + batch * q_stride_b + position * q_stride_l + h * q_stride_h + d
    elif part == 1:
        src = grad_k_ptr + batch * k_stride_b + position * k_stride_l + h * k_stride_h + d
    else:
        src = grad_v_ptr + batch * v_stride_b + position * v_stride_l + h * v_stride_h + d
    g1 = tl.load(src, mask=mask)
    g2 = tl.load(src + HALF, mask=mask)
    if part == 2:
        tl.store(dst, g1, mask=mask)
        tl.store(dst + HALF, g2, mask=mask)
    else:
        row = position * table_stride + d
        c = tl.load(cos_ptr + row, mask=mask).to(tl.float32)
        s = tl.load(sin_ptr + row, mask=mask).to(tl.float32)
        _store_rotated_back(dst, g1.to(tl.float32), g2.to(tl.float32), c, s, mask, HALF, INTERPRETED)


#: How the attention kernels may run: (programs per multiprocessor, warps a program, pipeline stages), the autotuner
#: timing them at a shape's first call and keeping the fastest (they give the same bits). A program takes a head at a
#: time, its whole sequence on chip, and then the head num_programs further on, with the loads of its next
#: heads in flight while it computes one; the RoPE tables are loaded once a program. Measured on an H100 at
#: TRM-attention's Sudoku shape (768 x 8 heads of 64, 97 positions; 2026-11-25, build scripts timing medians of
#: do_bench over three inputs in turn):
#: - forward 0.168 to 0.172 ms, against 0.217 to 0.219 for a program per head and for inductor's rotation with
#:   cuDNN's forward. Slower: 2 stages (0.22 ms), 4 warps (spilled), 16 warps (capped at 128 registers, 0.22 ms),
#:   the tables loaded for each head (0.20 ms), each head's queries in two blocks of 64 (spilled, 0.29 ms).
#: - backward 0.435 ms against 0.492, with 2 stages and each gradient stored as soon as it is computed (stored
#:   together at the end, 0.478 ms). Slower: 1 stage (0.45 ms), 3 (1.24 ms or over the shared memory), 16 warps
#:   (spilled, 1.1 ms and more), queries in blocks of 64 or 32 (spilled, 1.0 ms and more).
#: Two to four programs a multiprocessor took the same time as one: a program holds most of its registers.
#: Since the TMA copies and the scale inside the exponent's multiply-add, the forward fits two programs of 4 warps to
#: a multiprocessor without spilling: on an H200 (2026-11-26, build/config_sweep.py, medians of do_bench over three
#: inputs) 138.2 us against 153.5 for (1, 8, 3), the same bits; the other 10 launches of 1-2 programs, 4-8 warps and
#: 2-4 stages took 155.5 us or more, and no backward launch beat (1, 8, 2) (369.5 us against 369.9; 4 warps 785).
#: Loads and stores are TMA copies through tensor descriptors: no address arithmetic and no masks in the programs,
#: and the next heads' tiles land in shared memory. On an H100 (2026-11-25, build/attn_tma_probe.py) the backward
#: took 0.350 ms against 0.437-0.438 with pointer loads (255 registers and 14 spills, against 46), the forward 0.164
#: against 0.169-0.171 (184 registers, against 244), with the same error against an fp32 computation. GPUs before
#: Hopper have no TMA, and Triton turns the copies back into pointer loads: compiled here for an A100 (sm_80, Triton
#: 3.9), those kernels spill far more than the pointer-load ones did (6 KB a thread forward and 13 KB backward,
#: against 0.1 and 3 KB), so such GPUs keep the plain formulas (kernels.TMA_CAPABILITY).
#: The backward works key-major (its scores transposed, keys as rows), where it worked query-major as the forward
#: does: the transposed probabilities and score gradients, the first operands of v's and k's gradients, are then
#: computed where they are used, and only the score gradients go through shared memory transposed (for q's). On an
#: H200 (2026-11-26, build/stbwd/probe.py, medians of do_bench over three inputs, two passes): 322.5-322.9 us against
#: 354.3-355.6; with k's gradient stored before q's 350.6-350.8, with 1 stage 574-585, 3 over the shared memory. In
#: the compiled step (build/stbwd/step_kernel.py, profiled steps in turn) 361-365 us a call against 393-396. Errors
#: against fp64 as before to three digits (build/stbwd/accuracy.py); the products' sums run in another order, and
#: about 1 in 10,000 of qkv's gradients is a bf16 step off the query-major kernel's.
ATTENTION_FORWARD = ((1, 8, 3), (2, 4, 2))
ATTENTION_BACKWARD = ((1, 8, 2),)


def _launches(launches: tuple[tuple[int, int, int], ...]) -> list:
    """The autotuner's configs for the attention kernels' launches (the first alone under the interpreter)."""
    return [
        triton.Config({"PROGRAMS_PER_SM": programs, "STAGES": stages}, num_warps=warps)
        for programs, warps, stages in (launches[:1] if interpreted() else launches)
    ]


@triton.jit
def _rotated(x1, x2, c, s, INTERPRETED: tl.constexpr):
    """The halves of x rotated by position, (x1 c - x2 s, x2 c + x1 s), in fp32, each rounded once to x's dtype
    (as rope_qkv_kernel's) and made a dot operand."""
    dtype = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    r1 = _rounded(a * c - b * s, dtype, INTERPRETED).to(dtype)
    r2 = _rounded(b * c + a * s, dtype, INTERPRETED).to(dtype)
    return _operand(r1, INTERPRETED), _operand(r2, INTERPRETED)


@triton.jit
def _tables(cos_ptr, sin_ptr, L, table_stride, BLOCK_L: tl.constexpr, HALF: tl.constexpr):
    """The first halves of the rotate-half tables for positions [0, BLOCK_L) (zero from L), fp32: c and s."""
    positions = tl.arange(0, BLOCK_L)[:, None]
    table = positions * table_stride + tl.arange(0, HALF)[None, :]
    c = tl.load(cos_ptr + table, mask=positions < L, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + table, mask=positions < L, other=0.0).to(tl.float32)
    return c, s


@triton.jit
def _tile(desc, batch, column, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """A [ROWS, COLUMNS] tile of a [batch, L, width] tensor's descriptor (block [1, ROWS, COLUMNS]): one batch row's
    positions from 0 (zero from L) and the columns from column on."""
    return desc.load([batch, 0, column]).reshape(ROWS, COLUMNS)


@triton.jit
def _put(desc, batch, column, x):
    """Store the tile x at _tile's place (the positions from L are left out)."""
    desc.store([batch, 0, column], x.reshape(1, x.shape[0], x.shape[1]))


@triton.jit
def _put_rotated_back(desc, batch, column, g1, g2, c, s, INTERPRETED: tl.constexpr):
    """_rotated_back's halves stored at column and HALF after it, through a descriptor of block [1, BLOCK_L, HALF]."""
    r1, r2 = _rotated_back(g1, g2, c, s, desc.dtype, INTERPRETED)
    _put(desc, batch, column, r1)
    _put(desc, batch, column + g1.shape[1], r2)


@triton.jit
def _exponent(scores, offset, scale):
    """The raw scores in log2 units less offset (already in log2 units, broadcast over them: the rows' maxima or
    log-sum-exps): one fused multiply-add an element. With the scale applied to the scores first and the offset
    subtracted after, the forward took 162.9-163.2 us against 155.3-155.5 and the backward 343.4-344.1 against
    339.1-340.2, on an H200 at TRM-attention's Sudoku shape (2026-11-26, build/probe_nov26.py: the kernels copied
    with the two ways switched, medians of do_bench over three inputs, two passes each; the same error against an
    fp32 computation)."""
    return scores * (scale * 1.4426950408889634) - offset


@triton.jit
def _halves(qk, batch, column, c, s, BLOCK_L: tl.constexpr, HALF: tl.constexpr, ROTATED: tl.constexpr,
            INTERPRETED: tl.constexpr):  # fmt: skip
    """The halves of q's or k's head at column (dot operands): rotated by position with the tables' halves c and s,
    or as they are where they come ROTATED (the projection rotated them)."""
    x1, x2 = _tile(qk, batch, column, BLOCK_L, HALF), _tile(qk, batch, column + HALF, BLOCK_L, HALF)
    if ROTATED:
        return _operand(x1, INTERPRETED), _operand(x2, INTERPRETED)
    return _rotated(x1, x2, c, s, INTERPRETED)


@triton.jit
def _attention_head(
    head, qk, v_desc, c, s, H, BLOCK_L: tl.constexpr, HALF: tl.constexpr, ROTATED: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """A head of qkv [batch, L, 3 * H * 2 * HALF] (its index batch * H + head), on chip, through descriptors of
    blocks [1, BLOCK_L, HALF] (qk) and [1, BLOCK_L, 2 * HALF] (v_desc): its batch row and first column, q's and k's
    halves rotated by position (_halves), and v."""
    batch = head // H
    column = (head % H) * (2 * HALF)
    width = H * 2 * HALF
    q1, q2 = _halves(qk, batch, column, c, s, BLOCK_L, HALF, ROTATED, INTERPRETED)
    k1, k2 = _halves(qk, batch, width + column, c, s, BLOCK_L, HALF, ROTATED, INTERPRETED)
    v = _tile(v_desc, batch, 2 * width + column, BLOCK_L, 2 * HALF)
    return batch, column, q1, q2, k1, k2, v


@triton.autotune(configs=_launches(ATTENTION_FORWARD), key=["heads", "L", "H", "ROTATED"])
@triton.jit
def rope_attention_kernel(
    qk, v_desc, out_desc, cos_ptr, sin_ptr, lse_ptr, heads, L, H, table_stride, scale, BLOCK_L: tl.constexpr,
    HALF: tl.constexpr, STAGES: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr, ROTATED: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """out [batch, L, H * 2 * HALF] = softmax(q k^T * scale) v, a head at a time (heads = batch * H of them, the
    program's every num_programs-th, the loads of the next STAGES - 1 in flight), the whole sequence (L <= BLOCK_L)
    on chip, q and k rotated by position on the way in; lse [batch * H, BLOCK_L] the rows' log2-sum-exp2 of the
    scores in log2 units, for the backward. The probabilities are rounded to qkv's dtype for the second product (as
    flash attention's kernels do), and their sum divides its fp32 result. qk and v_desc are qkv's descriptors (see
    _attention_head), out_desc out's, of block [1, BLOCK_L, 2 * HALF]. ROTATED: q and k come rotated (the projection
    rotated them: raytrm.models.rotary_qkv). PROGRAMS_PER_SM sets the launch's grid (kernels.attention_launch), not
    the program."""
    c, s = _tables(cos_ptr, sin_ptr, L, table_stride, BLOCK_L, HALF)
    positions = tl.arange(0, BLOCK_L)
    for head in tl.range(tl.program_id(0), heads, tl.num_programs(0), num_stages=STAGES):
        batch, column, q1, q2, k1, k2, v = _attention_head(
            head, qk, v_desc, c, s, H, BLOCK_L, HALF, ROTATED, INTERPRETED
        )
        dtype = v.dtype
        scores = tl.dot(q2, tl.trans(k2), tl.dot(q1, tl.trans(k1)))
        scores = tl.where((positions < L)[None, :], scores, float("-inf"))  # padded keys
        top = tl.max(scores, 1) * (scale * 1.4426950408889634)  # the scale is positive: the same maximum
        p = tl.exp2(_exponent(scores, top[:, None], scale))
        total = tl.sum(p, 1)
        p = _operand(_rounded(p, dtype, INTERPRETED).to(dtype), INTERPRETED)
        out = tl.dot(p, _operand(v, INTERPRETED)) / total[:, None]
        _put(out_desc, batch, column, _rounded(out, dtype, INTERPRETED).to(dtype))
        tl.store(lse_ptr + head * BLOCK_L + positions, top + tl.log2(total))


@triton.autotune(configs=_launches(ATTENTION_BACKWARD), key=["heads", "L", "H", "ROTATED"])
@triton.jit
def rope_attention_backward_kernel(
    qk, v_desc, out_desc, grad_desc, grad_qk, grad_v_desc, cos_ptr, sin_ptr, lse_ptr, heads, L, H, table_stride,
    scale, BLOCK_L: tl.constexpr, HALF: tl.constexpr, STAGES: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr,
    ROTATED: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """grad_qkv [batch, L, 3 * H * 2 * HALF] from grad, the gradient of rope_attention_kernel's out, a head at a
    time as there: the probabilities recomputed from lse, the gradients of v, of the scores and of the rotated q and
    k in fp32 (products of operands rounded to qkv's dtype), q's and k's rotated back (by -angle) and rounded
    once. Descriptors as rope_attention_kernel's: grad_qk and grad_v_desc are grad_qkv's as qk and v_desc are qkv's,
    grad_desc grad's as out_desc is out's. ROTATED: q and k come rotated, as the forward took them; their gradients
    are still rotated back, so grad_qkv is the unrotated projection's gradient."""
    c, s = _tables(cos_ptr, sin_ptr, L, table_stride, BLOCK_L, HALF)
    positions = tl.arange(0, BLOCK_L)
    width = H * 2 * HALF
    for head in tl.range(tl.program_id(0), heads, tl.num_programs(0), num_stages=STAGES):
        batch, column, q1, q2, k1, k2, v = _attention_head(
            head, qk, v_desc, c, s, H, BLOCK_L, HALF, ROTATED, INTERPRETED
        )
        dtype = v.dtype
        # Key-major: the scores transposed, [keys, queries] (padded keys at -inf), so that the transposed
        # probabilities and score gradients, the first operands of v's and k's gradients, are computed in place
        # and only the score gradients go through a transposition, for q's.
        scores_t = tl.dot(k2, tl.trans(q2), tl.dot(k1, tl.trans(q1)))
        scores_t = tl.where((positions < L)[:, None], scores_t, float("-inf"))
        out = _tile(out_desc, batch, column, BLOCK_L, 2 * HALF)
        grad = _tile(grad_desc, batch, column, BLOCK_L, 2 * HALF)
        # d softmax: p * (dp - delta), delta the queries' grad . out.
        delta = tl.sum(grad.to(tl.float32) * out.to(tl.float32), 1)
        lse = tl.load(lse_ptr + head * BLOCK_L + positions)
        p_t = tl.exp2(_exponent(scores_t, lse[None, :], scale))
        grad = _operand(grad, INTERPRETED)
        # Each gradient is stored as soon as it is computed (v's, q's, then k's), so fewer values are held at once.
        grad_v = tl.dot(_operand(_rounded(p_t, dtype, INTERPRETED).to(dtype), INTERPRETED), grad)
        _put(grad_v_desc, batch, 2 * width + column, _rounded(grad_v, dtype, INTERPRETED).to(dtype))
        dp_t = tl.dot(_operand(v, INTERPRETED), tl.trans(grad))
        ds_t = _operand(_rounded(p_t * (dp_t - delta[None, :]), dtype, INTERPRETED).to(dtype), INTERPRETED)
        ds = tl.trans(ds_t)
        _put_rotated_back(grad_qk, batch, column, tl.dot(ds, k1) * scale, tl.dot(ds, k2) * scale, c, s, INTERPRETED)
        _put_rotated_back(
            grad_qk, batch, width + column, tl.dot(ds_t, q1) * scale, tl.dot(ds_t, q2) * scale, c, s, INTERPRETED
        )
