/* CUDA attention backward, FlashAttention-2 style (our own code), deterministic: no
 * float atomics, every gradient element summed by one thread in a fixed order.
 *
 *   1. dvec_kernel: Dv[row] = rowsum(dP * P) for each query row, into the workspace
 *      ([B, Hq, Tq] floats).  From o when the probabilities are recomputed (the lse
 *      mode: rowsum(dout * o), o being forward's output), else from the kept probs
 *      (sum_j P_ij (dout_i . v_j): the CPU entry's definition, which does not read o).
 *   2. dkdv_kernel<DMAX, BK>: one block per (sequence, KV head, tile of BK keys) walks the
 *      query heads of that KV head and the query tiles (16 rows) that can see the keys
 *      (causal: from the tile of row j0 - q_pos on; a window: up to the row whose window
 *      still reaches the tile); per tile it forms P (kept, or exp(s - lse), s the scaled and
 *      capped score) and dS = P (dP - Dv) scale (times 1 - tanh^2 of the raw score / softcap
 *      with the cap) in shared memory, and each thread
 *      adds its own (key, dim) elements of dV += P^T dO and dK += dS^T Q in registers.
 *   3. dq_kernel<DMAX, BK>: one block per (sequence, query head, tile of 16 rows) walks the
 *      key tiles its rows can see (from the first row's window start to the last row's
 *      limit): dQ += dS K, one (row, dim) element per register.
 * Shared memory of 2 and 3: K, V tiles (BK x smem_ld(D)), Q, dO tiles (16 x smem_ld(D)),
 * P and dS tiles (16 x (BK + 1)) and 16-row vectors: BK = 32 for D <= 128 (51 KB at
 * D = 128), BK = 16 at D = 256 (68 KB).  Accumulators: BK x DMAX / 128 (dK and dV each)
 * and 16 x DMAX / 128 (dQ) floats per thread, at most 32. */
#include "attention_common.cuh"

using namespace tp_attn;

