/*
 * tpcore kernels on local shards: a tensor API over the per-device kernel tables.
 *
 * Every kernel takes the stream first (NULL: the device's default; on the CPU every call
 * has finished when it returns) and tp_tensor views (data, dtype, shape, strides,
 * device), validates them (dtype, ndim, shapes that agree, the layout it supports, one
 * device for all its tensors) and runs the entry of that device's kernel table.  A bad
 * argument fails with TP_ERR_INVALID_ARGUMENT and a sentence naming the kernel and the
 * argument (tp_last_error()); a device this build or process lacks, TP_ERR_UNSUPPORTED.
 * Tensors are float32 (indices int64) and C-contiguous unless a kernel says otherwise.
 *
 * Shape letters (llm.c style): M rows (tokens: batch x time flattened), K input
 * features, N output features.  Weights follow PyTorch's nn.Linear: W has shape (N, K)
 * and y = x W^T + b.  Kernels come in <op>_forward / <op>_backward pairs, outputs first;
 * backward kernels accumulate into parameter gradients.  GEMMs go through BLAS on the
 * CPU (see tp_blas_info).  Kernels never allocate: those that need scratch take a
 * workspace (any contiguous tensor on the device, of at least the bytes the matching
 * *_workspace_size call returns; NULL when that is 0), allocated once and reused.
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

typedef enum {
  TP_ACT_GELU = 0,      /* 0.5 x (1 + erf(x / sqrt 2)) */
  TP_ACT_GELU_TANH = 1, /* the tanh approximation (GPT-2) */
  TP_ACT_SILU = 2,
  TP_ACT_RELU = 3,
  TP_ACT_SWIGLU = 4, /* gated: h[M, 2F] = [gate | up] per row -> out[M, F] = silu(gate) * up */
  TP_ACT_GEGLU = 5   /* gated as SwiGLU: out = gelu_tanh(gate) * up (Gemma) */
} tp_activation_t;

/* The last tp_activation_t (the range checks' bound). */
#define TP_ACT_LAST TP_ACT_GEGLU

/* 1 for the gated activations, whose input h has 2F columns per row ([gate | up]). */
static inline int tp_act_gated(tp_activation_t act) { return act == TP_ACT_SWIGLU || act == TP_ACT_GEGLU; }

/* Attention on a rank's heads (cpu/attention.c has the formulas).  Rows of q and o are
 * b * Tq + i; keys/values of sequence b start at k/v + b * kv_bstride, one row per key
 * (with kv_slot: at k/v + kv_slot[b] * kv_bstride).  Pointers are memory of `device`.
 * Decoding is tp_attention_forward with k, v the KV cache (kv_bstride = max_len x row),
 * q_pos the position of each sequence's first new query and k_len = q_pos + Tq; a cache
 * shared by a changing set of requests (continuous batching) maps query sequence b to
 * its cache sequence with kv_slot. */
