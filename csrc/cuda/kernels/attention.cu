/* CUDA attention forward (training, prefill and decode in one fused kernel), the split-K
 * decode combine, the probabilities for callers that keep them, the KV-cache write and
 * the positions.  attention_common.cuh has the layouts; backward is attention_bwd.cu.
 *
 * Forward (fwd_kernel<DMAX>, DMAX = 32/64/128/256 >= D): a block of 128 threads (4 warps)
 * takes kBQ = 16 query rows of one (sequence, query head), 4 rows per warp, and walks the
 * keys the block can see (causal: up to its last row's limit; decode: up to k_len; a
 * window: from its first row's window start; a ring cache: key j at row j % kv_ring; a paged
 * cache: key j in its block of the pool, keys in no block not visible) in
 * tiles of 32 keys staged in shared memory (K and V tiles, 32 x smem_ld(D) floats each,
 * plus the 16 query rows: (2 x 32 + 16) x smem_ld(D) x 4 bytes, 82 KB at D = 256, 9 KB
 * at D = 64).  Lane c scores key c of the tile for each of its warp's rows; the running
 * max m, sum l and the output accumulators (lane owns dims lane + 32 n, DMAX / 32 per row)
 * stay in registers (online softmax: rescaled by exp(m_old - m_new) per tile).  No score
 * ever reaches global memory.  The T x T probabilities are written only when the caller
 * asks for them (probs_kernel, recomputed from lse: the CPU-compatible path the tests use).
 *
 * Split-K (decode: few query blocks over a long cache): blockIdx.y picks one of nsplit
 * contiguous key ranges of `chunk` keys from the block's first key; each writes its unnormalised accumulators and
 * (m, l) to the workspace, and combine_kernel (one warp per query row) merges them:
 * M = max m_s, L = sum l_s exp(m_s - M), o = sum acc_s exp(m_s - M) / L, lse = M + log L.
 * The split count depends on the arguments only (so attention_workspace can size it). */
#include "attention_common.cuh"

using namespace tp_attn;

