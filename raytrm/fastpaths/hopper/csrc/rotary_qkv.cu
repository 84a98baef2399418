// The attention's fused projection with RoPE in its epilogue, bf16, for Hopper GPUs (sm_90a); see
// ../rotary_qkv.py.
//
// qkv = x @ w^T for x [M, 512] and w [N, 512] (q's rows, k's, then v's, N / 3 each), with q and k rotated by
// position as raytrm's RoPE operator rotates them (triton/rope.py): each product is rounded once to
// bf16, then column d and d + 32 of each 64-column head turn by the angle of the row's position (row % L), in fp32
// from the tables' first halves, (x1 c - x2 s, x2 c + x1 s), and are rounded once more. The same bits as cuBLAS's
// product followed by that operator. The attention then takes q and k as they are (its `rotated` form), where it
// would otherwise rotate them on the way in, a head at a time, inside its forward's critical loop.
//
// The CTAs of gated_swiglu.cu (hopper.cuh): 128 x 256 tiles of consecutive columns, each finished an eighth a stage
// while the tensor cores run the next. w's rows come in the kernel's order, so each thread holds 8 consecutive columns
// of every 32: a head's column d and d + 32 are in the same thread, and the stores are 16 bytes. The tables' rows for
// positions < L are copied into shared memory once a CTA, 36 floats apart (4 banks between rows), and a thread loads
// the 8 values of its columns for a row once a tile (all four heads of a tile share them).
#include "hopper.cuh"

