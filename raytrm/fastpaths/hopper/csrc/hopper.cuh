// What raytrm's Hopper kernels (sm_90a) share: persistent CTAs whose producer thread copies x's and w's tiles by
// TMA into a ring of shared-memory stages while two warp groups run wgmma products on 128 x 256 tiles, finishing
// the previous tile an eighth a stage (gated_swiglu.cu, rotary_qkv.cu).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int BM = 128;      // rows of x a tile
constexpr int BNH = 128;     // half a tile's columns: a tile takes 2 BNH of w's rows (gated_swiglu: BNH of h)
constexpr int BK = 64;       // inner-dimension elements a stage: 128 bytes, the swizzle's width
constexpr int KB = 8;        // stages a tile: the inner dimension is 512 (the epilogue's eighths take one each)
constexpr int STAGES = 4;
constexpr int A_ELEMS = BM * BK, B_ELEMS = 2 * BNH * BK;
constexpr uint32_t STAGE_BYTES = (A_ELEMS + B_ELEMS) * 2;

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count));
}

__device__ __forceinline__ void barrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void copy_tile(void* dst, const CUtensorMap* map, uint64_t* bar, int column, int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(shared_address(bar)), "r"(column), "r"(row)
      : "memory");
}

// wgmma's descriptor of a K-major tile in the 128-byte swizzle: rows of 64 bf16, groups of 8 rows 1024 bytes apart.
__device__ __forceinline__ uint64_t descriptor(const void* p) {
  uint64_t d = (shared_address(p) & 0x3FFFF) >> 4;
  d |= uint64_t(1) << 16;
  d |= uint64_t(1024 >> 4) << 32;
  d |= uint64_t(1) << 62;
  return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// d (+)= a [64 x 16] @ b [16 x 256], both from shared memory; accumulate is 0 for the first step of a tile.
__device__ __forceinline__ void wgmma_64x256x16(float (&d)[128], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(a), "l"(b), "r"(accumulate));
}

// Both kernels' CTAs: a producer thread (warp group 0) copies each tile's stages, x's (or grad's) 128 rows and w's 256
// rows, into a ring of N stages; two warp groups run the products. `full` says a stage landed, `empty` that both
// warp groups' products have read it.
template <int N>
__device__ __forceinline__ void init_ring(uint64_t (&full)[N], uint64_t (&empty)[N]) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < N; ++i) {
      barrier_init(&full[i], 1);
      barrier_init(&empty[i], 2);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// The producer's loop: tile t takes a's row block t / column_tiles and w's rows from (t % column_tiles) * columns,
// 128 of them, and 128 more from `second` rows after those. Consecutive CTAs take consecutive tiles, a row block's
// column tiles together: a is read from memory once.
template <int N>
__device__ __forceinline__ void produce(__nv_bfloat16 (&a)[N][A_ELEMS], __nv_bfloat16 (&b)[N][B_ELEMS],
                                        uint64_t (&full)[N], uint64_t (&empty)[N], const CUtensorMap* a_map,
                                        const CUtensorMap* w_map, int tiles, int column_tiles, int columns, int second) {
  int stage = 0;
  uint32_t phase = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int row = t / column_tiles * BM, column = t % column_tiles * columns;
    for (int k = 0; k < KB; ++k) {
      barrier_wait(&empty[stage], phase ^ 1);
      barrier_expect_bytes(&full[stage], STAGE_BYTES);
      copy_tile(a[stage], a_map, &full[stage], k * BK, row);
      copy_tile(b[stage], w_map, &full[stage], k * BK, column);
      copy_tile(b[stage] + BNH * BK, w_map, &full[stage], k * BK, column + second);
      if (++stage == N) stage = 0, phase ^= 1;
    }
  }
}

// A consumer warp group's products for one tile: its 64 rows (half) of a's tile by w's 256 rows into d, running
// step(k) (the previous tile's epilogue, an eighth) once each stage's products are issued.
template <int N, class Step>
__device__ __forceinline__ void products(__nv_bfloat16 (&a)[N][A_ELEMS], __nv_bfloat16 (&b)[N][B_ELEMS],
                                         uint64_t (&full)[N], uint64_t (&empty)[N], int half, int& stage,
                                         uint32_t& phase, float (&d)[128], Step&& step) {
  int last = 0;
#pragma unroll
  for (int k = 0; k < KB; ++k) {
    barrier_wait(&full[stage], phase);
    wgmma_fence();
    const uint64_t da = descriptor(a[stage] + half * 64 * BK), db = descriptor(b[stage]);
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) wgmma_64x256x16(d, da + 2 * kk, db + 2 * kk, (k | kk) != 0);
    wgmma_commit();
    step(k);
    if (k > 0) {
      wgmma_wait<1>();
      if (threadIdx.x % 128 == 0) barrier_arrive(&empty[last]);
    }
    last = stage;
    if (++stage == N) stage = 0, phase ^= 1;
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");  // no read of d before the wait
  if (threadIdx.x % 128 == 0) barrier_arrive(&empty[last]);
}

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// A consumer's tile of products as bf16 pairs: kept[2 i] the thread's two columns of 8-column block i at its row r,
// kept[2 i + 1] at r + 8 (wgmma's accumulator layout).
__device__ __forceinline__ void keep(const float (&d)[128], uint32_t (&kept)[64]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    kept[2 * i] = pack(d[4 * i], d[4 * i + 1]);
    kept[2 * i + 1] = pack(d[4 * i + 2], d[4 * i + 3]);
  }
}

int encode(CUtensorMap* map, const void* base, int rows) {
  const cuuint64_t dims[2] = {cuuint64_t(KB * BK), cuuint64_t(rows)}, strides[1] = {cuuint64_t(KB * BK) * 2};
  const cuuint32_t box[2] = {BK, 128}, elements[2] = {1, 1};
  return int(cuTensorMapEncodeTiled(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides,
                                    box, elements, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
}

// Launch a kernel of these CTAs on stream: 384 threads each, `bytes` of dynamic shared memory (allowed once, at the
// kernel's first launch), a CTA a tile up to one a multiprocessor. 0, or the CUDA error.
template <auto Kernel, class... Args>
int launch(int bytes, int tiles, int multiprocessors, void* stream, Args... args) {
  static const cudaError_t allowed =
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (allowed != cudaSuccess) return int(allowed);
  Kernel<<<tiles < multiprocessors ? tiles : multiprocessors, 384, bytes, static_cast<cudaStream_t>(stream)>>>(args...);
  return int(cudaGetLastError());
}

}  // namespace