namespace {

constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = 4;
constexpr int kBQ = kWarps * kRowsPerWarp; /* query rows per forward block */
constexpr int kBK = 32;                    /* keys per tile: one per lane */

struct FwdPlan {
  int64_t rows, qtiles, chunk; /* rows = B Hq Tq; keys per split */
  int nsplit;
  size_t part_off, ml_off, lse_off, total; /* workspace layout (bytes) */
};

FwdPlan plan_forward(const tp_attention_args *a) {
  FwdPlan p;
  p.rows = a->B * a->Hq * a->Tq;
  p.qtiles = (a->Tq + kBQ - 1) / kBQ;
  int64_t blocks = a->B * a->Hq * p.qtiles;
  p.nsplit = 1;
  p.chunk = a->Tk > 0 ? a->Tk : 1;
  if (blocks > 0 && blocks < 264 && a->Tk >= 512) { /* too few blocks to fill a GPU: split the keys */
    int64_t want = (528 + blocks - 1) / blocks, most = (a->Tk + 255) / 256;
    int64_t n = want < most ? want : most;
    if (n > 64) n = 64;
    if (n > 1) {
      int64_t chunk = (a->Tk + n - 1) / n;
      chunk = (chunk + kBK - 1) / kBK * kBK;
      p.chunk = chunk;
      p.nsplit = (int)((a->Tk + chunk - 1) / chunk);
    }
  }
  size_t at = 0;
  p.part_off = at;
  if (p.nsplit > 1) {
    int64_t n = 0, m = 0;
    if (!tp_mul_count(p.rows, a->D, &n) || !tp_mul_count(n, p.nsplit, &n) || !tp_mul_count(p.rows, 2 * p.nsplit, &m))
      n = -1;
    at = ws_add(at, n);
    p.ml_off = at;
    at = ws_add(at, m);
  } else {
    p.ml_off = at;
  }
  p.lse_off = at;
  if (a->probs && !a->lse) at = ws_add(at, p.rows); /* the probabilities are recomputed from lse */
  p.total = at;
  return p;
}

template <int DMAX>
__global__ void __launch_bounds__(kThreads) fwd_kernel(tp_attention_args a, int64_t qtiles, int nsplit, int64_t chunk,
                                                       float *part, float *part_ml, float *lse_out) {
  constexpr int NV = DMAX / 32; /* output dims per lane per row */
  extern __shared__ float sm[];
  const int D = (int)a.D, ld = smem_ld(a.D);
  float *Ks = sm, *Vs = Ks + kBK * ld, *Qs = Vs + kBK * ld;
  const int64_t tile = blockIdx.x % qtiles, bh = blockIdx.x / qtiles;
  const int64_t b = bh / a.Hq, h = bh % a.Hq, g = kv_head(a, h);
  if (b >= a.B || g < 0 || g >= a.Hk) return; /* block-uniform */
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, split = blockIdx.y;
  const int64_t i0 = tile * kBQ, Tq = a.Tq;
  const int64_t nrows = Tq - i0 < kBQ ? Tq - i0 : kBQ;
  const int64_t kseq = kv_seq(a, b); /* the KV sequence (slot) of sequence b; -1: none, no keys */
  const int64_t kmax = kseq < 0 ? 0 : key_limit(a, b, i0 + nrows - 1); /* the last row sees the most keys */
  const int64_t kmin = key_first(a, b, i0);                            /* the first row's window starts first */
  const int64_t kbeg = kmin + (int64_t)split * chunk;                  /* the splits cut [kmin, kmax): <= Tk keys */
  const int64_t kend = kbeg + chunk < kmax ? kbeg + chunk : kmax;

  for (int e = threadIdx.x; e < kBQ * D; e += kThreads) {
    int r = e / D, d = e % D;
    Qs[r * ld + d] = i0 + r < Tq ? a.q[(b * Tq + i0 + r) * a.q_ld + h * a.D + d] : 0.0f;
  }
  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][NV];
  int64_t lim[kRowsPerWarp], lo[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; r++) {
    int64_t i = i0 + warp * kRowsPerWarp + r;
    lim[r] = i < Tq && kseq >= 0 ? key_limit(a, b, i) : 0;
    lo[r] = key_first(a, b, i);
    m[r] = -INFINITY, l[r] = 0.0f;
#pragma unroll
    for (int n = 0; n < NV; n++) acc[r][n] = 0.0f;
  }
  const int64_t kb = kseq < 0 || a.kv_block_size > 0 ? 0 : kseq; /* paged: key_off places each key in the pool */
  const float *Kb = a.k + kb * a.kv_bstride + g * a.D, *Vb = a.v + kb * a.kv_bstride + g * a.D;
  for (int64_t j0 = kbeg; j0 < kend; j0 += kBK) {
    __syncthreads(); /* the previous tile is consumed (the first time: Qs is written) */
    for (int e = threadIdx.x; e < kBK * D; e += kThreads) {
      int jj = e / D, d = e % D;
      int64_t j = j0 + jj, off = j < kend ? key_off(a, b, j) : -1;
      Ks[jj * ld + d] = off >= 0 ? Kb[off + d] : 0.0f;
      Vs[jj * ld + d] = off >= 0 ? Vb[off + d] : 0.0f;
    }
    __syncthreads();
    const int64_t j = j0 + lane;
    const bool on = j < kend && key_on(a, b, j) && key_off(a, b, j) >= 0;
    const int ntile = kend - j0 < kBK ? (int)(kend - j0) : kBK;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; r++) {
      const float *qr = Qs + (warp * kRowsPerWarp + r) * ld;
      float s = -INFINITY;
      if (on && j < lim[r] && j >= lo[r]) {
        const float *kr = Ks + lane * ld;
        float dot = 0.0f;
        for (int d = 0; d < D; d++) dot = fmaf(qr[d], kr[d], dot);
        s = cap_score(a, dot * a.scale);
      }
      const float mnew = fmaxf(m[r], warp_max(s));
      if (mnew == -INFINITY) continue; /* warp-uniform: nothing visible to this row yet */
      const float p = s == -INFINITY ? 0.0f : expf(s - mnew);
      const float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - mnew);
      l[r] = l[r] * alpha + warp_sum(p);
      m[r] = mnew;
#pragma unroll
      for (int n = 0; n < NV; n++) acc[r][n] *= alpha;
      for (int c = 0; c < ntile; c++) {
        const float pc = __shfl_sync(kFull, p, c);
        if (pc == 0.0f) continue; /* warp-uniform */
        const float *vr = Vs + c * ld;
#pragma unroll
        for (int n = 0; n < NV; n++) {
          int d = lane + 32 * n;
          if (d < D) acc[r][n] = fmaf(pc, vr[d], acc[r][n]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; r++) {
    const int64_t i = i0 + warp * kRowsPerWarp + r;
    if (i >= Tq) continue;
    const int64_t row = (b * a.Hq + h) * Tq + i;
    if (nsplit == 1) {
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      float *orow = a.o + (b * Tq + i) * a.o_ld + h * a.D;
#pragma unroll
      for (int n = 0; n < NV; n++) {
        int d = lane + 32 * n;
        if (d < D) orow[d] = acc[r][n] * inv;
      }
      if (lse_out && lane == 0) lse_out[row] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
    } else {
      const int64_t prow = (int64_t)split * (a.B * a.Hq * Tq) + row;
      float *pr = part + prow * a.D;
#pragma unroll
      for (int n = 0; n < NV; n++) {
        int d = lane + 32 * n;
        if (d < D) pr[d] = acc[r][n];
      }
      if (lane == 0) part_ml[2 * prow] = m[r], part_ml[2 * prow + 1] = l[r];
    }
  }
}

/* One warp per query row: merge the nsplit partial results of fwd_kernel. */
__global__ void __launch_bounds__(kThreads)
    combine_kernel(tp_attention_args a, int nsplit, const float *part, const float *part_ml, float *lse_out) {
  const int64_t rows = a.B * a.Hq * a.Tq;
  const int64_t row = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t i = row % a.Tq, bh = row / a.Tq, b = bh / a.Hq, h = bh % a.Hq, g = kv_head(a, h);
  if (g < 0 || g >= a.Hk) return; /* fwd_kernel skipped this head */
  float M = -INFINITY;
  for (int s = 0; s < nsplit; s++) M = fmaxf(M, part_ml[2 * ((int64_t)s * rows + row)]);
  float L = 0.0f;
  if (M != -INFINITY)
    for (int s = 0; s < nsplit; s++) {
      const float ms = part_ml[2 * ((int64_t)s * rows + row)];
      if (ms != -INFINITY) L += part_ml[2 * ((int64_t)s * rows + row) + 1] * expf(ms - M);
    }
  const float inv = L > 0.0f ? 1.0f / L : 0.0f;
  float *orow = a.o + (b * a.Tq + i) * a.o_ld + h * a.D;
  for (int64_t d = lane; d < a.D; d += 32) {
    float sum = 0.0f;
    if (L > 0.0f)
      for (int s = 0; s < nsplit; s++) {
        const float ms = part_ml[2 * ((int64_t)s * rows + row)];
        if (ms != -INFINITY) sum += part[((int64_t)s * rows + row) * a.D + d] * expf(ms - M);
      }
    orow[d] = sum * inv;
  }
  if (lse_out && lane == 0) lse_out[row] = L > 0.0f ? M + logf(L) : -INFINITY;
}

/* The probabilities [B, Hq, Tq, Tk] for a caller that keeps them: one block per query row,
 * P = exp(s - lse) (s: the scaled, capped score) on the visible keys, 0 elsewhere (the whole
 * row of Tk). */
__global__ void __launch_bounds__(kThreads) probs_kernel(tp_attention_args a, const float *lse) {
  __shared__ float qs[kMaxD];
  const int64_t row = blockIdx.x, i = row % a.Tq, bh = row / a.Tq, b = bh / a.Hq, h = bh % a.Hq;
  const int64_t g = kv_head(a, h);
  if (b >= a.B || g < 0 || g >= a.Hk) return;
  for (int64_t d = threadIdx.x; d < a.D; d += kThreads) qs[d] = a.q[(b * a.Tq + i) * a.q_ld + h * a.D + d];
  __syncthreads();
  const float L = lse[row];
  const int64_t kseq = kv_seq(a, b);
  const int64_t lim = kseq < 0 ? 0 : key_limit(a, b, i), lo = key_first(a, b, i);
  /* no ring: probs refuse one; paged: key_off places each key in the pool */
  const float *Kb = a.k + (kseq < 0 || a.kv_block_size > 0 ? 0 : kseq) * a.kv_bstride + g * a.D;
  float *prow = a.probs + row * a.Tk;
  for (int64_t j = threadIdx.x; j < a.Tk; j += kThreads) {
    float p = 0.0f;
    const int64_t off = L != -INFINITY && j < lim && j >= lo && key_on(a, b, j) ? key_off(a, b, j) : -1;
    if (off >= 0) {
      const float *kr = Kb + off;
      float dot = 0.0f;
      for (int64_t d = 0; d < a.D; d++) dot = fmaf(qs[d], kr[d], dot);
      p = expf(cap_score(a, dot * a.scale) - L);
    }
    prow[j] = p;
  }
}

template <int DMAX>
tp_status_t launch_forward(cudaStream_t st, const tp_attention_args *a, const FwdPlan &p, char *ws) {
  const char *op = "attention_forward";
  const size_t smem = (size_t)(2 * kBK + kBQ) * smem_ld(a->D) * sizeof(float);
  TP_CHECK(cuda_check(cudaFuncSetAttribute(fwd_kernel<DMAX>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                      op, "cudaFuncSetAttribute(fwd_kernel shared memory)"));
  float *part = p.nsplit > 1 ? (float *)(ws + p.part_off) : NULL;
  float *ml = p.nsplit > 1 ? (float *)(ws + p.ml_off) : NULL;
  float *lse = a->lse ? a->lse : a->probs ? (float *)(ws + p.lse_off) : NULL;
  const int64_t blocks = a->B * a->Hq * p.qtiles;
  fwd_kernel<DMAX><<<dim3((unsigned)blocks, (unsigned)p.nsplit), kThreads, smem, st>>>(*a, p.qtiles, p.nsplit, p.chunk,
                                                                                       part, ml, lse);
  TP_CHECK(launch_check(op, "fwd_kernel launch"));
  if (p.nsplit > 1) {
    combine_kernel<<<(unsigned)((p.rows + kWarps - 1) / kWarps), kThreads, 0, st>>>(*a, p.nsplit, part, ml, lse);
    TP_CHECK(launch_check(op, "combine_kernel launch"));
  }
  if (a->probs && a->Tk > 0) {
    probs_kernel<<<(unsigned)p.rows, kThreads, 0, st>>>(*a, lse);
    TP_CHECK(launch_check(op, "probs_kernel launch"));
  }
  return TP_SUCCESS;
}

} // namespace

extern "C" size_t tp_cuda_attention_backward_workspace_(const tp_attention_args *a); /* attention_bwd.cu */

extern "C" size_t tp_cuda_attention_workspace(const tp_attention_args *a, int backward) {
  if (backward) return tp_cuda_attention_backward_workspace_(a);
  if (a->B * a->Hq * a->Tq == 0) return 0;
  return plan_forward(a).total;
}

extern "C" tp_status_t tp_cuda_attention_forward(tp_stream_t s, const tp_attention_args *a, void *workspace,
                                                 size_t workspace_bytes) {
  const char *op = "attention_forward";
  if (a->B == 0 || a->Hq == 0 || a->Tq == 0) return TP_SUCCESS;
  if (a->D > kMaxD)
    return tp_set_error(TP_ERR_UNSUPPORTED, "cuda %s: head size D = %lld is above the %d the CUDA kernels take", op,
                        (long long)a->D, kMaxD);
  FwdPlan p = plan_forward(a);
  if (p.total == SIZE_MAX) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda %s: the workspace size overflows", op);
  if (p.total && (!workspace || workspace_bytes < p.total))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "cuda %s: the workspace of %zu bytes is below the %zu bytes these "
                        "arguments need (ask attention_workspace)",
                        op, workspace ? workspace_bytes : 0, p.total);
  if (a->B * a->Hq * p.qtiles > INT32_MAX || p.rows > INT32_MAX)
    return tp_set_error(TP_ERR_UNSUPPORTED, "cuda %s: B x Hq x Tq = %lld query rows is more than one launch takes", op,
                        (long long)p.rows);
  cudaStream_t st = (cudaStream_t)s;
  char *ws = (char *)workspace;
  switch (dmax_of(a->D)) {
    case 32: return launch_forward<32>(st, a, p, ws);
    case 64: return launch_forward<64>(st, a, p, ws);
    case 128: return launch_forward<128>(st, a, p, ws);
    default: return launch_forward<256>(st, a, p, ws);
  }
}

/* ------------------------------------------------------------- KV cache, positions */

namespace {

/* Rows t0 .. T - 1 of each sequence (a ring: t0 = T - ring when T > ring, each ring row once). */
__global__ void kv_write_kernel(float *kc, float *vc, const float *k, const float *v, int64_t ld, const int64_t *pos0,
                                const int64_t *slots, int64_t B, int64_t T, int64_t t0, int64_t max_len, int64_t width,
                                int64_t ring) {
  const int64_t nt = T - t0, n = B * nt * width;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = e % width, bt = e / width, t = t0 + bt % nt, b = bt / nt, sb = slots ? slots[b] : b;
    const int64_t p = pos0[b] + t, r = ring > 0 ? p % ring : p;
    const int64_t dst = (sb * max_len + r) * width + c, src = (b * T + t) * ld + c;
    kc[dst] = k[src];
    vc[dst] = v[src];
  }
}

/* Every (b, t) of a paged write: position pos0[b] + t into its block's row (no block: skipped). */
__global__ void kv_write_paged_kernel(float *kc, float *vc, const float *k, const float *v, int64_t ld,
                                      const int64_t *pos0, const int64_t *table, int64_t cols, int64_t bs, int64_t B,
                                      int64_t T, int64_t width) {
  const int64_t n = B * T * width;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = e % width, bt = e / width, t = bt % T, b = bt / T, p = pos0[b] + t;
    const int64_t blk = p / bs < cols ? table[b * cols + p / bs] : -1;
    if (blk < 0) continue;
    const int64_t dst = (blk * bs + p % bs) * width + c, src = (b * T + t) * ld + c;
    kc[dst] = k[src];
    vc[dst] = v[src];
  }
}

