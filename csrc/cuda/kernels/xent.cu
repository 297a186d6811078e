/* The cross-entropy pieces of the vocab-parallel layer on CUDA (shard [lo, lo + V)),
 * cpu/embedding.c and cpu/elementwise.c being the reference.
 *
 * Launch shapes: xent_row_max, xent_row_sums, xent_backward one block of 256 threads per
 * row (grid-stride over rows; thread t takes columns t, t + 256, ...; block reductions
 * of common.cuh: float max, float per-thread sums of exp added in double);
 * xent_loss, xent_row_scale 1-D over M; xent_targets and xent_targets_hash one block
 * (1024 / 256 threads): the first bad index is a block minimum, then the count of the
 * rows before it a block sum; the hash is a serial FNV chain, thread 0 walking tiles
 * of targets staged in shared memory. */
#include <math.h>

#include "common.cuh"

__global__ void __launch_bounds__(TPK_THREADS)
    tpk_xent_row_max(float *rowmax, const float *logits, int64_t M, int64_t V) {
  __shared__ float sh[32];
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const float *l = logits + m * V;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = l[j] > mx ? l[j] : mx; /* NaN skipped, as the CPU */
    mx = tpk_block_max(mx, sh);
    if (threadIdx.x == 0) rowmax[m] = mx;
  }
}

__global__ void __launch_bounds__(TPK_THREADS)
    tpk_xent_row_sums(float *sums, const float *logits, const float *gmax, const int64_t *targets, int64_t M,
                      int64_t lo, int64_t V) {
  __shared__ double sh[32];
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const float *l = logits + m * V;
    float mx = gmax[m], acc = 0.0f;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) acc += expf(l[j] - mx);
    double tot = tpk_block_sum((double)acc, sh);
    if (threadIdx.x == 0) {
      int64_t tg = targets[m], t = tg - lo;
      sums[m] = (float)tot;
      sums[M + m] = (tg >= 0 && t >= 0 && t < V) ? l[t] : 0.0f;
    }
  }
}

__global__ void __launch_bounds__(TPK_THREADS)
    tpk_xent_bwd(float *dlogits, const float *logits, const float *gmax, const float *sumexp, const int64_t *targets,
                 const float *row_scale, float scale, int64_t M, int64_t lo, int64_t V) {
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const float *l = logits + m * V;
    float *d = dlogits + m * V;
    float s = row_scale ? row_scale[m] * scale : scale;
    float k = s / sumexp[m], mx = gmax[m];
    int64_t tg = targets[m];
    uint64_t t = (uint64_t)tg - (uint64_t)lo;
    int64_t at = tg >= 0 && t < (uint64_t)V ? (int64_t)t : -1;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      float v = expf(l[j] - mx) * k;
      d[j] = j == at ? v - s : v;
    }
  }
}

__global__ void tpk_xent_loss(float *losses, const float *sumexp, const float *gmax, const float *target_logit,
                              const int64_t *targets, int64_t M) {
  TPK_GRID_STRIDE(m, M) {
    losses[m] = targets[m] < 0 ? 0.0f : (float)(log((double)sumexp[m]) + (double)gmax[m] - (double)target_logit[m]);
  }
}

__global__ void tpk_xent_row_scale(float *row_scale, const int64_t *targets, const float *dloss, int64_t M) {
  TPK_GRID_STRIDE(m, M) { row_scale[m] = targets[m] < 0 ? 0.0f : dloss ? dloss[m] : 1.0f; }
}

/* One block. */
__global__ void __launch_bounds__(1024) tpk_xent_targets(int64_t *out, int64_t *result, const int64_t *targets,
                                                         int64_t M, int64_t ignore_index, int64_t vocab) {
  __shared__ long long sh[32];
  long long bad = M; /* M: none */
  for (int64_t m = threadIdx.x; m < M; m += blockDim.x) {
    int64_t t = targets[m];
    if (t != ignore_index && (t < 0 || t >= vocab) && m < bad) bad = m;
  }
  bad = tpk_block_min(bad, sh);
  long long valid = 0;
  for (int64_t m = threadIdx.x; m < bad; m += blockDim.x) {
    int64_t t = targets[m];
    if (t == ignore_index) {
      out[m] = -1;
    } else {
      out[m] = t;
      valid++;
    }
  }
  valid = tpk_block_sum(valid, sh);
  if (threadIdx.x == 0) {
    result[0] = bad < M ? bad : -1;
    result[1] = valid;
  }
}

