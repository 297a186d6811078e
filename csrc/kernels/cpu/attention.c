/* Softmax attention on a rank's heads, forward and backward, for training
 * (queries = keys = the sequence) and for decoding over a KV cache.
 *
 * For each sequence b and query head h (KV head g = h / (Hq / Hk), grouped-query):
 *   S = scale * Q_bh K_bg^T   (Tq x Tk', GEMM)
 *   softcap c > 0: S = c tanh(S / c)  (Gemma 2's logit soft-capping)
 *   mask: key j exists if j < k_len[b] and key_mask[b][j]; with causal, query i
 *         (at position p = q_pos[b] + i) sees keys j <= p; with a window w, keys j > p - w
 *   P = softmax(S) over the visible keys (a row with none is all zero)
 *   O_bh = P V_bg             (GEMM)
 * The GEMMs of a block of queries cover only the keys [kmin, kmax) its rows can see
 * (kmax: its last row's limit; kmin: its first row's window start), so a decode step over
 * a long cache, a causal prefill and a sliding window (O(T x window)) touch only what they
 * need.  A ring cache (kv_ring, forward) holds the key of position j at row j % kv_ring: a
 * block's keys are then at most two runs of rows, one GEMM each.  A paged cache (kv_block_table,
 * forward) holds them in blocks of a pool: one GEMM per run of blocks that follow each other in
 * memory (a shuffled table: one per block); keys in no block (an entry < 0) are masked.  A
 * decode step (Tq = 1) takes the query heads of a KV group as the rows of one block.  Backward (P saved by
 * forward):
 *   dP = dO V^T;  dS = P * (dP - rowsum(dP * P)) * scale  (softcap: times 1 - tanh^2 of the
 *   raw scaled score, recomputed here with a GEMM);
 *   dQ = dS K;  dK += dS^T Q;  dV += P^T dO   (summed over the heads of a group)
 * The lse mode (probs NULL, lse kept by forward: lse = max + log(sum exp(S - max)) per
 * query row, -inf for a row that sees no key) recomputes a block of P = exp(S - lse)
 * from Q and K in backward, then runs the same block GEMMs.
 * Scratch (a block of scores without probs, a block of dP in backward, a block of
 * recomputed P in the lse mode, a block of raw scores with softcap) comes from the
 * caller's workspace, one slice per thread: tp_cpu_attention_workspace says how much. */
#include <math.h>
#include <string.h>

#include "../blas_impl.h"
#include "parallel.h"
#include "vmath.h"
#include "cpu_impl.h"

static void gemm(int transa, int transb, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                 const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  TP_BLAS(cblas_sgemm)(CblasRowMajor, transa ? CblasTrans : CblasNoTrans, transb ? CblasTrans : CblasNoTrans,
                       (tp_blasint)M, (tp_blasint)N, (tp_blasint)K, alpha, A, (tp_blasint)lda, B, (tp_blasint)ldb, beta,
                       C, (tp_blasint)ldc);
}

/* Key positions [*lo, *hi) that query i of sequence b may see (before the key mask);
 * *lo >= *hi: none. */
static void key_range(const tp_attention_args *a, int64_t b, int64_t i, int64_t *lo, int64_t *hi) {
  int64_t n = a->k_len ? a->k_len[b] : a->Tk, p = (a->q_pos ? a->q_pos[b] : 0) + i;
  if (!a->kv_ring && n > a->Tk) n = a->Tk;
  /* a ring's positions run past its Tk rows; keys past the step's last query are not in it */
  if (a->kv_ring && n > p - i + a->Tq) n = p - i + a->Tq;
  if (a->causal && p + 1 < n) n = p + 1;
  int64_t first = a->window > 0 && p - a->window + 1 > 0 ? p - a->window + 1 : 0;
  if (a->kv_ring && first < p - i + a->Tq - a->kv_ring) /* overwritten by this step (the checks rule it out) */
    first = p - i + a->Tq - a->kv_ring;
  *lo = first, *hi = n > first ? n : first;
}

/* Soft-capping of a row of scaled scores in place: s = c tanh(s / c). */
TP_VECTOR_CLONES static void cap_row(float *s, int64_t n, float c) {
  float inv = 1.0f / c;
  for (int64_t j = 0; j < n; j++) s[j] = c * ftanh(s[j] * inv);
}