typedef struct {
  int64_t B, Tq, Tk, Hq, Hk, D; /* sequences, queries and keys per sequence, heads, head size */
  const float *q;               /* query head h of row r at q + r * q_ld + h * D      */
  int64_t q_ld;
  const float *k, *v; /* key/value head g of key j of sequence b at
                                    k + b * kv_bstride + j * kv_ld + g * D              */
  int64_t kv_ld, kv_bstride;
  float *o; /* output head h of row r at o + r * o_ld + h * D      */
  int64_t o_ld;
  const int64_t *q_pos;    /* [B] position of each sequence's first query (NULL: 0) */
  const int64_t *k_len;    /* [B] keys that exist (NULL: Tk)                        */
  const uint8_t *key_mask; /* [B, Tk] 1 = a key to attend to (NULL: all)            */
  int causal;
  float scale;
  float *probs; /* [B, Hq, Tq, Tk] softmax kept for backward, or NULL     */
  /* [B, Hq, Tq] per query row (index (b * Hq + h) * Tq + i): the log of the softmax
   * denominator including the max, lse = m + log(sum_j exp(s_j - m)) over the row's
   * visible scaled scores s_j (-INFINITY for a row that sees no key), float32, or NULL.
   * Forward writes it when not NULL.  Backward with probs NULL recomputes the
   * probabilities from q, k and lse (P = exp(s - lse)) and never needs T x T memory; in
   * that mode o must hold forward's output (D = rowsum(dout * o) may be read from it). */
  float *lse;
  /* Grouped-query mapping (all 0: query head h uses KV head h / (Hq / Hk)).  Otherwise local
   * query head h is global q_head0 + h and uses local KV head (q_head0 + h) / group - k_head0:
   * a rank's heads may start in the middle of a group. */
  int64_t group, q_head0, k_head0;
  tp_device_t device; /* where every pointer above lives (0: the CPU)          */
  int device_id;
  /* [B] the KV sequence query sequence b reads (memory of `device`, like q_pos; NULL: b):
   * its keys/values at k/v + kv_slot[b] * kv_bstride, each slot in [0, kv_batch) (checked
   * on the host for the CPU; a CUDA kernel gives a row with an out-of-range slot no keys).
   * Forward only: backward refuses it. */
  const int64_t *kv_slot;
  int64_t kv_batch; /* sequences k/v hold when kv_slot is set (>= 1)          */
  /* Attention logit soft-capping (Gemma 2; 0: off): softcap > 0 turns each scaled score s
   * into softcap * tanh(s / softcap) before the mask and the softmax (lse and probs are of
   * the capped scores; backward applies d/ds = 1 - tanh^2).  Finite, >= 0. */
  float softcap;
  /* Sliding window (Mistral, Gemma; 0: off): window > 0 lets the query at position p see
   * only keys j with p - window < j (with the other masks: causal, k_len, key_mask).  >= 0. */
  int64_t window;
  /* Ring-buffer KV cache (0: off; forward over a cache only: q_pos and k_len set): the key
   * and value of position j live at row j % kv_ring of their sequence (a sliding layer's
   * cache of kv_ring rows; keys past the step's last query, q_pos + Tq - 1, are not read).
   * Needs k_len, window > 0, window + Tq - 1 <= kv_ring (every key a query of the step sees
   * still in the ring), kv_ring <= Tk (the rows k/v hold), and neither probs nor key_mask. */
  int64_t kv_ring;
  /* Paged KV cache (kv_block_size 0: off; forward over a cache only, q_pos and k_len set):
   * k/v hold a pool of kv_batch blocks of kv_block_size rows each, kv_bstride apart (at least
   * kv_block_size x kv_ld); key j of query sequence b lives in block
   * kv_block_table[b * kv_block_cols + j / kv_block_size] at row j % kv_block_size, i.e. at
   * k + table[...] * kv_bstride + (j % kv_block_size) * kv_ld + g * D.  The table is memory of
   * `device` (like q_pos), kv_block_cols x kv_block_size >= Tk (every key position < Tk has
   * an entry).  An entry < 0 is no block: the keys there are not visible (a padding row, the
   * blocks of a sliding window's past, keys at or past k_len); an entry >= kv_batch is refused
   * on the host for the CPU (a CUDA kernel treats it as no block).  Excludes kv_slot and
   * kv_ring; works with window, softcap, GQA, probs and key_mask. */
  const int64_t *kv_block_table;
  int64_t kv_block_cols;
  int64_t kv_block_size;
} tp_attention_args;

/* ------------------------------------------------------------------ linear */
/* y[M,N] = x[M,K] w[N,K]^T (+ b[N] if b), overwriting y.  M, K, N <= INT_MAX.
 * w may be stored as bfloat16 or float16 (x, y, b stay float32; products are accumulated in
 * float32: the CPU widens w exactly, a GPU may round x to w's dtype for its tensor cores);
 * such a call allocates its scratch on the device for the call and frees it. */
TP_API tp_status_t tp_linear_forward(tp_stream_t stream, const tp_tensor *y, const tp_tensor *x, const tp_tensor *w,
                                     const tp_tensor *b);
/* dx[M,K] = dy[M,N] w[N,K] (added to dx if accumulate_dx; skipped if dx is NULL);
 * dw[N,K] += dy^T x (if dw); db[N] += sum over rows of dy (if db).  w may be bfloat16 or
 * float16 as for tp_linear_forward; dx, dw (the float32 main gradient), db, dy, x stay
 * float32. */
TP_API tp_status_t tp_linear_backward(tp_stream_t stream, const tp_tensor *dx, const tp_tensor *dw, const tp_tensor *db,
                                      const tp_tensor *dy, const tp_tensor *x, const tp_tensor *w, int accumulate_dx);

