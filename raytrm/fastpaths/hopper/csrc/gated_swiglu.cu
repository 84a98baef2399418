// h = silu(x @ w_gate^T) * (x @ w_up^T) in one product, bf16, for Hopper GPUs (sm_90a); see ../gated.py.
// Below it, the down projection's backward for gate_up's gradient, the gate's backward in its epilogue.
//
// x [M, 512] and w [2 N, 512] (the gate's rows, then the up rows) are row-major; h is [M, N] and, where asked for,
// gate_up [M, 2 N] (x @ w^T) is written too. Each product sums in fp32 and is rounded once to bf16, then the gate is
// computed as raytrm's Triton gate kernel computes it (triton/gate.py), so h has the bits of that kernel
// applied to a cuBLAS product of x and w.
//
// Persistent CTAs of three warp groups. One thread of the first issues the TMA copies of x's and w's tiles into a
// ring of shared-memory stages; the other two run the products, each 64 rows of a 128 x 256 tile (128 gate and 128 up
// columns) with asynchronous wgmma. A tile's results stay in registers, rounded to bf16 pairs, and are gated and
// stored from there an eighth at a time while the tensor cores run the next tile's products. wgmma's accumulator layout
// puts a gate column and its up column in the same thread, so the gate moves no data between threads, and w's rows,
// taken in the kernel's order (raytrm_gated_swiglu), put 8 consecutive columns in each thread, so neither do the
// 16-byte stores: the epilogue has no shuffles.
#include "hopper.cuh"

namespace {

struct __align__(1024) Shared {
  __nv_bfloat16 a[STAGES][A_ELEMS];
  __nv_bfloat16 b[STAGES][B_ELEMS];
  uint64_t full[STAGES], empty[STAGES];
};

// sigmoid as the Triton kernels compute it: the hardware's approximate 2^x and 1/x.
__device__ __forceinline__ float sigmoid(float v) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-1.4426950408889634f * v));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return r;
}

// Two h values from bf16 pairs of gate and up: silu(gate) rounded, then its product with up rounded.
__device__ __forceinline__ uint32_t gated(uint32_t gate2, uint32_t up2) {
  const __nv_bfloat162 g = *reinterpret_cast<__nv_bfloat162*>(&gate2), u = *reinterpret_cast<__nv_bfloat162*>(&up2);
  const float g0 = __low2float(g), g1 = __high2float(g);
  const float s0 = __bfloat162float(__float2bfloat16_rn(g0 * sigmoid(g0)));
  const float s1 = __bfloat162float(__float2bfloat16_rn(g1 * sigmoid(g1)));
  return pack(s0 * __low2float(u), s1 * __high2float(u));
}