/* Softmax of the scores s[lo, hi) (keep: the key mask at the same columns, or NULL), zeros
 * in [c0, lo) and [hi, c1); returns the row's log-sum-exp (-inf when no key is visible). */
TP_VECTOR_CLONES static float softmax_row(float *s, int64_t lo, int64_t hi, int64_t c0, int64_t c1,
                                          const uint8_t *keep) {
  float mx = -INFINITY;
  for (int64_t j = lo; j < hi; j++)
    if (!keep || keep[j]) mx = s[j] > mx ? s[j] : mx;
  if (mx == -INFINITY) { /* no visible key */
    if (c1 > c0) memset(s + c0, 0, (size_t)(c1 - c0) * sizeof(float));
    return -INFINITY;
  }
  double sum = 0.0;
  for (int64_t j = lo; j < hi; j++) {
    float e = (!keep || keep[j]) ? fexp(s[j] - mx) : 0.0f;
    s[j] = e;
    sum += e;
  }
  float inv = (float)(1.0 / sum);
  for (int64_t j = lo; j < hi; j++) s[j] *= inv;
  if (lo > c0) memset(s + c0, 0, (size_t)(lo - c0) * sizeof(float));
  if (c1 > hi) memset(s + hi, 0, (size_t)(c1 - hi) * sizeof(float));
  return mx + (float)log(sum);
}

enum { QBLOCK = 64 }; /* query rows per GEMM block: causal blocks only see keys up to their last row */

/* The query heads [*h0, *h1) that use local KV head g. */
static void heads_of(const tp_attention_args *a, int64_t g, int64_t *h0, int64_t *h1) {
  if (!a->group) {
    int64_t per = a->Hq / a->Hk;
    *h0 = g * per, *h1 = (g + 1) * per;
    return;
  }
  int64_t lo = (a->k_head0 + g) * a->group - a->q_head0, hi = lo + a->group;
  *h0 = lo < 0 ? 0 : lo;
  *h1 = hi > a->Hq ? a->Hq : hi;
}

typedef struct {
  const tp_attention_args *a;
  float *dq, *dk, *dv;
  const float *dout;
  float *ws;     /* workspace: chunk c uses ws + c * slice */
  int64_t slice; /* floats per chunk (0: none needed) */
} attn_job;

/* The run of key positions [j, j + *len) (j < end) that is contiguous in k/v, at element
 * offset *off from the sequence's base (returned 0) -- or, in a paged cache, from k itself
 * (tab: the sequence's row of the block table); returns 0 for a run of positions in no
 * block (an entry < 0: keys never read).  A ring wraps at kv_ring; a paged cache's run ends
 * at its block, or goes on through the next when that one follows it in memory. */
static int key_run(const tp_attention_args *a, const int64_t *tab, int64_t j, int64_t end, int64_t *off, int64_t *len) {
  if (a->kv_ring) {
    int64_t r = j % a->kv_ring;
    *off = r * a->kv_ld, *len = end - j < a->kv_ring - r ? end - j : a->kv_ring - r;
    return 1;
  }
  if (!tab) {
    *off = j * a->kv_ld, *len = end - j;
    return 1;
  }
  const int64_t bs = a->kv_block_size, blk = tab[j / bs];
  int64_t n = bs - j % bs;
  if (blk >= 0 && a->kv_bstride == bs * a->kv_ld) /* blocks back to back: merge the ones that follow */
    for (int64_t c = j / bs + 1, want = blk + 1; j + n < end && tab[c] == want; c++, want++) n += bs;
  *off = blk * a->kv_bstride + (j % bs) * a->kv_ld, *len = end - j < n ? end - j : n;
  return blk >= 0;
}

/* A block of n query rows: Q, O (qld, old apart) and L at its first row; S its Tk-wide rows of
 * scores (the kept probs or scratch); row r is query i0 + r of one head, or (heads: a decode
 * step, Tq = 1) query i0 of the r-th head of a group, whose rows lie D apart in q and o. */
typedef struct {
  const float *Q;
  float *O, *L, *S;
  int64_t qld, old, i0, n;
  int heads;
} qblock;

/* One block of query rows of sequence b over the keys of K, V (tab: the sequence's block table
 * row of a paged cache, K and V then at the pool's start; hole: scratch of Tk bytes for the key
 * mask of a paged cache with holes). */
