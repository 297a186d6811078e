/*
 * tpcore CPU kernels on local shards, float32 compute.  Shape letters (llm.c
 * style): M rows (tokens: batch x time flattened), K input features, N output
 * features.  Weights follow PyTorch's nn.Linear: W has shape (N, K) and
 * y = x W^T + b.  Kernels come in <op>_forward / <op>_backward pairs, output
 * arguments first; backward kernels accumulate into parameter gradients.
 * GEMMs go through BLAS (see tp_blas_info).
 */
#ifndef TPCORE_KERNELS_H
#define TPCORE_KERNELS_H

#include "tpcore/tpcore.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which BLAS this build linked ("scipy-openblas 0.3.x ..." or the system one). */
TP_API const char *tp_blas_info(void);
/* BLAS threads of this process (OpenBLAS builds); n < 1 restores the default. */
TP_API void tp_set_num_threads(int n);
TP_API int tp_get_num_threads(void);

/* y[M,N] = x[M,K] W[N,K]^T (+ b[N] if b), overwriting y. */
TP_API void tp_linear_forward(float *y, const float *x, const float *w, const float *b, int64_t M,
                              int64_t K, int64_t N);
/* dx[M,K] = dy[M,N] W[N,K] (added to dx if accumulate_dx; skipped if dx is NULL);
 * dw[N,K] += dy^T x; db[N] += sum over rows of dy (if db). */
TP_API void tp_linear_backward(float *dx, float *dw, float *db, const float *dy, const float *x,
                               const float *w, int64_t M, int64_t K, int64_t N, int accumulate_dx);

typedef enum {
  TP_ACT_GELU = 0,      /* 0.5 x (1 + erf(x / sqrt 2)) */
  TP_ACT_GELU_TANH = 1, /* the tanh approximation (GPT-2) */
  TP_ACT_SILU = 2,
  TP_ACT_RELU = 3,
  TP_ACT_SWIGLU = 4     /* gated: h[M, 2F] = [gate | up] per row -> out[M, F] */
} tp_activation_t;

/* out[M, F] = act(h); h is [M, F], or [M, 2F] for SwiGLU. */
TP_API void tp_act_forward(float *out, const float *h, int64_t M, int64_t F, tp_activation_t act);
/* dh (shaped like h) from h and dout[M, F]. */
TP_API void tp_act_backward(float *dh, const float *h, const float *dout, int64_t M, int64_t F,
                            tp_activation_t act);

/* Fused for the MLP: h[M, hw] += b[hw] (b may be NULL; hw = F, or 2F for SwiGLU) and
 * out = act(h), in one pass; backward: dh as tp_act_backward, and db[hw] += the column
 * sums of dh (db may be NULL).  Returns 0, or -1 when out of memory (nothing done). */
TP_API void tp_bias_act_forward(float *out, float *h, const float *b, int64_t M, int64_t F, tp_activation_t act);
TP_API int tp_bias_act_backward(float *dh, float *db, const float *h, const float *dout, int64_t M, int64_t F,
                                tp_activation_t act);

/* Vocab-parallel pieces on a shard [lo, lo + V) of the vocabulary; C = embedding width.
 * Embedding rows of tokens outside the shard are zero (an all-reduce completes them). */
TP_API void tp_embedding_forward(float *out, const int64_t *tokens, const float *table, int64_t M,
                                 int64_t lo, int64_t V, int64_t C);
TP_API void tp_embedding_backward(float *dtable, const int64_t *tokens, const float *dout, int64_t M,
                                  int64_t lo, int64_t V, int64_t C);
/* Cross-entropy: rowmax[M] of the shard; sums[2M] = (sum_j exp(l - gmax), target logit or 0);
 * dlogits = (softmax - onehot(target)) * scale * row_scale[m] (row_scale may be NULL).
 * A negative target (an ignored row) has no target logit and no one-hot entry. */
TP_API void tp_xent_row_max(float *rowmax, const float *logits, int64_t M, int64_t V);
TP_API void tp_xent_row_sums(float *sums, const float *logits, const float *gmax, const int64_t *targets,
                             int64_t M, int64_t lo, int64_t V);