__global__ void __launch_bounds__(384, 1)
    gated_swiglu_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                        __nv_bfloat16* __restrict__ h, __nv_bfloat16* __restrict__ gate_up, int M, int N) {
  extern __shared__ uint8_t raw[];
  Shared& s = *reinterpret_cast<Shared*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  const int group = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int column_tiles = N / BNH, tiles = ((M + BM - 1) / BM) * column_tiles;
  init_ring(s.full, s.empty);
  if (group == 0) {  // w's rows: the gate's 128 of the tile, then the up rows' (N rows on)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid == 0) produce(s.a, s.b, s.full, s.empty, &x_map, &w_map, tiles, column_tiles, BNH, N);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int half = group - 1, warp = tid / 32, lane = tid % 32;
  int stage = 0;
  uint32_t phase = 0;
  float d[128];
  // The previous tile's products as bf16 pairs, per 8-column block i: [4 i] gate at rows r and [4 i + 1] at r + 8,
  // [4 i + 2] and [4 i + 3] up likewise (wgmma's layout: a thread holds columns 8 i + 2 (lane % 4) and the next).
  uint32_t kept[64];
  int kept_row = -1, kept_column = 0;
  const int q = lane % 4;
  auto put = [&](__nv_bfloat16* base, size_t stride, int row, int column, const uint32_t (&v)[4]) {
    if (row < M) *reinterpret_cast<uint4*>(&base[size_t(row) * stride + column]) = make_uint4(v[0], v[1], v[2], v[3]);
  };
  // Row r (kept_row + 8 r) of the kept tile's blocks 4 j to 4 j + 3, an eighth of the tile: a piece a stage, so
  // that each ends before the products it runs beside (j and r constants where unrolled: kept stays in registers).
  // w's rows come in the kernel's order (see the entry point), so the thread's four pairs are 8 consecutive columns.
  auto finish = [&](int j, int r) {
    const int row = kept_row + 8 * r, column = kept_column + 32 * j + 8 * q;
    uint32_t hv[4], gv[4], uv[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      gv[b] = kept[4 * (4 * j + b) + r];
      uv[b] = kept[4 * (4 * j + b) + 2 + r];
      hv[b] = gated(gv[b], uv[b]);
    }
    put(h, N, row, column, hv);
    if (gate_up != nullptr) {
      put(gate_up, 2 * size_t(N), row, column, gv);
      put(gate_up + N, 2 * size_t(N), row, column, uv);
    }
  };
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    products(s.a, s.b, s.full, s.empty, half, stage, phase, d, [&](int k) {
      if (kept_row >= 0) finish(k / 2, k % 2);  // an eighth of the previous tile while these products run
    });
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      kept[4 * i] = pack(d[4 * i], d[4 * i + 1]);
      kept[4 * i + 1] = pack(d[4 * i + 2], d[4 * i + 3]);
      kept[4 * i + 2] = pack(d[4 * (i + 16)], d[4 * (i + 16) + 1]);
      kept[4 * i + 3] = pack(d[4 * (i + 16) + 2], d[4 * (i + 16) + 3]);
    }
    kept_row = t / column_tiles * BM + half * 64 + warp * 16 + lane / 4;
    kept_column = t % column_tiles * BNH;
  }
  if (kept_row >= 0) {
#pragma unroll
    for (int piece = 0; piece < 8; ++piece) finish(piece / 2, piece % 2);
  }
}

// --- The down projection's backward: gate_up's gradient -----------------------------------------------------------
//
// grad_gate_up [M, 2 F] (laid out as gate_up: gate, then up, in each row) for the gradient grad [M, 512] of
// h @ w_down^T, h = silu(gate) * up: the gate's gradient grad @ w_down, rounded once to bf16 as a product's output
// is, goes through the gate's backward (the Triton kernels' formulas and roundings) on its way out, so that it never
// goes to memory; the bits of raytrm's Triton kernel (swiglu_down_backward_kernel).
//
// The CTAs of gated_swiglu_kernel, on its tiles (128 rows, 256 of F's columns; tiles of 128 columns, tried first,
// were no faster). w_down comes transposed, [F, 512], its rows in the kernel's order, so that a thread's 8 columns
// of a 32 are 8 consecutive columns of F. While the tensor cores run a tile's products, each thread finishes the
// previous tile an eighth a stage: the gate and up it needs come from shared memory, where the thread copied them
// itself (cp.async, its own chunks alone, so no thread waits for another) AHEAD stages before, and its results go
// out as 16-byte stores. Four stages with copies two ahead measured fastest at TRM's shape on an H200.
// Its epilogue's instructions, not memory, bound it, so g * up and silu(gate) * g are bf16 pair products (a product
// of two bf16 values is exact in fp32: one rounding gives the same bits).

constexpr int DB_STAGES = 4;
constexpr int AHEAD = 2;  // stages between an eighth's copies and its use; divides KB

struct __align__(1024) DownShared {
  __nv_bfloat16 a[DB_STAGES][A_ELEMS];
  __nv_bfloat16 b[DB_STAGES][B_ELEMS];
  uint4 ahead[AHEAD][2][2][256];  // per stage in flight: rows r and r + 8, gate and up, a 16-byte chunk a thread
  uint64_t full[DB_STAGES], empty[DB_STAGES];
};