static void forward_block(const tp_attention_args *a, int64_t b, const qblock *r, const float *K, const float *V,
                          const uint8_t *keep, const int64_t *tab, uint8_t *hole) {
  int64_t Tk = a->Tk, D = a->D, n = r->n, last = r->heads ? r->i0 : r->i0 + n - 1, kmin, kmax, lo, hi, off, len;
  float *S = r->S, *O = r->O;
  key_range(a, b, r->i0, &kmin, &hi);
  key_range(a, b, last, &lo, &kmax);
  if (kmax <= kmin) { /* no row of the block sees a key */
    if (a->probs && Tk) memset(S, 0, (size_t)(n * Tk) * sizeof(float));
    for (int64_t i = 0; i < n; i++) memset(O + i * r->old, 0, (size_t)D * sizeof(float));
    for (int64_t i = 0; r->L && i < n; i++) r->L[i] = -INFINITY;
    return;
  }
  /* the column of key position kmin: its own position (kept probs: [B, Hq, Tq, Tk]), or 0
   * in a ring, whose positions run past Tk (the span kmax - kmin <= kv_ring <= Tk) */
  int64_t col0 = a->kv_ring ? 0 : kmin, w = kmax - kmin;
  int holes = 0;
  for (int64_t j = kmin; j < kmax; j += len) {
    if (key_run(a, tab, j, kmax, &off, &len)) {
      gemm(0, 1, n, len, D, a->scale, r->Q, r->qld, K + off, a->kv_ld, 0.0f, S + col0 + (j - kmin), Tk);
      continue;
    }
    if (!holes) { /* the first run in no block: the key mask of [kmin, kmax) with the holes in it */
      for (int64_t c = 0; c < w; c++) hole[c] = !keep || keep[kmin + c];
      holes = 1;
    }
    memset(hole + (j - kmin), 0, (size_t)len);
    for (int64_t i = 0; i < n; i++) memset(S + i * Tk + col0 + (j - kmin), 0, (size_t)len * sizeof(float));
  }
  for (int64_t i = 0; i < n; i++) {
    float *si = S + i * Tk + col0;
    if (a->softcap > 0.0f) cap_row(si, w, a->softcap);
    key_range(a, b, r->heads ? r->i0 : r->i0 + i, &lo, &hi);
    float l = softmax_row(si, lo - kmin, hi - kmin, a->probs ? -col0 : 0, a->probs ? Tk - col0 : w,
                          holes  ? hole
                          : keep ? keep + kmin
                                 : NULL);
    if (r->L) r->L[i] = l;
  }
  int first = 1;
  for (int64_t j = kmin; j < kmax; j += len)
    if (key_run(a, tab, j, kmax, &off, &len)) {
      gemm(0, 0, n, D, len, 1.0f, S + col0 + (j - kmin), Tk, V + off, a->kv_ld, first ? 0.0f : 1.0f, O, r->old);
      first = 0;
    }
  if (first) /* every key of the block in no block */
    for (int64_t i = 0; i < n; i++) memset(O + i * r->old, 0, (size_t)D * sizeof(float));
}