/* ---------------------------------------------------------------- conversion */
/* y = x converted, element by element: x and y contiguous, of one shape, on one device,
 * each float32, bfloat16 or float16 (the same dtype: a copy), not overlapping.  To a 16-bit
 * type it rounds to nearest even, overflows to infinity, keeps subnormals and turns NaN into
 * a quiet NaN of its sign (NumPy's float16 and ml_dtypes' bfloat16 casts bit for bit; float16
 * keeps the NaN's top payload bits, bfloat16 gives 0x7fc0 / 0xffc0); widening is exact. */
TP_API tp_status_t tp_convert(tp_stream_t stream, const tp_tensor *y, const tp_tensor *x);

/* ------------------------------------------------------------- activations */
/* out[M,F] = act(h); h is [M,F], or [M,2F] for SwiGLU. */
TP_API tp_status_t tp_act_forward(tp_stream_t stream, const tp_tensor *out, const tp_tensor *h, tp_activation_t act);
/* dh (shaped like h) from h and dout[M,F], overwriting dh. */
TP_API tp_status_t tp_act_backward(tp_stream_t stream, const tp_tensor *dh, const tp_tensor *h, const tp_tensor *dout,
                                   tp_activation_t act);
/* Fused for the MLP: h[M,hw] += b[hw] (b may be NULL; hw = F, or 2F for SwiGLU) and
 * out[M,F] = act(h), in one pass; backward: dh as tp_act_backward, and db[hw] += the
 * column sums of dh (db may be NULL) through the workspace. */
TP_API tp_status_t tp_bias_act_forward(tp_stream_t stream, const tp_tensor *out, const tp_tensor *h, const tp_tensor *b,
                                       tp_activation_t act);
TP_API tp_status_t tp_bias_act_backward_workspace_size(tp_device_t device, int64_t M, int64_t F, tp_activation_t act,
                                                       size_t *nbytes);
TP_API tp_status_t tp_bias_act_backward(tp_stream_t stream, const tp_tensor *dh, const tp_tensor *db,
                                        const tp_tensor *h, const tp_tensor *dout, tp_activation_t act,
                                        const tp_tensor *workspace);

/* ---------------------------------------------------------- vocab-parallel */
/* On a shard [lo, lo + V) of the vocabulary (lo >= 0); C = embedding width.  out[M,C] rows of
 * tokens (int64 [M]) outside the shard are zero (an all-reduce completes them); the
 * backward adds dout rows into dtable[V,C] for the shard's tokens. */
TP_API tp_status_t tp_embedding_forward(tp_stream_t stream, const tp_tensor *out, const tp_tensor *tokens,
                                        const tp_tensor *table, int64_t lo);
TP_API tp_status_t tp_embedding_backward(tp_stream_t stream, const tp_tensor *dtable, const tp_tensor *tokens,
                                         const tp_tensor *dout, int64_t lo);
/* Cross-entropy on logits[M,V] of the shard at lo: rowmax[M]; sums[2M] = (sum_j exp(l -
 * gmax) for each row, then the target logit or 0 for each row); dlogits = (softmax -
 * onehot(target)) * scale * row_scale[m] (row_scale may be NULL).  targets are int64 [M];
 * a negative target (an ignored row) has no target logit and no one-hot entry. */
TP_API tp_status_t tp_xent_row_max(tp_stream_t stream, const tp_tensor *rowmax, const tp_tensor *logits);
TP_API tp_status_t tp_xent_row_sums(tp_stream_t stream, const tp_tensor *sums, const tp_tensor *logits,
                                    const tp_tensor *gmax, const tp_tensor *targets, int64_t lo);
TP_API tp_status_t tp_xent_backward(tp_stream_t stream, const tp_tensor *dlogits, const tp_tensor *logits,
                                    const tp_tensor *gmax, const tp_tensor *sumexp, const tp_tensor *targets,
                                    const tp_tensor *row_scale, float scale, int64_t lo);

/* ------------------------------------------------------------ element-wise */
/* y = a + b element by element over equal element counts (y may be a or b: y += a); all
 * float32 contiguous on one device. */
TP_API tp_status_t tp_add(tp_stream_t stream, const tp_tensor *y, const tp_tensor *a, const tp_tensor *b);
/* y = value everywhere (float32 contiguous). */
TP_API tp_status_t tp_fill(tp_stream_t stream, const tp_tensor *y, float value);

