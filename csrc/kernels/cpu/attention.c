/* Softmax attention on a rank's heads, forward and backward, for training
 * (queries = keys = the sequence) and for decoding over a KV cache.
 *
 * For each sequence b and query head h (KV head g = h / (Hq / Hk), grouped-query):
 *   S = scale * Q_bh K_bg^T   (Tq x Tk', GEMM)
 *   mask: key j exists if j < k_len[b] and key_mask[b][j]; with causal, query i
 *         (at position q_pos[b] + i) sees keys j <= q_pos[b] + i
 *   P = softmax(S) over the visible keys (a row with none is all zero)
 *   O_bh = P V_bg             (GEMM)
 * Tk' = the keys any query of b can see, so a decode step over a long cache and a
 * causal prefill touch only what they need.  Backward (P saved by forward):
 *   dP = dO V^T;  dS = P * (dP - rowsum(dP * P)) * scale;
 *   dQ = dS K;  dK += dS^T Q;  dV += P^T dO   (summed over the heads of a group)
 * The lse mode (probs NULL, lse kept by forward: lse = max + log(sum exp(S - max)) per
 * query row, -inf for a row that sees no key) recomputes a block of P = exp(S - lse)
 * from Q and K in backward, then runs the same block GEMMs.
 * Scratch (a block of scores without probs, a block of dP in backward, and a block of
 * recomputed P in the lse mode) comes from the caller's workspace, one slice per
 * thread: tp_cpu_attention_workspace says how much. */
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

/* Keys that query i of sequence b may see: [0, limit). */
static int64_t key_limit(const tp_attention_args *a, int64_t b, int64_t i) {
  int64_t n = a->k_len ? a->k_len[b] : a->Tk;
  if (n > a->Tk) n = a->Tk;
  if (a->causal) {
    int64_t last = (a->q_pos ? a->q_pos[b] : 0) + i + 1;
    if (last < n) n = last;
  }
  return n < 0 ? 0 : n;
}

/* Returns the row's log-sum-exp (-inf when no key is visible). */
TP_VECTOR_CLONES static float softmax_row(float *s, int64_t n, int64_t width, const uint8_t *keep) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; j++)
    if (!keep || keep[j]) mx = s[j] > mx ? s[j] : mx;
  if (mx == -INFINITY) { /* no visible key */
    memset(s, 0, (size_t)width * sizeof(float));
    return -INFINITY;
  }
  double sum = 0.0;
  for (int64_t j = 0; j < n; j++) {
    float e = (!keep || keep[j]) ? fexp(s[j] - mx) : 0.0f;
    s[j] = e;
    sum += e;
  }
  float inv = (float)(1.0 / sum);
  for (int64_t j = 0; j < n; j++) s[j] *= inv;
  if (width > n) memset(s + n, 0, (size_t)(width - n) * sizeof(float));
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