/* Forward of the pairs (b, g) = items [lo, hi). */
static void forward_items(void *ctx, int64_t lo, int64_t hi, int chunk) {
  attn_job *job = ctx;
  const tp_attention_args *a = job->a;
  int64_t Tq = a->Tq, Tk = a->Tk, D = a->D;
  /* without probs to keep: one block of scores at a time */
  float *scratch = job->slice ? job->ws + (int64_t)chunk * job->slice : NULL;
  /* a paged cache's key mask with holes: after the block of scores (when there is one) */
  uint8_t *hole = a->kv_block_size ? (uint8_t *)(scratch + (a->probs ? 0 : (int64_t)QBLOCK * Tk)) : NULL;
  for (int64_t it = lo; it < hi; it++) {
    int64_t b = it / a->Hk, g = it % a->Hk, h0, h1;
    heads_of(a, g, &h0, &h1);
    const uint8_t *keep = a->key_mask ? a->key_mask + b * Tk : NULL;
    const int64_t *tab = a->kv_block_size ? a->kv_block_table + b * a->kv_block_cols : NULL;
    /* the KV sequence (slot) of sequence b; a paged cache: the pool (the table places each key) */
    const int64_t kb = tab ? 0 : a->kv_slot ? a->kv_slot[b] : b;
    const float *K = a->k + kb * a->kv_bstride + g * D, *V = a->v + kb * a->kv_bstride + g * D;
    if (Tq == 1) { /* a decode step: the group's heads are the rows of one block (K, V read once) */
      for (int64_t h = h0; h < h1; h += QBLOCK) {
        qblock r = {a->q + b * a->q_ld + h * D,
                    a->o + b * a->o_ld + h * D,
                    a->lse ? a->lse + b * a->Hq + h : NULL,
                    a->probs ? a->probs + (b * a->Hq + h) * Tk : scratch,
                    D,
                    D,
                    0,
                    h1 - h < QBLOCK ? h1 - h : QBLOCK,
                    1};
        forward_block(a, b, &r, K, V, keep, tab, hole);
      }
      continue;
    }
    for (int64_t h = h0; h < h1; h++) {
      float *S = a->probs ? a->probs + (b * a->Hq + h) * Tq * Tk : NULL;
      const float *Q = a->q + b * Tq * a->q_ld + h * D;
      float *O = a->o + b * Tq * a->o_ld + h * D;
      float *L = a->lse ? a->lse + (b * a->Hq + h) * Tq : NULL;
      for (int64_t i0 = 0; i0 < Tq; i0 += QBLOCK) {
        qblock r = {Q + i0 * a->q_ld,
                    O + i0 * a->o_ld,
                    L ? L + i0 : NULL,
                    S ? S + i0 * Tk : scratch,
                    a->q_ld,
                    a->o_ld,
                    i0,
                    Tq - i0 < QBLOCK ? Tq - i0 : QBLOCK,
                    0};
        forward_block(a, b, &r, K, V, keep, tab, hole);
      }
    }
  }
}

/* How many chunks (threads) the (sequence, KV head) pairs are split into. */
static int plan_items(const tp_attention_args *a) {
  int64_t items = a->B * a->Hk, work = 1; /* work per item, saturated (a long cache times a long prefill) */
  const int64_t f[4] = {a->Tq, a->Tk, a->D, a->Hq / (a->Hk ? a->Hk : 1) + 1};
  for (int i = 0; i < 4; i++)
    if (__builtin_mul_overflow(work, f[i], &work)) {
      work = INT64_MAX;
      break;
    }
  int t = tp_parallel_plan(items, work);
  return t > 64 ? 64 : t;
}

/* Floats of scratch one chunk needs: a block of QBLOCK rows of scores (forward without
 * probs) or of dP (backward; and of recomputed P in the lse mode, and of raw scores with
 * softcap). */
static int64_t slice_of(const tp_attention_args *a, int backward) {
  if (backward) /* dP; P in the lse mode; the raw scores with softcap */
    return (1 + !a->probs + (a->softcap > 0.0f)) * (int64_t)QBLOCK * (a->Tk > 0 ? a->Tk : 1);
  if (a->Tq * a->Tk == 0) return 0;
  /* a block of scores without probs; a paged cache's key mask of Tk bytes (in floats) */
  return (!a->probs ? (int64_t)QBLOCK * a->Tk : 0) + (a->kv_block_size ? (a->Tk + 3) / 4 : 0);
}

size_t tp_cpu_attention_workspace(const tp_attention_args *a, int backward) {
  int64_t slice = slice_of(a, backward);
  if (!slice || a->B * a->Hk == 0) return 0;
  size_t n;
  if (!tp_mul_size((size_t)plan_items(a), (size_t)slice * sizeof(float), &n)) return SIZE_MAX;
  return n;
}

/* Split the (sequence, KV head) pairs over the rank's threads, BLAS single-threaded inside;
 * no more chunks than the workspace has slices for. */
static tp_status_t run_items(attn_job *job, int backward, void *ws, size_t ws_bytes, tp_rows_fn fn) {
  const tp_attention_args *a = job->a;
  int64_t items = a->B * a->Hk;
  if (items == 0) return TP_SUCCESS;
  int t = plan_items(a);
  job->slice = slice_of(a, backward);
  job->ws = ws;
  if (job->slice) {
    size_t fit = ws ? ws_bytes / ((size_t)job->slice * sizeof(float)) : 0;
    if (fit < 1)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "attention_%s: the workspace of %zu bytes is below one block of "
                          "scores (%zu bytes; ask attention_workspace)",
                          backward ? "backward" : "forward", ws ? ws_bytes : 0, (size_t)job->slice * sizeof(float));
    if ((size_t)t > fit) t = (int)fit;
  }
  int prev = t > 1 ? tp_blas_single_thread_begin() : 0;
  tp_parallel_run(t, items, fn, job);
  if (t > 1) tp_blas_single_thread_end(prev);
  return TP_SUCCESS;
}

