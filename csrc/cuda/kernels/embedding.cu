/* Vocab-parallel embedding on CUDA (shard [lo, lo + V) of the vocabulary).
 *
 * embedding_forward: one block of 256 threads per row (grid-stride over rows); a row
 * of the table or zeros.
 * embedding_backward, deterministic without atomics or workspace: one block of 256
 * threads per row m (grid-stride over rows).  A block whose token is in the shard and
 * whose row is the token's first occurrence (a scan of tokens[0, m) in tiles of 256,
 * __syncthreads_or) owns the table row: it adds the dout rows of every occurrence
 * m' >= m in row order (a scan of tokens[m, M) in tiles, the tile's hits in shared
 * memory), thread t taking the columns t, t + 256, ...  So each dtable element has
 * one writer, adding in row order: the CPU's additions, the same bits. */
#include "common.cuh"

__global__ void __launch_bounds__(TPK_THREADS) tpk_embedding_fwd(float *out, const int64_t *tokens, const float *table,
                                                                 int64_t M, int64_t lo, int64_t V, int64_t C) {
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    uint64_t t = (uint64_t)tokens[m] - (uint64_t)lo; /* in [0, V) iff in the shard */
    float *o = out + m * C;
    if (t < (uint64_t)V) {
      const float *r = table + (int64_t)t * C;
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = r[c];
    } else {
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = 0.0f;
    }
  }
}

__global__ void __launch_bounds__(TPK_THREADS)
    tpk_embedding_bwd(float *dtable, const int64_t *tokens, const float *dout, int64_t M, int64_t lo, int64_t V,
                      int64_t C) {
  __shared__ unsigned char hit[TPK_THREADS];
  const int64_t bd = blockDim.x;
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    int64_t tok = tokens[m];
    uint64_t t = (uint64_t)tok - (uint64_t)lo;
    if (t >= (uint64_t)V) continue; /* block-uniform */
    int first = 1;
    for (int64_t base = 0; base < m; base += bd) {
      int64_t j = base + threadIdx.x;
      if (__syncthreads_or(j < m && tokens[j] == tok)) {
        first = 0;
        break;
      }
    }
    if (!first) continue; /* block-uniform: __syncthreads_or gives every thread the same answer */
    float *dst = dtable + (int64_t)t * C;
    for (int64_t base = m; base < M; base += bd) {
      int64_t j = base + threadIdx.x;
      int h = j < M && tokens[j] == tok;
      hit[threadIdx.x] = (unsigned char)h;
      if (__syncthreads_or(h)) { /* also the barrier that publishes hit[] */
        int64_t n = M - base < bd ? M - base : bd;
        for (int64_t k = 0; k < n; k++)
          if (hit[k]) {
            const float *src = dout + (base + k) * C;
            for (int64_t c = threadIdx.x; c < C; c += bd) dst[c] += src[c];
          }
      }
      __syncthreads(); /* hit[] is rewritten by the next tile */
    }
  }
}

extern "C" tp_status_t tp_cuda_embedding_forward(tp_stream_t s, float *out, const int64_t *tokens, const float *table,
                                                 int64_t M, int64_t lo, int64_t V, int64_t C) {
  if (M == 0 || C == 0) return TP_SUCCESS;
  tpk_embedding_fwd<<<tpk_grid(M, 1), TPK_THREADS, 0, tpk_stream(s)>>>(out, tokens, table, M, lo, V, C);
  return tpk_launched("embedding_forward");
}

extern "C" tp_status_t tp_cuda_embedding_backward(tp_stream_t s, float *dtable, const int64_t *tokens,
                                                  const float *dout, int64_t M, int64_t lo, int64_t V, int64_t C) {
  if (M == 0 || C == 0 || V == 0) return TP_SUCCESS;
  tpk_embedding_bwd<<<tpk_grid(M, 1), TPK_THREADS, 0, tpk_stream(s)>>>(dtable, tokens, dout, M, lo, V, C);
  return tpk_launched("embedding_backward");
}
