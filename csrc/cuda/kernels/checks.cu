/* The data checks on CUDA: check_range writes the first index outside [lo, hi) (or -1)
 * to result in device memory; the caller reads it back once (tp_device_copy), so the
 * entry itself never synchronizes.  (xent_targets, the other check, is in xent.cu.)
 *
 * Launch shape: one block of 1024 threads; thread t looks at t, t + 1024, ...; the
 * first bad index is a block minimum (integers: the same answer however it is summed). */
#include "common.cuh"

__global__ void __launch_bounds__(1024)
    tpk_check_range(int64_t *result, const int64_t *x, int64_t n, int64_t lo, int64_t hi) {
  __shared__ long long sh[32];
  long long first = n; /* n: none */
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    if (x[i] < lo || x[i] >= hi) {
      first = i; /* this thread's indices grow: its first is its smallest */
      break;
    }
  first = tpk_block_min(first, sh);
  if (threadIdx.x == 0) result[0] = first < n ? first : -1;
}

extern "C" tp_status_t tp_cuda_check_range(tp_stream_t s, int64_t *result, const int64_t *x, int64_t n, int64_t lo,
                                           int64_t hi) {
  tpk_check_range<<<1, 1024, 0, tpk_stream(s)>>>(result, x, n, lo, hi);
  return tpk_launched("check_range");
}