namespace {

constexpr int MAX_POSITIONS = 112;  // the tables' rows that fit beside 4 stages
constexpr int TABLE_STRIDE = 36;
constexpr int HEAD = 64;

struct __align__(1024) RotaryShared {
  __nv_bfloat16 a[STAGES][A_ELEMS];
  __nv_bfloat16 b[STAGES][B_ELEMS];
  float cos[MAX_POSITIONS][TABLE_STRIDE], sin[MAX_POSITIONS][TABLE_STRIDE];
  uint64_t full[STAGES], empty[STAGES];
};

__global__ void __launch_bounds__(384, 1)
    rotary_qkv_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                      __nv_bfloat16* __restrict__ qkv, const float* __restrict__ cos_t,
                      const float* __restrict__ sin_t, int M, int N, int L, int table_stride) {
  extern __shared__ uint8_t raw[];
  RotaryShared& s = *reinterpret_cast<RotaryShared*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  const int group = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int column_tiles = N / (2 * BNH), tiles = ((M + BM - 1) / BM) * column_tiles, rotated = 2 * (N / 3);
  for (int i = threadIdx.x; i < L * 32; i += blockDim.x) {
    s.cos[i / 32][i % 32] = cos_t[size_t(i / 32) * table_stride + i % 32];
    s.sin[i / 32][i % 32] = sin_t[size_t(i / 32) * table_stride + i % 32];
  }
  init_ring(s.full, s.empty);  // its __syncthreads publishes the tables too
  if (group == 0) {  // w's rows: 256 consecutive ones a tile
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid == 0) produce(s.a, s.b, s.full, s.empty, &x_map, &w_map, tiles, column_tiles, 2 * BNH, BNH);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int half = group - 1, warp = tid / 32, lane = tid % 32, q = lane % 4;
  int stage = 0;
  uint32_t phase = 0;
  float d[128];
  // The previous tile's products as bf16 pairs (keep's layout: [2 i] 8-column block i at row r, [2 i + 1] at r + 8).
  uint32_t kept[64];
  int kept_row = -1, kept_column = 0, position[2] = {0, 0};
  float c[8], sn[8];  // the tables at the thread's 8 columns of a head half, for the row being finished
  // Piece p of the kept tile: row r = p / 4 (the thread's, or the one 8 below), head p % 4 of the tile's four (its
  // 32-column blocks 2 head and 2 head + 1; the thread's 8 columns of each, d and d + 32, from d = 8 q).
  auto finish = [&](int p) {
    const int r = p / 4, head = p % 4, row = kept_row + 8 * r;
    uint32_t lo[4], hi[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      lo[b] = kept[2 * (8 * head + b) + r];
      hi[b] = kept[2 * (8 * head + 4 + b) + r];
    }
    if (kept_column < rotated) {
      if (head == 0) {
        const float4* cp = reinterpret_cast<const float4*>(&s.cos[position[r]][8 * q]);
        const float4* sp = reinterpret_cast<const float4*>(&s.sin[position[r]][8 * q]);
        const float4 c0 = cp[0], c1 = cp[1], s0 = sp[0], s1 = sp[1];
        c[0] = c0.x, c[1] = c0.y, c[2] = c0.z, c[3] = c0.w, c[4] = c1.x, c[5] = c1.y, c[6] = c1.z, c[7] = c1.w;
        sn[0] = s0.x, sn[1] = s0.y, sn[2] = s0.z, sn[3] = s0.w, sn[4] = s1.x, sn[5] = s1.y, sn[6] = s1.z, sn[7] = s1.w;
      }
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const float2 x1 = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&lo[b]));
        const float2 x2 = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&hi[b]));
        const int e = 2 * b;
        // The multiply-adds as the RoPE operator's kernel contracts them (Triton 3.6): its bits.
        lo[b] = pack(__fmaf_rn(x1.x, c[e], -__fmul_rn(x2.x, sn[e])),
                     __fmaf_rn(x1.y, c[e + 1], -__fmul_rn(x2.y, sn[e + 1])));
        hi[b] = pack(__fmaf_rn(x2.x, c[e], __fmul_rn(x1.x, sn[e])),
                     __fmaf_rn(x2.y, c[e + 1], __fmul_rn(x1.y, sn[e + 1])));
      }
    }
    if (row < M) {
      __nv_bfloat16* out = qkv + size_t(row) * N + kept_column + HEAD * head + 8 * q;
      *reinterpret_cast<uint4*>(out) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
      *reinterpret_cast<uint4*>(out + HEAD / 2) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    }
  };
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    products(s.a, s.b, s.full, s.empty, half, stage, phase, d, [&](int k) {
      if (kept_row >= 0) finish(k);  // an eighth of the previous tile while these products run
    });
    keep(d, kept);
    kept_row = t / column_tiles * BM + half * 64 + warp * 16 + lane / 4;
    kept_column = t % column_tiles * 2 * BNH;
    position[0] = kept_row % L;
    position[1] = (kept_row + 8) % L;
  }
  if (kept_row >= 0) {
#pragma unroll
    for (int p = 0; p < 8; ++p) finish(p);
  }
}

}  // namespace

// 0 on success, else a CUDA driver (tensor map) or runtime (launch) error code; -1 for shapes it does not take.
// x [M, 512] and qkv [M, N] start on 16 bytes, w [N, 512] too, its rows in the kernel's order (as
// raytrm_gated_swiglu's w); cos and sin are fp32 rotate-half tables of rows table_stride apart (a row's first 32
// values are read) for positions [0, L), L at most 112; N a multiple of 768 (q, k and v each whole tiles).
extern "C" int raytrm_rotary_qkv(const void* x, const void* w, void* qkv, const void* cos_t, const void* sin_t, int M,
                                 int N, int K, int L, int table_stride, int multiprocessors, void* stream) {
  if (K != KB * BK || N % (3 * 2 * BNH) != 0 || M <= 0 || L <= 0 || L > MAX_POSITIONS) return -1;
  CUtensorMap x_map, w_map;
  if (int error = encode(&x_map, x, M)) return error;
  if (int error = encode(&w_map, w, N)) return error;
  const int bytes = int(sizeof(RotaryShared)) + 1024, tiles = (M + BM - 1) / BM * (N / (2 * BNH));
  return launch<rotary_qkv_kernel>(bytes, tiles, multiprocessors, stream, x_map, w_map,
                                   static_cast<__nv_bfloat16*>(qkv), static_cast<const float*>(cos_t),
                                   static_cast<const float*>(sin_t), M, N, L, table_stride);
}
