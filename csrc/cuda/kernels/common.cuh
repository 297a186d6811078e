/* Helpers shared by the CUDA kernel files (private, C++ / nvcc only): launch shapes,
 * launch checks, deterministic block reductions.
 *
 * Launch shapes: 1-D grids are capped at TPK_MAX_GRID blocks and every kernel loops
 * grid-stride with int64 indices, so any size up to TP_MAX_NUMEL runs inside the grid
 * limits.  Row-wise kernels run one block per row (grid-stride over rows).
 * Determinism: every reduction has a fixed partition (thread t of a block takes
 * elements t, t + blockDim, ...) and a fixed tree (XOR butterflies inside a warp, then
 * warp 0's sums in warp order), no atomics on floats: a run gives the same bits as
 * the one before for the same sizes. */
#ifndef TPCORE_KERNELS_CUDA_COMMON_CUH
#define TPCORE_KERNELS_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_impl.h"

#define TPK_MAX_GRID ((int64_t)1 << 20) /* well under gridDim.x's 2^31 - 1 */
#define TPK_THREADS 256                 /* element-wise and row kernels */

static inline cudaStream_t tpk_stream(tp_stream_t s) { return (cudaStream_t)s; }

/* Blocks for n items at `per_block` items per block, at least 1, at most TPK_MAX_GRID. */
static inline unsigned tpk_grid(int64_t n, int64_t per_block) {
  int64_t b = n / per_block + (n % per_block != 0);
  if (b < 1) b = 1;
  return (unsigned)(b < TPK_MAX_GRID ? b : TPK_MAX_GRID);
}

/* After a launch: the launch's error (bad configuration, or an earlier asynchronous
 * failure of the context) as this thread's error, naming the kernel. */
static inline tp_status_t tpk_launched(const char *kernel) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return tp_set_error(TP_ERR_SYSTEM, "cuda %s: %s", kernel, cudaGetErrorString(e));
  return TP_SUCCESS;
}

#define TPK_GRID_STRIDE(i, n) \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

template <typename T>
__device__ __forceinline__ T tpk_warp_sum(T v) {
  /* XOR butterfly: every lane ends with the same bits (each step adds the same two
   * values, a + b == b + a) */
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__device__ __forceinline__ T tpk_warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) {
    T u = __shfl_xor_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  return v;
}

template <typename T>
__device__ __forceinline__ T tpk_warp_min(T v) {
  for (int o = 16; o > 0; o >>= 1) {
    T u = __shfl_xor_sync(0xffffffffu, v, o);
    v = u < v ? u : v;
  }
  return v;
}

/* Block-wide reductions (blockDim.x a multiple of 32, at most 1024; every thread of the
 * block calls them; sh: 32 elements of shared memory).  Every thread gets the result. */
#define TPK_BLOCK_REDUCE_(name, warp_op, identity)                 \
  template <typename T>                                            \
  __device__ __forceinline__ T name(T v, T *sh) {                  \
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;             \
    int nw = (int)(blockDim.x >> 5);                               \
    v = warp_op(v);                                                \
    __syncthreads(); /* sh may still be read by a previous call */ \
    if (lane == 0) sh[w] = v;                                      \
    __syncthreads();                                               \
    T r = lane < nw ? sh[lane] : (identity);                       \
    return warp_op(r); /* each warp reduces the same values */     \
  }
TPK_BLOCK_REDUCE_(tpk_block_sum, tpk_warp_sum, T(0))
TPK_BLOCK_REDUCE_(tpk_block_max, tpk_warp_max, v)
TPK_BLOCK_REDUCE_(tpk_block_min, tpk_warp_min, v)
#undef TPK_BLOCK_REDUCE_

#endif