namespace {

constexpr int kBQ = 16; /* query rows per tile */

template <int DMAX>
struct Tiles {
  static constexpr int BK = DMAX == 256 ? 16 : 32;
  static size_t smem_floats(int ld) { return (size_t)(2 * BK + 2 * kBQ) * ld + 2 * kBQ * (BK + 1) + 2 * kBQ; }
};

/* Row vector Dv = rowsum(dP * P), one warp per query row. */
__global__ void __launch_bounds__(kThreads) dvec_kernel(tp_attention_args a, const float *dout, float *dv) {
  const int64_t rows = a.B * a.Hq * a.Tq;
  const int64_t row = (int64_t)blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t i = row % a.Tq, bh = row / a.Tq, b = bh / a.Hq, h = bh % a.Hq, g = kv_head(a, h);
  const float *dO = dout + (b * a.Tq + i) * a.o_ld + h * a.D;
  float sum = 0.0f;
  if (!a.probs) {
    const float *O = a.o + (b * a.Tq + i) * a.o_ld + h * a.D;
    for (int64_t d = lane; d < a.D; d += 32) sum = fmaf(dO[d], O[d], sum);
  } else if (g >= 0 && g < a.Hk) {
    const float *P = a.probs + row * a.Tk, *Vb = a.v + b * a.kv_bstride + g * a.D;
    const int64_t lim = key_limit(a, b, i), lo = key_first(a, b, i);
    for (int64_t j = lo + lane; j < lim; j += 32) {
      if (!key_on(a, b, j) || P[j] == 0.0f) continue;
      const float *vr = Vb + j * a.kv_ld;
      float dot = 0.0f;
      for (int64_t d = 0; d < a.D; d++) dot = fmaf(dO[d], vr[d], dot);
      sum = fmaf(P[j], dot, sum);
    }
  }
  sum = warp_sum(sum);
  if (lane == 0) dv[row] = sum;
}

/* Shared-memory layout of dkdv_kernel and dq_kernel. */
struct Smem {
  float *Ks, *Vs, *Qs, *dOs, *Ps, *dSs, *Ls, *Dvs;
  int64_t *Lim, *Lo; /* per query row: keys [Lo, Lim) (Lim 0 for rows past Tq) */
};

template <int BK>
__device__ inline Smem carve(float *sm, int ld) {
  Smem s;
  s.Ks = sm, s.Vs = s.Ks + BK * ld, s.Qs = s.Vs + BK * ld, s.dOs = s.Qs + kBQ * ld;
  s.Ps = s.dOs + kBQ * ld, s.dSs = s.Ps + kBQ * (BK + 1), s.Ls = s.dSs + kBQ * (BK + 1), s.Dvs = s.Ls + kBQ;
  return s;
}

/* Rows i0 .. i0 + 15 of query head h: Q, dO, lse, Dv and key limits into shared memory. */
__device__ inline void load_queries(const tp_attention_args &a, const Smem &s, int ld, int64_t b, int64_t h, int64_t i0,
                                    const float *dout, const float *dv) {
  const int D = (int)a.D;
  for (int e = threadIdx.x; e < kBQ * D; e += kThreads) {
    const int r = e / D, d = e % D;
    const int64_t i = i0 + r;
    const bool in = i < a.Tq;
    s.Qs[r * ld + d] = in ? a.q[(b * a.Tq + i) * a.q_ld + h * a.D + d] : 0.0f;
    s.dOs[r * ld + d] = in ? dout[(b * a.Tq + i) * a.o_ld + h * a.D + d] : 0.0f;
  }
  for (int r = threadIdx.x; r < kBQ; r += kThreads) {
    const int64_t i = i0 + r, row = (b * a.Hq + h) * a.Tq + i;
    const bool in = i < a.Tq;
    s.Ls[r] = in && a.lse && !a.probs ? a.lse[row] : 0.0f;
    s.Dvs[r] = in ? dv[row] : 0.0f;
    s.Lim[r] = in ? key_limit(a, b, i) : 0;
    s.Lo[r] = key_first(a, b, i);
  }
}

/* Keys j0 .. j0 + BK - 1 of KV head g (zeros past Tk). */
template <int BK>
__device__ inline void load_keys(const tp_attention_args &a, const Smem &s, int ld, int64_t b, int64_t g, int64_t j0) {
  const int D = (int)a.D;
  const float *Kb = a.k + b * a.kv_bstride + g * a.D, *Vb = a.v + b * a.kv_bstride + g * a.D;
  for (int e = threadIdx.x; e < BK * D; e += kThreads) {
    const int c = e / D, d = e % D;
    const int64_t j = j0 + c;
    const bool in = j < a.Tk;
    s.Ks[c * ld + d] = in ? Kb[j * a.kv_ld + d] : 0.0f;
    s.Vs[c * ld + d] = in ? Vb[j * a.kv_ld + d] : 0.0f;
  }
}

/* P and dS = P (dP - Dv) scale (times the cap's slope 1 - tanh^2 with softcap) of the 16 x BK
 * tile (zero where the key is not visible). */
template <int BK>
__device__ inline void tile_scores(const tp_attention_args &a, const Smem &s, int ld, int64_t b, int64_t h, int64_t i0,
                                   int64_t j0) {
  const int D = (int)a.D;
  for (int e = threadIdx.x; e < kBQ * BK; e += kThreads) {
    const int r = e / BK, c = e % BK;
    const int64_t i = i0 + r, j = j0 + c;
    float P = 0.0f, dS = 0.0f;
    if (j < s.Lim[r] && j >= s.Lo[r] && key_on(a, b, j)) { /* Lim[r] = 0 past Tq; Lim <= Tk */
      float raw = 0.0f;                                    /* the scaled score before the cap */
      if (!a.probs || a.softcap > 0.0f) {
        const float *qr = s.Qs + r * ld, *kr = s.Ks + c * ld;
        float dot = 0.0f;
        for (int d = 0; d < D; d++) dot = fmaf(qr[d], kr[d], dot);
        raw = dot * a.scale;
      }
      if (a.probs) P = a.probs[((b * a.Hq + h) * a.Tq + i) * a.Tk + j];
      else if (s.Ls[r] != -INFINITY) P = expf(cap_score(a, raw) - s.Ls[r]);
      if (P != 0.0f) {
        const float *gr = s.dOs + r * ld, *vr = s.Vs + c * ld;
        float dp = 0.0f;
        for (int d = 0; d < D; d++) dp = fmaf(gr[d], vr[d], dp);
        dS = P * (dp - s.Dvs[r]) * a.scale * cap_slope(a, raw);
      }
    }
    s.Ps[r * (BK + 1) + c] = P;
    s.dSs[r * (BK + 1) + c] = dS;
  }
}

template <int DMAX>
__global__ void __launch_bounds__(kThreads)
    dkdv_kernel(tp_attention_args a, const float *dout, const float *dv, float *dK, float *dV, int64_t ktiles) {
  constexpr int BK = Tiles<DMAX>::BK, NA = BK * DMAX / kThreads;
  extern __shared__ float sm[];
  __shared__ int64_t lim[kBQ], lo[kBQ];
  const int ld = smem_ld(a.D), D = (int)a.D;
  Smem s = carve<BK>(sm, ld);
  s.Lim = lim, s.Lo = lo;
  const int64_t kt = blockIdx.x % ktiles, bg = blockIdx.x / ktiles, b = bg / a.Hk, g = bg % a.Hk;
  if (b >= a.B) return;
  const int64_t j0 = kt * BK;
  float ak[NA], av[NA];
#pragma unroll
  for (int n = 0; n < NA; n++) ak[n] = av[n] = 0.0f;
  load_keys<BK>(a, s, ld, b, g, j0);
  int64_t klim = a.k_len ? a.k_len[b] : a.Tk; /* no query sees a key past k_len */
  if (klim > a.Tk) klim = a.Tk;
  int64_t ifirst = 0, iend = a.Tq; /* the query rows [ifirst, iend) that can see keys j0 .. j0 + BK - 1 */
  const int64_t qp = a.q_pos ? a.q_pos[b] : 0;
  if (a.causal) /* query i sees key j0 only if i >= j0 - q_pos */
    ifirst = j0 - qp > 0 ? (j0 - qp) / kBQ * kBQ : 0;
  if (a.window > 0 && j0 + BK - 1 + a.window - qp < iend) /* a window: only if q_pos + i < j + window */
    iend = j0 + BK - 1 + a.window - qp;
  for (int64_t h = 0; h < a.Hq && j0 < klim; h++) {
    if (kv_head(a, h) != g) continue; /* block-uniform */
    for (int64_t i0 = ifirst; i0 < iend; i0 += kBQ) {
      __syncthreads(); /* the previous tile is consumed */
      load_queries(a, s, ld, b, h, i0, dout, dv);
      __syncthreads();
      tile_scores<BK>(a, s, ld, b, h, i0, j0);
      __syncthreads();
#pragma unroll
      for (int n = 0; n < NA; n++) {
        const int e = threadIdx.x + kThreads * n, c = e / DMAX, d = e % DMAX;
        if (d >= D) continue;
        float sk = ak[n], sv = av[n];
#pragma unroll 4
        for (int r = 0; r < kBQ; r++) {
          sv = fmaf(s.Ps[r * (BK + 1) + c], s.dOs[r * ld + d], sv);
          sk = fmaf(s.dSs[r * (BK + 1) + c], s.Qs[r * ld + d], sk);
        }
        ak[n] = sk, av[n] = sv;
      }
    }
  }
#pragma unroll
  for (int n = 0; n < NA; n++) { /* every key row < Tk of this KV head is overwritten (zeros if unseen) */
    const int e = threadIdx.x + kThreads * n, c = e / DMAX, d = e % DMAX;
    const int64_t j = j0 + c;
    if (d >= D || j >= a.Tk) continue;
    const int64_t at = b * a.kv_bstride + j * a.kv_ld + g * a.D + d;
    dK[at] = ak[n];
    dV[at] = av[n];
  }
}

template <int DMAX>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(tp_attention_args a, const float *dout, const float *dv, float *dQ, int64_t qtiles) {
  constexpr int BK = Tiles<DMAX>::BK, NA = kBQ * DMAX / kThreads;
  extern __shared__ float sm[];
  __shared__ int64_t lim[kBQ], lo[kBQ];
  const int ld = smem_ld(a.D), D = (int)a.D;
  Smem s = carve<BK>(sm, ld);
  s.Lim = lim, s.Lo = lo;
  const int64_t qt = blockIdx.x % qtiles, bh = blockIdx.x / qtiles, b = bh / a.Hq, h = bh % a.Hq;
  const int64_t g = kv_head(a, h);
  if (b >= a.B || g < 0 || g >= a.Hk) return; /* the CPU entry writes nothing for such a head */
  const int64_t i0 = qt * kBQ;
  const int64_t last = a.Tq - i0 < kBQ ? a.Tq - 1 : i0 + kBQ - 1;
  const int64_t kmax = key_limit(a, b, last);
  float aq[NA];
#pragma unroll
  for (int n = 0; n < NA; n++) aq[n] = 0.0f;
  load_queries(a, s, ld, b, h, i0, dout, dv);
  for (int64_t j0 = key_first(a, b, i0); j0 < kmax; j0 += BK) { /* from the first row's window start */
    __syncthreads(); /* the previous tile is consumed (the first time: the queries are loaded) */
    load_keys<BK>(a, s, ld, b, g, j0);
    __syncthreads();
    tile_scores<BK>(a, s, ld, b, h, i0, j0);
    __syncthreads();
#pragma unroll
    for (int n = 0; n < NA; n++) {
      const int e = threadIdx.x + kThreads * n, r = e / DMAX, d = e % DMAX;
      if (d >= D) continue;
      float sq = aq[n];
#pragma unroll 4
      for (int c = 0; c < BK; c++) sq = fmaf(s.dSs[r * (BK + 1) + c], s.Ks[c * ld + d], sq);
      aq[n] = sq;
    }
  }
#pragma unroll
  for (int n = 0; n < NA; n++) {
    const int e = threadIdx.x + kThreads * n, r = e / DMAX, d = e % DMAX;
    const int64_t i = i0 + r;
    if (d >= D || i >= a.Tq) continue;
    dQ[(b * a.Tq + i) * a.q_ld + h * a.D + d] = aq[n];
  }
}

template <int DMAX>
tp_status_t launch_backward(cudaStream_t st, const tp_attention_args *a, float *dq, float *dk, float *dv,
                            const float *dout, float *dvec) {
  const char *op = "attention_backward";
  constexpr int BK = Tiles<DMAX>::BK;
  const size_t smem = Tiles<DMAX>::smem_floats(smem_ld(a->D)) * sizeof(float);
  const int64_t ktiles = (a->Tk + BK - 1) / BK, qtiles = (a->Tq + kBQ - 1) / kBQ;
  const int64_t kblocks = a->B * a->Hk * ktiles, qblocks = a->B * a->Hq * qtiles;
  if (kblocks > INT32_MAX || qblocks > INT32_MAX)
    return tp_set_error(TP_ERR_UNSUPPORTED, "cuda %s: %lld key or %lld query tiles are more than one launch takes", op,
                        (long long)kblocks, (long long)qblocks);
  if (kblocks > 0) {
    TP_CHECK(cuda_check(cudaFuncSetAttribute(dkdv_kernel<DMAX>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                        op, "cudaFuncSetAttribute(dkdv_kernel shared memory)"));
    dkdv_kernel<DMAX><<<(unsigned)kblocks, kThreads, smem, st>>>(*a, dout, dvec, dk, dv, ktiles);
    TP_CHECK(launch_check(op, "dkdv_kernel launch"));
  }
  if (qblocks > 0) {
    TP_CHECK(cuda_check(cudaFuncSetAttribute(dq_kernel<DMAX>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                        op, "cudaFuncSetAttribute(dq_kernel shared memory)"));
    dq_kernel<DMAX><<<(unsigned)qblocks, kThreads, smem, st>>>(*a, dout, dvec, dq, qtiles);
    TP_CHECK(launch_check(op, "dq_kernel launch"));
  }
  return TP_SUCCESS;
}

} // namespace

/* Backward's workspace: Dv, one float per query row. */
extern "C" size_t tp_cuda_attention_backward_workspace_(const tp_attention_args *a) {
  int64_t rows;
  if (!tp_mul_count(a->B, a->Hq, &rows) || !tp_mul_count(rows, a->Tq, &rows)) return SIZE_MAX;
  return rows ? ws_add(0, rows) : 0;
}

extern "C" tp_status_t tp_cuda_attention_backward(tp_stream_t s, const tp_attention_args *a, float *dq, float *dk,
                                                  float *dv, const float *dout, void *workspace,
                                                  size_t workspace_bytes) {
  const char *op = "attention_backward";
  if (!a->probs && !a->lse)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda %s: no probs and no lse (forward must keep one)", op);
  if (a->B == 0) return TP_SUCCESS;
  if (a->D > kMaxD)
    return tp_set_error(TP_ERR_UNSUPPORTED, "cuda %s: head size D = %lld is above the %d the CUDA kernels take", op,
                        (long long)a->D, kMaxD);
  const size_t need = tp_cuda_attention_backward_workspace_(a);
  if (need == SIZE_MAX) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda %s: the workspace size overflows", op);
  if (need && (!workspace || workspace_bytes < need))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "cuda %s: the workspace of %zu bytes is below the %zu bytes these "
                        "arguments need (ask attention_workspace)",
                        op, workspace ? workspace_bytes : 0, need);
  cudaStream_t st = (cudaStream_t)s;
  float *dvec = (float *)workspace;
  const int64_t rows = a->B * a->Hq * a->Tq;
  if (rows > 0) {
    const int64_t blocks = (rows + kThreads / 32 - 1) / (kThreads / 32);
    if (blocks > INT32_MAX)
      return tp_set_error(TP_ERR_UNSUPPORTED, "cuda %s: %lld query rows are more than one launch takes", op,
                          (long long)rows);
    dvec_kernel<<<(unsigned)blocks, kThreads, 0, st>>>(*a, dout, dvec);
    TP_CHECK(launch_check(op, "dvec_kernel launch"));
  }
  switch (dmax_of(a->D)) {
    case 32: return launch_backward<32>(st, a, dq, dk, dv, dout, dvec);
    case 64: return launch_backward<64>(st, a, dq, dk, dv, dout, dvec);
    case 128: return launch_backward<128>(st, a, dq, dk, dv, dout, dvec);
    default: return launch_backward<256>(st, a, dq, dk, dv, dout, dvec);
  }
}