tp_status_t tp_cpu_attention_forward(tp_stream_t s, const tp_attention_args *a, void *workspace,
                                     size_t workspace_bytes) {
  (void)s;
  attn_job job = {a, NULL, NULL, NULL, NULL, NULL, 0};
  return run_items(&job, 0, workspace, workspace_bytes, forward_items);
}

/* dS of a row from dP (in place) and P: P (dP - rowsum(dP P)) scale, times slope[j] (the
 * cap's 1 - tanh^2; NULL: no cap). */
TP_VECTOR_CLONES static void softmax_grad_row(float *dp, const float *p, const float *slope, int64_t n, float scale) {
  double dot = 0.0;
  for (int64_t j = 0; j < n; j++) dot += (double)dp[j] * p[j];
  float d = (float)dot;
  if (slope)
    for (int64_t j = 0; j < n; j++) dp[j] = p[j] * (dp[j] - d) * scale * slope[j];
  else
    for (int64_t j = 0; j < n; j++) dp[j] = p[j] * (dp[j] - d) * scale;
}

/* The cap of a row of raw scaled scores r[0, n): r becomes the slope 1 - tanh^2(r / cap), and
 * capped (when not NULL) the capped scores cap tanh(r / cap). */
TP_VECTOR_CLONES static void cap_slope_row(float *r, float *capped, int64_t n, float cap) {
  float inv = 1.0f / cap;
  if (capped)
    for (int64_t j = 0; j < n; j++) {
      float t = ftanh(r[j] * inv);
      capped[j] = cap * t, r[j] = 1.0f - t * t;
    }
  else
    for (int64_t j = 0; j < n; j++) {
      float t = ftanh(r[j] * inv);
      r[j] = 1.0f - t * t;
    }
}

/* A row of P over w columns from its scores s (in place) and the row's lse: columns [lo, hi)
 * visible unless masked, the rest zero (the block GEMMs read w columns). */
TP_VECTOR_CLONES static void recompute_row(float *s, int64_t lo, int64_t hi, int64_t w, const uint8_t *keep,
                                           float lse) {
  if (lse == -INFINITY) lo = hi = 0; /* the row saw no key */
  for (int64_t j = lo; j < hi; j++) s[j] = (!keep || keep[j]) ? fexp(s[j] - lse) : 0.0f;
  for (int64_t j = 0; j < lo; j++) s[j] = 0.0f;
  for (int64_t j = hi; j < w; j++) s[j] = 0.0f;
}

/* Backward of one block of n query rows from i0 of query head h (pointers at the head's
 * first row / key; P: its kept probs or NULL; L: its lse), over scratch dP, Pw and Rw. */
