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
 *   dQ = dS K;  dK += dS^T Q;  dV += P^T dO   (summed over the heads of a group) */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../blas_impl.h"
#include "vmath.h"
#include "tpcore/kernels.h"

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

TP_VECTOR_CLONES static void softmax_row(float *s, int64_t n, int64_t width, const uint8_t *keep) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; j++)
    if (!keep || keep[j]) mx = s[j] > mx ? s[j] : mx;
  if (mx == -INFINITY) { /* no visible key */
    memset(s, 0, (size_t)width * sizeof(float));
    return;
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
}

int tp_attention_forward(const tp_attention_args *a) {
  int64_t group = a->Hq / a->Hk, Tq = a->Tq, Tk = a->Tk, D = a->D;
  float *scratch = NULL;
  if (!a->probs && Tq * Tk > 0) {
    scratch = malloc((size_t)(Tq * Tk) * sizeof(float));
    if (!scratch) return -1;
  }
  for (int64_t b = 0; b < a->B; b++) {
    int64_t kmax = key_limit(a, b, Tq - 1); /* the last query sees the most keys */
    const uint8_t *keep = a->key_mask ? a->key_mask + b * Tk : NULL;
    for (int64_t h = 0; h < a->Hq; h++) {
      int64_t g = h / group;
      float *S = a->probs ? a->probs + (b * a->Hq + h) * Tq * Tk : scratch;
      const float *Q = a->q + b * Tq * a->q_ld + h * D;
      const float *K = a->k + b * a->kv_bstride + g * D, *V = a->v + b * a->kv_bstride + g * D;
      float *O = a->o + b * Tq * a->o_ld + h * D;
      if (kmax == 0) {
        memset(S, 0, (size_t)(Tq * Tk) * sizeof(float));
        for (int64_t i = 0; i < Tq; i++) memset(O + i * a->o_ld, 0, (size_t)D * sizeof(float));
        continue;
      }
      gemm(0, 1, Tq, kmax, D, a->scale, Q, a->q_ld, K, a->kv_ld, 0.0f, S, Tk);
      for (int64_t i = 0; i < Tq; i++) softmax_row(S + i * Tk, key_limit(a, b, i), Tk, keep);
      gemm(0, 0, Tq, D, kmax, 1.0f, S, Tk, V, a->kv_ld, 0.0f, O, a->o_ld);
    }
  }
  free(scratch);
  return 0;
}

TP_VECTOR_CLONES static void softmax_grad_row(float *dp, const float *p, int64_t n, float scale) {
  double dot = 0.0;
  for (int64_t j = 0; j < n; j++) dot += (double)dp[j] * p[j];
  float d = (float)dot;
  for (int64_t j = 0; j < n; j++) dp[j] = p[j] * (dp[j] - d) * scale;
}

int tp_attention_backward(const tp_attention_args *a, float *dq, float *dk, float *dv, const float *dout) {
  int64_t group = a->Hq / a->Hk, Tq = a->Tq, Tk = a->Tk, D = a->D;
  if (!a->probs) return -1;
  float *dP = malloc((size_t)(Tq * Tk > 0 ? Tq * Tk : 1) * sizeof(float));
  if (!dP) return -1;
  for (int64_t b = 0; b < a->B; b++) {
    int64_t kmax = key_limit(a, b, Tq - 1);
    for (int64_t g = 0; g < a->Hk; g++) /* dK, dV of this sequence's keys are sums over the group */
      for (int64_t j = 0; j < Tk; j++) {
        memset(dk + b * a->kv_bstride + j * a->kv_ld + g * D, 0, (size_t)D * sizeof(float));
        memset(dv + b * a->kv_bstride + j * a->kv_ld + g * D, 0, (size_t)D * sizeof(float));
      }
    for (int64_t h = 0; h < a->Hq; h++) {
      int64_t g = h / group;
      const float *P = a->probs + (b * a->Hq + h) * Tq * Tk;
      const float *Q = a->q + b * Tq * a->q_ld + h * D;
      const float *K = a->k + b * a->kv_bstride + g * D, *V = a->v + b * a->kv_bstride + g * D;
      const float *dO = dout + b * Tq * a->o_ld + h * D;
      float *dQ = dq + b * Tq * a->q_ld + h * D;
      float *dK = dk + b * a->kv_bstride + g * D, *dV = dv + b * a->kv_bstride + g * D;
      if (kmax == 0) {
        for (int64_t i = 0; i < Tq; i++) memset(dQ + i * a->q_ld, 0, (size_t)D * sizeof(float));
        continue;
      }
      gemm(0, 1, Tq, kmax, D, 1.0f, dO, a->o_ld, V, a->kv_ld, 0.0f, dP, Tk);        /* dP = dO V^T   */
      gemm(1, 0, kmax, D, Tq, 1.0f, P, Tk, dO, a->o_ld, 1.0f, dV, a->kv_ld);        /* dV += P^T dO  */
      for (int64_t i = 0; i < Tq; i++) softmax_grad_row(dP + i * Tk, P + i * Tk, kmax, a->scale);
      gemm(0, 0, Tq, D, kmax, 1.0f, dP, Tk, K, a->kv_ld, 0.0f, dQ, a->q_ld);        /* dQ = dS K     */
      gemm(1, 0, kmax, D, Tq, 1.0f, dP, Tk, Q, a->q_ld, 1.0f, dK, a->kv_ld);        /* dK += dS^T Q  */
    }
  }
  free(dP);
  return 0;
}