TP_API void tp_xent_backward(float *dlogits, const float *logits, const float *gmax, const float *sumexp,
                             const int64_t *targets, const float *row_scale, float scale, int64_t M,
                             int64_t lo, int64_t V);

/* Norms over the last dimension C (norm.c has the formulas).  Forward keeps the row
 * statistics (mean may be NULL for RMSNorm) for backward; backward overwrites dx and
 * accumulates dw (and db when not NULL). */
TP_API void tp_layernorm_forward(float *y, float *mean, float *rstd, const float *x, const float *w,
                                 const float *b, int64_t M, int64_t C, float eps);
TP_API void tp_layernorm_backward(float *dx, float *dw, float *db, const float *dy, const float *x,
                                  const float *w, const float *mean, const float *rstd, int64_t M, int64_t C);
TP_API void tp_rmsnorm_forward(float *y, float *rstd, const float *x, const float *w, int64_t M, int64_t C,
                               float eps);
TP_API void tp_rmsnorm_backward(float *dx, float *dw, const float *dy, const float *x, const float *w,
                                const float *rstd, int64_t M, int64_t C);
/* Rotary embedding in place on `heads` heads of D (even) values at the start of each of
 * `rows` rows (row stride ld), row m at position pos[m]; inverse turns back (backward). */
TP_API void tp_rope_apply(float *x, int64_t rows, int64_t ld, int64_t heads, int64_t D, const int64_t *pos,
                          float theta, int inverse);

/* Attention on a rank's heads (attention.c has the formulas).  Rows of q and o are
 * b * Tq + i; keys/values of sequence b start at k/v + b * kv_bstride, one row per key. */
typedef struct {
  int64_t B, Tq, Tk, Hq, Hk, D;  /* sequences, queries and keys per sequence, heads, head size */
  const float *q;                /* query head h of row r at q + r * q_ld + h * D      */
  int64_t q_ld;
  const float *k, *v;            /* key/value head g of key j of sequence b at
                                    k + b * kv_bstride + j * kv_ld + g * D              */
  int64_t kv_ld, kv_bstride;
  float *o;                      /* output head h of row r at o + r * o_ld + h * D      */
  int64_t o_ld;
  const int64_t *q_pos;          /* [B] position of each sequence's first query (NULL: 0) */
  const int64_t *k_len;          /* [B] keys that exist (NULL: Tk)                        */
  const uint8_t *key_mask;       /* [B, Tk] 1 = a key to attend to (NULL: all)            */
  int causal;
  float scale;
  float *probs;                  /* [B, Hq, Tq, Tk] softmax kept for backward, or NULL     */
  /* Grouped-query mapping (all 0: query head h uses KV head h / (Hq / Hk)).  Otherwise local
   * query head h is global q_head0 + h and uses local KV head (q_head0 + h) / group - k_head0:
   * a rank's heads may start in the middle of a group. */
  int64_t group, q_head0, k_head0;
} tp_attention_args;

/* 0, or -1 when out of memory (nothing written).  The (sequence, KV head) pairs are split over
 * the rank's threads; causal queries go in blocks of 64 rows, each block's GEMMs only over
 * the keys it can see. */
TP_API int tp_attention_forward(const tp_attention_args *args);
/* dq (layout of q), dk, dv (layout of k, v; overwritten) from dout (layout of o), using
 * the probs of forward.  0, or -1 (no probs, or out of memory). */
TP_API int tp_attention_backward(const tp_attention_args *args, float *dq, float *dk, float *dv,
                                 const float *dout);

/* Optimizer steps on n elements in place (formulas in optim.c; step counts from 1). */
TP_API void tp_adamw_step(float *p, const float *g, float *m, float *v, int64_t n, float lr, float beta1,
                          float beta2, float eps, float weight_decay, int64_t step);
/* buf may be NULL (no momentum); first: the first step (buf = g). */
TP_API void tp_sgd_step(float *p, const float *g, float *buf, int64_t n, float lr, float momentum,
                        float weight_decay, int first);

#ifdef __cplusplus
}
#endif
#endif