__device__ __forceinline__ void copy_async(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The gradients of two silu(gate) * up for their gradient g (bf16 pairs): d gate = (g * up) s (1 + gate (1 - s)),
// d up = silu(gate) g, s = sigmoid(gate), rounded where _gate_gradients rounds (g * up, silu(gate), each result).
// A product of two bf16 values is exact in fp32, so g * up and silu(gate) * g, each rounded once, are bf16 pair
// products: the same bits in fewer instructions, which bound this epilogue.
__device__ __forceinline__ void gate_gradients(uint32_t gate2, uint32_t up2, uint32_t g2, uint32_t& d_gate2,
                                               uint32_t& d_up2) {
  const __nv_bfloat162 gate = *reinterpret_cast<__nv_bfloat162*>(&gate2), up = *reinterpret_cast<__nv_bfloat162*>(&up2),
                       g = *reinterpret_cast<__nv_bfloat162*>(&g2);
  const float2 x = __bfloat1622float2(gate), g_up = __bfloat1622float2(__hmul2_rn(g, up));
  const float s0 = sigmoid(x.x), s1 = sigmoid(x.y);
  d_gate2 = pack(__fmul_rn(__fmul_rn(g_up.x, s0), __fmaf_rn(x.x, __fsub_rn(1.0f, s0), 1.0f)),
                 __fmul_rn(__fmul_rn(g_up.y, s1), __fmaf_rn(x.y, __fsub_rn(1.0f, s1), 1.0f)));
  __nv_bfloat162 d_up = __hmul2_rn(__floats2bfloat162_rn(__fmul_rn(x.x, s0), __fmul_rn(x.y, s1)), g);
  d_up2 = *reinterpret_cast<uint32_t*>(&d_up);
}

__global__ void __launch_bounds__(384, 1)
    swiglu_down_backward_kernel(const __grid_constant__ CUtensorMap grad_map, const __grid_constant__ CUtensorMap w_map,
                                const __nv_bfloat16* __restrict__ gate_up, __nv_bfloat16* __restrict__ grad_gate_up,
                                int M, int F) {
  extern __shared__ uint8_t raw[];
  DownShared& s = *reinterpret_cast<DownShared*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  const int group = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int column_tiles = F / (2 * BNH), tiles = ((M + BM - 1) / BM) * column_tiles;
  init_ring(s.full, s.empty);
  if (group == 0) {  // w's rows: 256 consecutive ones a tile
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid == 0) produce(s.a, s.b, s.full, s.empty, &grad_map, &w_map, tiles, column_tiles, 2 * BNH, BNH);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int half = group - 1, warp = tid / 32, lane = tid % 32, q = lane % 4, me = half * 128 + tid;
  const int first_row = half * 64 + warp * 16 + lane / 4;  // the thread's first row in a tile
  const size_t stride = 2 * size_t(F);
  int stage = 0;
  uint32_t phase = 0;
  float d[128];
  // The previous tile's gate gradients as bf16 pairs (keep's layout).
  uint32_t kept[64];
  int kept_tile = -1;
  // Stage k of tile t (a tile's eighth: rows r and r + 8, the thread's 8 columns of the 32 from 32 k, which w's order
  // (see the entry point) makes 8 consecutive columns) starts at gate_up's element `at(t, k, row)` for row r.
  auto at = [&](int t, int k, int& row) {
    row = t / column_tiles * BM + first_row;
    return size_t(row) * stride + t % column_tiles * 2 * BNH + 32 * k + 8 * q;
  };
  // Copy the gate and up of tile t's stage k into ahead[k % AHEAD], as a copy group (empty for no tile).
  auto fetch = [&](int t, int k) {
    if (t >= 0 && t < tiles) {
      int row;
      const size_t offset = at(t, k, row);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const bool valid = row + 8 * r < M;
        const __nv_bfloat16* p = gate_up + (valid ? offset + 8 * r * stride : 0);
        copy_async(&s.ahead[k % AHEAD][r][0][me], p, valid);
        copy_async(&s.ahead[k % AHEAD][r][1][me], p + F, valid);
      }
    }
    copy_async_commit();
  };
  // The kept tile's stage k: its gate and up (copied AHEAD stages ago; the groups since may be in flight), then its
  // two gradients stored.
  auto finish = [&](int k) {
    copy_async_wait<AHEAD - 1>();
    int kept_row;
    const size_t offset = at(kept_tile, k, kept_row);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint4 gate = s.ahead[k % AHEAD][r][0][me], up = s.ahead[k % AHEAD][r][1][me];
      const uint32_t gv[4] = {gate.x, gate.y, gate.z, gate.w}, uv[4] = {up.x, up.y, up.z, up.w};
      uint32_t d_gate[4], d_up[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) gate_gradients(gv[b], uv[b], kept[2 * (4 * k + b) + r], d_gate[b], d_up[b]);
      if (kept_row + 8 * r < M) {
        __nv_bfloat16* p = grad_gate_up + offset + 8 * r * stride;
        *reinterpret_cast<uint4*>(p) = make_uint4(d_gate[0], d_gate[1], d_gate[2], d_gate[3]);
        *reinterpret_cast<uint4*>(p + F) = make_uint4(d_up[0], d_up[1], d_up[2], d_up[3]);
      }
    }
  };
  // Stage k of the tile computed now is finished at stage k of the next: its copies go out AHEAD stages before,
  // during the next tile's stage k - AHEAD, or this tile's k + KB - AHEAD. Groups go out one a stage, empty where
  // nothing is to copy, so that a stage's are always AHEAD - 1 groups back.
  auto step = [&](int k, int t) {
    if (kept_tile >= 0) {
      finish(k);  // an eighth of the previous tile while this one's products run
    } else {
      copy_async_wait<AHEAD - 1>();
    }
    if (k < KB - AHEAD) {
      fetch(kept_tile, k + AHEAD);
    } else {
      fetch(t, k + AHEAD - KB);
    }
  };
  for (int k = 0; k < AHEAD; ++k) copy_async_commit();
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    products(s.a, s.b, s.full, s.empty, half, stage, phase, d, [&](int k) { step(k, t); });
    keep(d, kept);
    kept_tile = t;
  }
  if (kept_tile >= 0) {
#pragma unroll
    for (int k = 0; k < KB; ++k) step(k, -1);
  }
}

}  // namespace