static void backward_block(const attn_job *job, int64_t b, int64_t i0, int64_t n, const float *Q, const float *K,
                           const float *V, float *dQ, float *dK, float *dV, const float *dO, const float *P,
                           const float *L, const uint8_t *keep, float *dP, float *Pw, float *Rw) {
  const tp_attention_args *a = job->a;
  int64_t Tk = a->Tk, D = a->D, kmin, kmax, lo, hi;
  key_range(a, b, i0, &kmin, &hi);
  key_range(a, b, i0 + n - 1, &lo, &kmax);
  if (kmax <= kmin) {
    for (int64_t i = 0; i < n; i++) memset(dQ + (i0 + i) * a->q_ld, 0, (size_t)D * sizeof(float));
    return;
  }
  const int64_t w = kmax - kmin;
  const float cap = a->softcap;
  const float *Kb = K + kmin * a->kv_ld, *Vb = V + kmin * a->kv_ld, *Qb = Q + i0 * a->q_ld, *dOb = dO + i0 * a->o_ld;
  float *dKb = dK + kmin * a->kv_ld, *dVb = dV + kmin * a->kv_ld;
  const float *Pb = P ? P + i0 * Tk + kmin : Pw;
  /* the raw scaled scores scale Q K^T: into Rw for the cap (then its slope there, the capped
   * scores into Pw in the lse mode), else into Pw for the lse mode's P in place */
  float *raw = cap > 0.0f ? Rw : Pw;
  if (cap > 0.0f || !P) gemm(0, 1, n, w, D, a->scale, Qb, a->q_ld, Kb, a->kv_ld, 0.0f, raw, Tk);
  for (int64_t i = 0; cap > 0.0f && i < n; i++) cap_slope_row(Rw + i * Tk, P ? NULL : Pw + i * Tk, w, cap);
  if (!P) /* the lse mode: P = exp(S - lse) on the visible keys, 0 elsewhere */
    for (int64_t i = 0; i < n; i++) {
      key_range(a, b, i0 + i, &lo, &hi);
      recompute_row(Pw + i * Tk, lo - kmin, hi - kmin, w, keep ? keep + kmin : NULL, L[i0 + i]);
    }
  gemm(0, 1, n, w, D, 1.0f, dOb, a->o_ld, Vb, a->kv_ld, 0.0f, dP, Tk);  /* dP = dO V^T  */
  gemm(1, 0, w, D, n, 1.0f, Pb, Tk, dOb, a->o_ld, 1.0f, dVb, a->kv_ld); /* dV += P^T dO */
  for (int64_t i = 0; i < n; i++)
    softmax_grad_row(dP + i * Tk, Pb + i * Tk, cap > 0.0f ? Rw + i * Tk : NULL, w, a->scale);
  gemm(0, 0, n, D, w, 1.0f, dP, Tk, Kb, a->kv_ld, 0.0f, dQ + i0 * a->q_ld, a->q_ld); /* dQ = dS K    */
  gemm(1, 0, w, D, n, 1.0f, dP, Tk, Qb, a->q_ld, 1.0f, dKb, a->kv_ld);               /* dK += dS^T Q */
}

static void backward_items(void *ctx, int64_t lo, int64_t hi, int chunk) {
  attn_job *job = ctx;
  const tp_attention_args *a = job->a;
  int64_t Tq = a->Tq, Tk = a->Tk, D = a->D, blk = (int64_t)QBLOCK * (Tk > 0 ? Tk : 1);
  float *dP = job->ws + (int64_t)chunk * job->slice, *Pw = dP + blk, *Rw = dP + (a->probs ? 1 : 2) * blk;
  for (int64_t it = lo; it < hi; it++) {
    int64_t b = it / a->Hk, g = it % a->Hk, h0, h1;
    heads_of(a, g, &h0, &h1);
    const float *K = a->k + b * a->kv_bstride + g * D, *V = a->v + b * a->kv_bstride + g * D;
    float *dK = job->dk + b * a->kv_bstride + g * D, *dV = job->dv + b * a->kv_bstride + g * D;
    const uint8_t *keep = a->key_mask ? a->key_mask + b * Tk : NULL;
    for (int64_t j = 0; j < Tk; j++) { /* dK, dV of this KV head are sums over its query heads */
      memset(dK + j * a->kv_ld, 0, (size_t)D * sizeof(float));
      memset(dV + j * a->kv_ld, 0, (size_t)D * sizeof(float));
    }
    for (int64_t h = h0; h < h1; h++) {
      const float *P = a->probs ? a->probs + (b * a->Hq + h) * Tq * Tk : NULL;
      const float *L = P ? NULL : a->lse + (b * a->Hq + h) * Tq;
      const float *Q = a->q + b * Tq * a->q_ld + h * D;
      const float *dO = job->dout + b * Tq * a->o_ld + h * D;
      float *dQ = job->dq + b * Tq * a->q_ld + h * D;
      for (int64_t i0 = 0; i0 < Tq; i0 += QBLOCK) {
        int64_t n = Tq - i0 < QBLOCK ? Tq - i0 : QBLOCK;
        backward_block(job, b, i0, n, Q, K, V, dQ, dK, dV, dO, P, L, keep, dP, Pw, Rw);
      }
    }
  }
}

tp_status_t tp_cpu_attention_backward(tp_stream_t s, const tp_attention_args *a, float *dq, float *dk, float *dv,
                                      const float *dout, void *workspace, size_t workspace_bytes) {
  (void)s;
  if (!a->probs && !a->lse)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "attention_backward: no probs and no lse (forward must keep one)");
  attn_job job = {a, dq, dk, dv, dout, NULL, 0};
  return run_items(&job, 1, workspace, workspace_bytes, backward_items);
}