/* Forward of the pairs (b, g) = items [lo, hi). */
static void forward_items(void *ctx, int64_t lo, int64_t hi, int chunk) {
  attn_job *job = ctx;
  const tp_attention_args *a = job->a;
  int64_t Tq = a->Tq, Tk = a->Tk, D = a->D;
  /* without probs to keep: one block of scores at a time */
  float *scratch = job->slice ? job->ws + (int64_t)chunk * job->slice : NULL;
  for (int64_t it = lo; it < hi; it++) {
    int64_t b = it / a->Hk, g = it % a->Hk, h0, h1;
    heads_of(a, g, &h0, &h1);
    const uint8_t *keep = a->key_mask ? a->key_mask + b * Tk : NULL;
    const int64_t kb = a->kv_slot ? a->kv_slot[b] : b; /* the KV sequence (slot) of sequence b */
    const float *K = a->k + kb * a->kv_bstride + g * D, *V = a->v + kb * a->kv_bstride + g * D;
    for (int64_t h = h0; h < h1; h++) {
      float *S = a->probs ? a->probs + (b * a->Hq + h) * Tq * Tk : NULL;
      const float *Q = a->q + b * Tq * a->q_ld + h * D;
      float *O = a->o + b * Tq * a->o_ld + h * D;
      float *L = a->lse ? a->lse + (b * a->Hq + h) * Tq : NULL;
      for (int64_t i0 = 0; i0 < Tq; i0 += QBLOCK) {
        int64_t n = Tq - i0 < QBLOCK ? Tq - i0 : QBLOCK, kmax = key_limit(a, b, i0 + n - 1);
        float *Sb = S ? S + i0 * Tk : scratch;
        if (kmax == 0) {
          if (Sb && Tk) memset(Sb, 0, (size_t)(n * Tk) * sizeof(float));
          for (int64_t i = 0; i < n; i++) memset(O + (i0 + i) * a->o_ld, 0, (size_t)D * sizeof(float));
          for (int64_t i = 0; L && i < n; i++) L[i0 + i] = -INFINITY;
          continue;
        }
        gemm(0, 1, n, kmax, D, a->scale, Q + i0 * a->q_ld, a->q_ld, K, a->kv_ld, 0.0f, Sb, Tk);
        for (int64_t i = 0; i < n; i++) {
          float l = softmax_row(Sb + i * Tk, key_limit(a, b, i0 + i), Tk, keep);
          if (L) L[i0 + i] = l;
        }
        gemm(0, 0, n, D, kmax, 1.0f, Sb, Tk, V, a->kv_ld, 0.0f, O + i0 * a->o_ld, a->o_ld);
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
 * probs) or of dP (backward; and of recomputed P in the lse mode). */
static int64_t slice_of(const tp_attention_args *a, int backward) {
  if (backward) return (a->probs ? 1 : 2) * (int64_t)QBLOCK * (a->Tk > 0 ? a->Tk : 1);
  return !a->probs && a->Tq * a->Tk > 0 ? (int64_t)QBLOCK * a->Tk : 0;
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

TP_VECTOR_CLONES static void softmax_grad_row(float *dp, const float *p, int64_t n, float scale) {
  double dot = 0.0;
  for (int64_t j = 0; j < n; j++) dot += (double)dp[j] * p[j];
  float d = (float)dot;
  for (int64_t j = 0; j < n; j++) dp[j] = p[j] * (dp[j] - d) * scale;
}

/* A row of P from its scores s[0, kmax) and the row's lse: keys [0, n) visible unless
 * masked; the rest of [0, kmax) zero (the block GEMMs read kmax columns). */
TP_VECTOR_CLONES static void recompute_row(float *s, int64_t n, int64_t kmax, const uint8_t *keep, float lse) {
  if (lse == -INFINITY) n = 0; /* the row saw no key */
  for (int64_t j = 0; j < n; j++) s[j] = (!keep || keep[j]) ? fexp(s[j] - lse) : 0.0f;
  for (int64_t j = n; j < kmax; j++) s[j] = 0.0f;
}

static void backward_items(void *ctx, int64_t lo, int64_t hi, int chunk) {
  attn_job *job = ctx;
  const tp_attention_args *a = job->a;
  int64_t Tq = a->Tq, Tk = a->Tk, D = a->D;
  float *dP = job->ws + (int64_t)chunk * job->slice, *Pw = dP + (int64_t)QBLOCK * (Tk > 0 ? Tk : 1);
  const uint8_t *keep;
  for (int64_t it = lo; it < hi; it++) {
    int64_t b = it / a->Hk, g = it % a->Hk, h0, h1;
    heads_of(a, g, &h0, &h1);
    const float *K = a->k + b * a->kv_bstride + g * D, *V = a->v + b * a->kv_bstride + g * D;
    float *dK = job->dk + b * a->kv_bstride + g * D, *dV = job->dv + b * a->kv_bstride + g * D;
    keep = a->key_mask ? a->key_mask + b * Tk : NULL;
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
        int64_t n = Tq - i0 < QBLOCK ? Tq - i0 : QBLOCK, kmax = key_limit(a, b, i0 + n - 1);
        if (kmax == 0) {
          for (int64_t i = 0; i < n; i++) memset(dQ + (i0 + i) * a->q_ld, 0, (size_t)D * sizeof(float));
          continue;
        }
        const float *Pb = P ? P + i0 * Tk : Pw;
        if (!P) { /* the lse mode: P = exp(scale Q K^T - lse) on the visible keys, 0 elsewhere */
          gemm(0, 1, n, kmax, D, a->scale, Q + i0 * a->q_ld, a->q_ld, K, a->kv_ld, 0.0f, Pw, Tk);
          for (int64_t i = 0; i < n; i++) recompute_row(Pw + i * Tk, key_limit(a, b, i0 + i), kmax, keep, L[i0 + i]);
        }
        gemm(0, 1, n, kmax, D, 1.0f, dO + i0 * a->o_ld, a->o_ld, V, a->kv_ld, 0.0f, dP, Tk);  /* dP = dO V^T  */
        gemm(1, 0, kmax, D, n, 1.0f, Pb, Tk, dO + i0 * a->o_ld, a->o_ld, 1.0f, dV, a->kv_ld); /* dV += P^T dO */
        for (int64_t i = 0; i < n; i++) softmax_grad_row(dP + i * Tk, Pb + i * Tk, kmax, a->scale);
        gemm(0, 0, n, D, kmax, 1.0f, dP, Tk, K, a->kv_ld, 0.0f, dQ + i0 * a->q_ld, a->q_ld); /* dQ = dS K    */
        gemm(1, 0, kmax, D, n, 1.0f, dP, Tk, Q + i0 * a->q_ld, a->q_ld, 1.0f, dK, a->kv_ld); /* dK += dS^T Q */
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