// 0 on success, else a CUDA driver (tensor map) or runtime (launch) error code; -1 for shapes it does not take.
// Pointers start on 16 bytes; gate_up may be null. w's rows come in the kernel's order: within each 32 rows, the row
// of output column 8 q + 2 i + e (q, i < 4, e < 2) at 8 i + 2 q + e, so that the 8 columns wgmma's accumulator layout
// gives a thread of a quad (2 of each 8-column block) are 8 consecutive output columns, stored as 16 bytes as they
// are (no exchange between lanes; the products' sums are the same).
extern "C" int raytrm_gated_swiglu(const void* x, const void* w, void* h, void* gate_up, int M, int N, int K,
                                   int multiprocessors, void* stream) {
  if (K != KB * BK || N % BNH != 0 || M <= 0) return -1;
  CUtensorMap x_map, w_map;
  if (int error = encode(&x_map, x, M)) return error;
  if (int error = encode(&w_map, w, 2 * N)) return error;
  const int bytes = int(sizeof(Shared)) + 1024, tiles = (M + BM - 1) / BM * (N / BNH);
  return launch<gated_swiglu_kernel>(bytes, tiles, multiprocessors, stream, x_map, w_map,
                                     static_cast<__nv_bfloat16*>(h), static_cast<__nv_bfloat16*>(gate_up), M, N);
}

// 0 on success, else as raytrm_gated_swiglu's. grad [M, 512] and gate_up [M, 2 F] start on 16 bytes, as does
// grad_gate_up; w is w_down^T [F, 512] with its rows in the kernel's order (as raytrm_gated_swiglu's w).
extern "C" int raytrm_swiglu_down_backward(const void* grad, const void* w, const void* gate_up, void* grad_gate_up,
                                           int M, int F, int K, int multiprocessors, void* stream) {
  if (K != KB * BK || F % (2 * BNH) != 0 || M <= 0) return -1;
  CUtensorMap grad_map, w_map;
  if (int error = encode(&grad_map, grad, M)) return error;
  if (int error = encode(&w_map, w, F)) return error;
  const int bytes = int(sizeof(DownShared)) + 1024, tiles = (M + BM - 1) / BM * (F / (2 * BNH));
  return launch<swiglu_down_backward_kernel>(bytes, tiles, multiprocessors, stream, grad_map, w_map,
                                             static_cast<const __nv_bfloat16*>(gate_up),
                                             static_cast<__nv_bfloat16*>(grad_gate_up), M, F);
}