/* One block of 256 threads. */
__global__ void __launch_bounds__(TPK_THREADS)
    tpk_xent_targets_hash(float *fp, const int64_t *targets, int64_t M, int64_t ignore_index) {
  __shared__ int64_t tile[TPK_THREADS];
  uint64_t h = (0xcbf29ce484222325ULL ^ (uint64_t)M) * 0x100000001b3ULL ^ (uint64_t)ignore_index;
  for (int64_t base = 0; base < M; base += TPK_THREADS) {
    int64_t j = base + threadIdx.x, n = M - base < TPK_THREADS ? M - base : TPK_THREADS;
    if (j < M) tile[threadIdx.x] = targets[j];
    __syncthreads();
    if (threadIdx.x == 0)
      for (int64_t k = 0; k < n; k++) h = (h ^ (uint64_t)tile[k]) * 0x100000001b3ULL;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    h ^= h >> 29;
    float f = (float)(h & 0xFFFFFF); /* 24 bits: exact in float32 */
    fp[0] = f;
    fp[1] = -f;
  }
}

extern "C" tp_status_t tp_cuda_xent_row_max(tp_stream_t s, float *rowmax, const float *logits, int64_t M, int64_t V) {
  if (M == 0) return TP_SUCCESS;
  tpk_xent_row_max<<<tpk_grid(M, 1), TPK_THREADS, 0, tpk_stream(s)>>>(rowmax, logits, M, V);
  return tpk_launched("xent_row_max");
}

extern "C" tp_status_t tp_cuda_xent_row_sums(tp_stream_t s, float *sums, const float *logits, const float *gmax,
                                             const int64_t *targets, int64_t M, int64_t lo, int64_t V) {
  if (M == 0) return TP_SUCCESS;
  tpk_xent_row_sums<<<tpk_grid(M, 1), TPK_THREADS, 0, tpk_stream(s)>>>(sums, logits, gmax, targets, M, lo, V);
  return tpk_launched("xent_row_sums");
}

extern "C" tp_status_t tp_cuda_xent_loss(tp_stream_t s, float *losses, const float *sumexp, const float *gmax,
                                         const float *target_logit, const int64_t *targets, int64_t M) {
  if (M == 0) return TP_SUCCESS;
  tpk_xent_loss<<<tpk_grid(M, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(losses, sumexp, gmax, target_logit,
                                                                             targets, M);
  return tpk_launched("xent_loss");
}

extern "C" tp_status_t tp_cuda_xent_row_scale(tp_stream_t s, float *row_scale, const int64_t *targets,
                                              const float *dloss, int64_t M) {
  if (M == 0) return TP_SUCCESS;
  tpk_xent_row_scale<<<tpk_grid(M, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(row_scale, targets, dloss, M);
  return tpk_launched("xent_row_scale");
}

extern "C" tp_status_t tp_cuda_xent_backward(tp_stream_t s, float *dlogits, const float *logits, const float *gmax,
                                             const float *sumexp, const int64_t *targets, const float *row_scale,
                                             float scale, int64_t M, int64_t lo, int64_t V) {
  if (M == 0 || V == 0) return TP_SUCCESS;
  tpk_xent_bwd<<<tpk_grid(M, 1), TPK_THREADS, 0, tpk_stream(s)>>>(dlogits, logits, gmax, sumexp, targets, row_scale,
                                                                  scale, M, lo, V);
  return tpk_launched("xent_backward");
}

extern "C" tp_status_t tp_cuda_xent_targets(tp_stream_t s, int64_t *out, int64_t *result, const int64_t *targets,
                                            int64_t M, int64_t ignore_index, int64_t vocab) {
  tpk_xent_targets<<<1, 1024, 0, tpk_stream(s)>>>(out, result, targets, M, ignore_index, vocab);
  return tpk_launched("xent_targets");
}

extern "C" tp_status_t tp_cuda_xent_targets_hash(tp_stream_t s, float *fp, const int64_t *targets, int64_t M,
                                                 int64_t ignore_index) {
  tpk_xent_targets_hash<<<1, TPK_THREADS, 0, tpk_stream(s)>>>(fp, targets, M, ignore_index);
  return tpk_launched("xent_targets_hash");
}