/* ------------------------------------------------------------------- norms */
/* Over the last dimension C of x[M,C] (cpu/norm.c has the formulas).  Forward keeps the
 * row statistics mean[M] (may be NULL; RMSNorm has none) and rstd[M] (may be NULL) for
 * backward; backward overwrites dx and accumulates dw (and db when not NULL). */
TP_API tp_status_t tp_layernorm_forward(tp_stream_t stream, const tp_tensor *y, const tp_tensor *mean,
                                        const tp_tensor *rstd, const tp_tensor *x, const tp_tensor *w,
                                        const tp_tensor *b, float eps);
TP_API tp_status_t tp_layernorm_backward(tp_stream_t stream, const tp_tensor *dx, const tp_tensor *dw,
                                         const tp_tensor *db, const tp_tensor *dy, const tp_tensor *x,
                                         const tp_tensor *w, const tp_tensor *mean, const tp_tensor *rstd);
TP_API tp_status_t tp_rmsnorm_forward(tp_stream_t stream, const tp_tensor *y, const tp_tensor *rstd, const tp_tensor *x,
                                      const tp_tensor *w, float eps);
TP_API tp_status_t tp_rmsnorm_backward(tp_stream_t stream, const tp_tensor *dx, const tp_tensor *dw,
                                       const tp_tensor *dy, const tp_tensor *x, const tp_tensor *w,
                                       const tp_tensor *rstd);
/* Rotary embedding in place on x [rows, heads * D] (row stride >= heads * D allowed, the
 * last dimension contiguous: the Q and K heads at the start of a fused QKV row), row m
 * at position pos[m] (int64 [rows]); D even.  The pair (i, i + D/2) of each head turns
 * by the float32 angle float32(pos) * inv_freq[i], with inv_freq a float32 [D/2] tensor
 * of finite values (the scaled rotary frequencies: tpcore.nn.rope) or NULL for
 * theta^(-2i/D) (theta > 0, used only then); cos and sin are multiplied by factor
 * (finite, > 0; 1 for a plain rotation; YaRN's and LongRoPE's attention factor).
 * inverse applies the transpose (the angle negated, the factor kept: the backward). */
TP_API tp_status_t tp_rope_apply(tp_stream_t stream, const tp_tensor *x, const tp_tensor *pos, int64_t heads, int64_t D,
                                 const tp_tensor *inv_freq, float theta, float factor, int inverse);

/* --------------------------------------------------------------- attention */
/* Bytes of workspace forward (backward = 0) or backward needs for these arguments. */
TP_API tp_status_t tp_attention_workspace_size(const tp_attention_args *args, int backward, size_t *nbytes);
/* args->o overwritten (and args->probs, args->lse when not NULL).  The (sequence, KV head) pairs are
 * split over the rank's threads; causal queries go in blocks of 64 rows, each block's
 * GEMMs only over the keys it can see. */
TP_API tp_status_t tp_attention_forward(tp_stream_t stream, const tp_attention_args *args, const tp_tensor *workspace);
/* dq (layout of q), dk, dv (layout of k, v; overwritten) from dout (layout of o), using
 * the probs of forward, or, when probs is NULL, the lse of forward (then o must be
 * forward's output): one of the two is required. */
TP_API tp_status_t tp_attention_backward(tp_stream_t stream, const tp_attention_args *args, float *dq, float *dk,
                                         float *dv, const float *dout, const tp_tensor *workspace);

/* -------------------------------------------------------------- optimizers */
/* In place on p and its state, all float32 contiguous with p's element count (formulas
 * in cpu/optim.c; step counts from 1). */
TP_API tp_status_t tp_adamw_step(tp_stream_t stream, const tp_tensor *p, const tp_tensor *g, const tp_tensor *m,
                                 const tp_tensor *v, float lr, float beta1, float beta2, float eps, float weight_decay,
                                 int64_t step);
/* buf may be NULL (no momentum); first: the first step (buf = g). */
TP_API tp_status_t tp_sgd_step(tp_stream_t stream, const tp_tensor *p, const tp_tensor *g, const tp_tensor *buf,
                               float lr, float momentum, float weight_decay, int first);

#ifdef __cplusplus
}
#endif
#endif