__global__ void positions_kernel(int64_t *pos, int64_t *klen, const int64_t *pos0, int64_t B, int64_t T) {
  const int64_t n = B * T;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = e / T, t = e % T;
    pos[e] = pos0[b] + t;
    if (klen && t == 0) klen[b] = pos0[b] + T;
  }
  if (klen && T == 0) /* no tokens: klen[b] = pos0[b] */
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < B; b += (int64_t)gridDim.x * blockDim.x)
      klen[b] = pos0[b];
}

} // namespace

extern "C" tp_status_t tp_cuda_kv_cache_write(tp_stream_t s, float *kcache, float *vcache, const float *k,
                                              const float *v, int64_t ld, const int64_t *pos0, const int64_t *slots,
                                              int64_t B, int64_t T, int64_t max_len, int64_t width, int64_t ring) {
  if (B <= 0 || T <= 0 || width <= 0) return TP_SUCCESS;
  const int64_t t0 = ring > 0 && T > ring ? T - ring : 0;
  int64_t n;
  if (!tp_mul_count(B, T - t0, &n) || !tp_mul_count(n, width, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda kv_cache_write: B x T x width overflows");
  kv_write_kernel<<<grid_for(n, 256), 256, 0, (cudaStream_t)s>>>(kcache, vcache, k, v, ld, pos0, slots, B, T, t0,
                                                                 max_len, width, ring);
  return launch_check("kv_cache_write", "kv_write_kernel launch");
}

extern "C" tp_status_t tp_cuda_kv_cache_write_paged(tp_stream_t s, float *kcache, float *vcache, const float *k,
                                                    const float *v, int64_t ld, const int64_t *pos0,
                                                    const int64_t *table, int64_t cols, int64_t bs, int64_t B,
                                                    int64_t T, int64_t width) {
  if (B <= 0 || T <= 0 || width <= 0) return TP_SUCCESS;
  int64_t n;
  if (!tp_mul_count(B, T, &n) || !tp_mul_count(n, width, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda kv_cache_write_paged: B x T x width overflows");
  kv_write_paged_kernel<<<grid_for(n, 256), 256, 0, (cudaStream_t)s>>>(kcache, vcache, k, v, ld, pos0, table, cols, bs,
                                                                       B, T, width);
  return launch_check("kv_cache_write_paged", "kv_write_paged_kernel launch");
}

extern "C" tp_status_t tp_cuda_positions(tp_stream_t s, int64_t *pos, int64_t *klen, const int64_t *pos0, int64_t B,
                                         int64_t T) {
  if (B <= 0) return TP_SUCCESS;
  int64_t n;
  if (!tp_mul_count(B, T, &n)) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda positions: B x T overflows");
  positions_kernel<<<grid_for(n > B ? n : B, 256), 256, 0, (cudaStream_t)s>>>(pos, klen, pos0, B, T);
  return launch_check("positions", "positions_kernel launch");
}
