/* Deterministic column sums (private, nvcc only): out1[n] += sum_m f(m, n).x and
 * out2[n] += sum_m f(m, n).y (out2 may be NULL) over M rows, with no atomics: a block of
 * 32 x 32 threads owns 32 columns (grid-stride over column blocks); thread (x, y) sums
 * rows y, y + 32, ... of column x in order, then thread (x, 0) adds the 32 partial sums
 * in order.  Used by bias_grad and the norms' dw / db. */
#ifndef TPCORE_KERNELS_CUDA_COLSUM_CUH
#define TPCORE_KERNELS_CUDA_COLSUM_CUH

#include "common.cuh"

template <class F>
__global__ void __launch_bounds__(1024) tpk_colsum_kernel(float *out1, float *out2, int64_t M, int64_t N, F f) {
  __shared__ float sh1[32][33], sh2[32][33];
  int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t cb = blockIdx.x; cb * 32 < N; cb += gridDim.x) {
    int64_t n = cb * 32 + tx;
    float a1 = 0.0f, a2 = 0.0f;
    if (n < N)
      for (int64_t m = ty; m < M; m += 32) {
        float2 v = f(m, n);
        a1 += v.x;
        a2 += v.y;
      }
    sh1[ty][tx] = a1;
    sh2[ty][tx] = a2;
    __syncthreads();
    if (ty == 0 && n < N) {
      float s1 = 0.0f, s2 = 0.0f;
      for (int r = 0; r < 32; r++) {
        s1 += sh1[r][tx];
        s2 += sh2[r][tx];
      }
      out1[n] += s1;
      if (out2) out2[n] += s2;
    }
    __syncthreads();
  }
}

template <class F>
static tp_status_t tpk_colsum(tp_stream_t s, const char *kernel, float *out1, float *out2, int64_t M, int64_t N, F f) {
  if (M == 0 || N == 0) return TP_SUCCESS;
  tpk_colsum_kernel<F><<<tpk_grid(N, 32), dim3(32, 32), 0, tpk_stream(s)>>>(out1, out2, M, N, f);
  return tpk_launched(kernel);
}

#endif
