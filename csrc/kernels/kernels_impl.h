/*
 * The kernel table (private): one tp_kernel_ops per device, after ggml's backend
 * interface.  Every data touch of a layer or block is a call through it: the layers
 * keep the algorithm and the collectives and never read or write a float themselves.
 * A device is a file that fills a tp_kernel_ops (cpu/table.c; the CUDA plugin's
 * csrc/cuda/kernels/table.c) plus its line in registry.c; csrc/tests/test_kernels runs every entry of every registered
 * table against its references, so a new device is checked with no new test code.
 * A new kernel: its field below (documented), its name in TP_KERNEL_ENTRIES (the static
 * assert counts them), tp_cpu_<name> in a cpu/ file (cpu_impl.h declares it and
 * cpu/table.c lists it from TP_KERNEL_ENTRIES), and a parity case in
 * csrc/tests/test_kernels*.c (the harness and tests/csrc/test_kernels.py fail an entry
 * without one); a public tensor wrapper in api*.c when it is useful outside the layers.
 *
 * Conventions of every entry (llm.c style):
 *   - the first argument is the stream (NULL: the device's default; CPU: ignored, every
 *     call has finished when it returns);
 *   - pointers are raw memory of the table's device, sizes and leading dimensions are
 *     counts of elements, all validated by the caller (the public tensor API in
 *     include/tpcore/kernels.h, or a layer): the entries do not check them again;
 *   - an entry returns tp_status_t, so a device can report a launch failure; the CPU
 *     entries always succeed (a too small workspace is the one caller error they see);
 *   - no entry allocates: scratch comes in through a workspace pointer whose size the
 *     caller asked the matching *_workspace entry for, once, and reuses;
 *   - outputs come first; "overwrites" and "accumulates (+=)" below say which;
 *   - float32 data, int64 indices (tokens, targets, positions); row-major; the *_lp
 *     entries and convert take bfloat16 / float16 weights (a tp_dtype_t beside them);
 * Shape letters: M rows (tokens), K input features, N output features, C a row's width,
 * F activation width, V a vocabulary shard's width, n a flat element count.
 *
 * Which layer code maps to which entry (csrc/layers today):
 *   linear.c    GEMMs, GEMV decode path                 linear_forward, linear_backward
 *               row-parallel y = all_reduced + b         add_bias
 *               save_input (column slice of x), dy's
 *               columns, blocks_to_columns               tp_device_copy_2d (device.h), no entry
 *               weight / bias init                       init_uniform (one call per row run)
 *   mlp.c       h += b1, a = act(h) / dh, db1            bias_act_forward, bias_act_backward
 *   vocab.c     token range check                        check_range (result read back once)
 *               embedding rows / table gradient          embedding_forward, embedding_backward
 *               table init (Box-Muller)                  init_normal
 *               row maxima, sums, backward               xent_row_max, xent_row_sums, xent_backward
 *               targets fingerprint                      xent_targets_hash
 *               ignore_index + target range check        xent_targets (result read back once)
 *               losses[m] = log(sumexp) + max - target   xent_loss
 *               rs[m] = ignored ? 0 : dloss or 1         xent_row_scale
 *               memcpy of maxima/sums, tokens kept       tp_device_copy (device.h)
 *   block.c,    norms                                    layernorm_*, rmsnorm_*
 *   attention.c
 *               RoPE forward / inverse                   rope
 *               positions pos[], klen[] from pos0[]      positions
 *               pos0 range checks                        none: pos0 is host metadata (tp_block_batch_t),
 *                                                        checked on the host before any kernel
 *               K/V rows into the cache                  kv_cache_write
 *               attention (training, prefill, decode)    attention_forward, attention_backward
 *               r += bo, dbo += colsum(dr)               add_bias, bias_grad
 *               residual adds y = a + b, y += a          add (y may alias a or b)
 *               KV-gradient shuffle: delta = cur - snap, sub, then (all-reduce) add
 *               cur = snap + sum (snapshot: device_copy)
 *               parameter init, norm weights = 1         init_uniform, fill
 *   optimizers  (python/tpcore and the extension)        adamw_step, sgd_step
 *   scaling of a gradient / loss                         scale
 */
#ifndef TPCORE_KERNELS_IMPL_H
#define TPCORE_KERNELS_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "../core/core_impl.h"
#include "tpcore/kernels.h"

typedef struct tp_kernel_ops {
  tp_device_t device;
  const char *name; /* "cpu", "cuda" */
  /* 1 when training should keep the log-sum-exp (tp_attention_args.lse, [B, Hq, Tq]) for
   * attention backward instead of the probabilities ([B, Hq, Tq, Tk]): the fused kernels
   * (CUDA) never materialise T x T; 0 (CPU): keeping probs is faster.  Both modes are
   * implemented by every table (the parity harness runs both). */
  int attention_keeps_lse;
  /* 1 when linear_forward_lp / linear_backward_lp round the float32 activations (x, dy)
   * to the weight dtype before a tensor-core GEMM (CUDA), 0 when they compute with the
   * float32 activations as given (CPU).  The parity harness sets its tolerance by it;
   * both are float32-accumulated. */
  int lp_rounds_activations;

  /* ---- GEMM and the linear layer ------------------------------------------------ */
  /* C[M,N] = alpha op(A) op(B) + beta C (op: transpose when trans_*), row-major with
   * leading dimensions lda/ldb/ldc; M, N, K, ld* <= INT_MAX.  beta = 0 overwrites C. */
  tp_status_t (*gemm)(tp_stream_t s, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                      const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
  /* y[M,N] = x[M,K] w[N,K]^T (+ b[N] when b): overwrites y (K = 0: y = b or 0). */
  tp_status_t (*linear_forward)(tp_stream_t s, float *y, const float *x, const float *w, const float *b, int64_t M,
                                int64_t K, int64_t N);
  /* dx[M,K] = dy[M,N] w[N,K] (overwrites, or accumulates when accumulate_dx; skipped when dx
   * is NULL); dw[N,K] += dy^T x (skipped when NULL); db[N] += column sums of dy (when db). */
  tp_status_t (*linear_backward)(tp_stream_t s, float *dx, float *dw, float *db, const float *dy, const float *x,
                                 const float *w, int64_t M, int64_t K, int64_t N, int accumulate_dx);
  /* y[M,N] = x[M,N] + b[N] on every row (the row broadcast); y may be x. */
  tp_status_t (*add_bias)(tp_stream_t s, float *y, const float *x, const float *b, int64_t M, int64_t N);
  /* db[N] += sum over the M rows of dy[M,N] (a bias gradient), rows in order. */
  tp_status_t (*bias_grad)(tp_stream_t s, float *db, const float *dy, int64_t M, int64_t N);

  /* ---- activations (tp_activation_t; SwiGLU reads h[M,2F] = [gate | up]) ---------- */
  /* out[M,F] = act(h): overwrites out. */
  tp_status_t (*act_forward)(tp_stream_t s, float *out, const float *h, int64_t M, int64_t F, tp_activation_t act);
  /* dh (shaped like h) = act'(h) * dout[M,F]: overwrites dh. */
  tp_status_t (*act_backward)(tp_stream_t s, float *dh, const float *h, const float *dout, int64_t M, int64_t F,
                              tp_activation_t act);
  /* h += b (h[M,hw], hw = F or 2F for SwiGLU; b may be NULL: no add), then out = act(h),
   * a row at a time: h is updated in place, out overwritten. */
  tp_status_t (*bias_act_forward)(tp_stream_t s, float *out, float *h, const float *b, int64_t M, int64_t F,
                                  tp_activation_t act);
  /* Bytes of workspace bias_act_backward wants for these sizes with db (0 without db). */
  size_t (*bias_act_backward_workspace)(int64_t M, int64_t F, tp_activation_t act);
  /* dh as act_backward (overwrites), and db[hw] += the column sums of dh when db is not
   * NULL, through per-thread partial sums in the workspace (a smaller workspace, at
   * least hw floats, is correct and uses fewer threads; less: TP_ERR_INVALID_ARGUMENT). */
  tp_status_t (*bias_act_backward)(tp_stream_t s, float *dh, float *db, const float *h, const float *dout, int64_t M,
                                   int64_t F, tp_activation_t act, void *workspace, size_t workspace_bytes);

  /* ---- norms over the last dimension C, rotary embedding ------------------------- */
  /* y[M,C] overwritten; mean[M] and rstd[M] (each may be NULL) overwritten; b may be NULL. */
  tp_status_t (*layernorm_forward)(tp_stream_t s, float *y, float *mean, float *rstd, const float *x, const float *w,
                                   const float *b, int64_t M, int64_t C, float eps);
  /* dx[M,C] overwritten; dw[C] += and db[C] += (db may be NULL). */
  tp_status_t (*layernorm_backward)(tp_stream_t s, float *dx, float *dw, float *db, const float *dy, const float *x,
                                    const float *w, const float *mean, const float *rstd, int64_t M, int64_t C);
  tp_status_t (*rmsnorm_forward)(tp_stream_t s, float *y, float *rstd, const float *x, const float *w, int64_t M,
                                 int64_t C, float eps);
  /* dx[M,C] overwritten; dw[C] +=. */
  tp_status_t (*rmsnorm_backward)(tp_stream_t s, float *dx, float *dw, const float *dy, const float *x, const float *w,
                                  const float *rstd, int64_t M, int64_t C);
  /* In place on `heads` heads of D (even) values at the start of each of `rows` rows of
   * stride ld; row m at position pos[m]; the pair (i, i + D/2) turns by pos * inv_freq[i]
   * (inv_freq: D/2 floats of the device, or NULL: theta^(-2i/D)), cos and sin times factor
   * (> 0; 1: a plain rotation); inverse applies the transpose (the backward: the angle
   * negated, the factor kept). */
  tp_status_t (*rope)(tp_stream_t s, float *x, int64_t rows, int64_t ld, int64_t heads, int64_t D, const int64_t *pos,
                      const float *inv_freq, float theta, float factor, int inverse);

  /* ---- attention (tp_attention_args in tpcore/kernels.h has the layouts) ---------- */
  /* Bytes of workspace for forward (backward = 0; 0 when probs are kept) or backward;
   * the answer depends on which of a->probs and a->lse are NULL: ask with the pointers
   * (or any non-NULL stand-ins) the call will have. */
  size_t (*attention_workspace)(const tp_attention_args *a, int backward);
  /* a->o overwritten (and a->probs, a->lse when not NULL).  Decode is this call too: T new
   * queries (Tq) over the KV cache (k, v = the cache, kv_bstride = max_len x row,
   * q_pos[b] = the position of the first new query, k_len[b] = q_pos[b] + Tq, causal; with
   * a->kv_slot, query sequence b reads cache sequence kv_slot[b] < kv_batch). */
  tp_status_t (*attention_forward)(tp_stream_t s, const tp_attention_args *a, void *workspace, size_t workspace_bytes);
  /* dq (layout of q), dk, dv (layout of k, v) overwritten, from dout (layout of o) and
   * a->probs kept by forward, or, when a->probs is NULL, a->lse kept by forward (the lse
   * mode: P = exp(scale q.k - lse) recomputed a block at a time, FlashAttention-2 style;
   * a->o must then be forward's output, CUDA reads D = rowsum(dout * o) from it; a row
   * whose lse is -INFINITY saw no key: its P is 0).  One of the two is required. */
  tp_status_t (*attention_backward)(tp_stream_t s, const tp_attention_args *a, float *dq, float *dk, float *dv,
                                    const float *dout, void *workspace, size_t workspace_bytes);
  /* The KV-cache write of a decode/prefill step: for b < B, t < T, with s_b = slots[b] (slots
   * NULL: s_b = b; device memory like pos0),
   *   kcache[(s_b * max_len + r) * width + c] = k[(b * T + t) * ld + c], same for v, c < width,
   * at row r = pos0[b] + t (ring 0; pos0[b] + T <= max_len), or r = (pos0[b] + t) % ring for
   * ring > 0 (a ring buffer of ring <= max_len rows: only the last min(T, ring) rows of the
   * step are written, each ring row once); s_b inside the cache, distinct, checked by the
   * caller on the host: pos0 and slots are host metadata of tp_block_batch_t. */
  tp_status_t (*kv_cache_write)(tp_stream_t s, float *kcache, float *vcache, const float *k, const float *v, int64_t ld,
                                const int64_t *pos0, const int64_t *slots, int64_t B, int64_t T, int64_t max_len,
                                int64_t width, int64_t ring);
  /* The KV-cache write into a paged pool of blocks of bs rows (tpcore/kernels.h's
   * kv_block_table): for b < B, t < T, position p = pos0[b] + t goes to block
   * e = table[b * cols + p / bs] at row p % bs,
   *   kcache[(e * bs + p % bs) * width + c] = k[(b * T + t) * ld + c], same for v, c < width;
   * an entry e < 0 (no block: a padding row, a padding token), or a position past the table
   * (p / bs >= cols: a padding row's), skips the token.  pos0 and table are device memory; e <
   * the pool's blocks is checked by the caller on the host (tp_block_batch_t's metadata), as
   * is that no two tokens of a call write one row of the pool. */
  tp_status_t (*kv_cache_write_paged)(tp_stream_t s, float *kcache, float *vcache, const float *k, const float *v,
                                      int64_t ld, const int64_t *pos0, const int64_t *table, int64_t cols, int64_t bs,
                                      int64_t B, int64_t T, int64_t width);
  /* pos[b * T + t] = pos0[b] + t and klen[b] = pos0[b] + T (overwritten; klen may be NULL). */
  tp_status_t (*positions)(tp_stream_t s, int64_t *pos, int64_t *klen, const int64_t *pos0, int64_t B, int64_t T);

  /* ---- vocab-parallel embedding and cross-entropy (shard [lo, lo + V)) ------------ */
  /* out[M,C] overwritten: row of table[V,C] for tokens in the shard, zero otherwise. */
  tp_status_t (*embedding_forward)(tp_stream_t s, float *out, const int64_t *tokens, const float *table, int64_t M,
                                   int64_t lo, int64_t V, int64_t C);
  /* dtable[V,C] += dout rows of the shard's tokens (in row order). */
  tp_status_t (*embedding_backward)(tp_stream_t s, float *dtable, const int64_t *tokens, const float *dout, int64_t M,
                                    int64_t lo, int64_t V, int64_t C);
  /* rowmax[M] = max of each row of logits[M,V] (-inf for V = 0): overwritten. */
  tp_status_t (*xent_row_max)(tp_stream_t s, float *rowmax, const float *logits, int64_t M, int64_t V);
  /* sums[0..M) = sum_j exp(l[m,j] - gmax[m]); sums[M..2M) = the target logit when the target
   * (>= 0) is in the shard, else 0: overwritten. */
  tp_status_t (*xent_row_sums)(tp_stream_t s, float *sums, const float *logits, const float *gmax,
                               const int64_t *targets, int64_t M, int64_t lo, int64_t V);
  /* losses[m] = targets[m] < 0 ? 0 : log(sumexp[m]) + gmax[m] - target_logit[m] (in double). */
  tp_status_t (*xent_loss)(tp_stream_t s, float *losses, const float *sumexp, const float *gmax,
                           const float *target_logit, const int64_t *targets, int64_t M);
  /* row_scale[m] = targets[m] < 0 ? 0 : dloss ? dloss[m] : 1 (dloss may be NULL). */
  tp_status_t (*xent_row_scale)(tp_stream_t s, float *row_scale, const int64_t *targets, const float *dloss, int64_t M);
  /* dlogits[M,V] = (softmax - onehot(target)) * scale * row_scale[m] (row_scale may be
   * NULL): overwritten; a negative target has no one-hot entry. */
  tp_status_t (*xent_backward)(tp_stream_t s, float *dlogits, const float *logits, const float *gmax,
                               const float *sumexp, const int64_t *targets, const float *row_scale, float scale,
                               int64_t M, int64_t lo, int64_t V);
  /* The layer's target pass: out[m] = -1 where targets[m] == ignore_index, else targets[m];
   * result[0] = the first m whose (not ignored) target is outside [0, vocab), or -1;
   * result[1] = the number of targets not ignored.  result is device memory the caller
   * reads back once (tp_device_copy); out is valid only when result[0] is -1. */
  tp_status_t (*xent_targets)(tp_stream_t s, int64_t *out, int64_t *result, const int64_t *targets, int64_t M,
                              int64_t ignore_index, int64_t vocab);
  /* fp[0] = a 24-bit fingerprint of (M, ignore_index, targets) as a float, fp[1] = -fp[0]
   * (a max all-reduce of fp says whether every rank passed the same targets). */
  tp_status_t (*xent_targets_hash)(tp_stream_t s, float *fp, const int64_t *targets, int64_t M, int64_t ignore_index);
  /* result[0] = the first i with x[i] < lo or x[i] >= hi, or -1 (token ids, positions). */
  tp_status_t (*check_range)(tp_stream_t s, int64_t *result, const int64_t *x, int64_t n, int64_t lo, int64_t hi);

  /* ---- element-wise on flat arrays ------------------------------------------------- */
  /* y[n] = a + b (residual adds; y may be a or b: y += a is add(y, y, a)). */
  tp_status_t (*add)(tp_stream_t s, float *y, const float *a, const float *b, int64_t n);
  /* y[n] = a - b (y may be a or b). */
  tp_status_t (*sub)(tp_stream_t s, float *y, const float *a, const float *b, int64_t n);
  /* y[n] = alpha * x (y may be x). */
  tp_status_t (*scale)(tp_stream_t s, float *y, const float *x, float alpha, int64_t n);
  /* y[n] = value. */
  tp_status_t (*fill)(tp_stream_t s, float *y, float value, int64_t n);
  /* y[i] = (2 u - 1) * bound, u = tp_uniform01(seed, tensor, index0 + i): seeded init. */
  tp_status_t (*init_uniform)(tp_stream_t s, float *y, int64_t n, uint64_t seed, uint64_t tensor, uint64_t index0,
                              float bound);
  /* y[i] = element index0 + i of a N(0,1) tensor: elements 2p, 2p + 1 are the cosine and
   * sine halves of a Box-Muller pair drawn from tp_uniform01(seed, tensor, 2p and 2p + 1). */
  tp_status_t (*init_normal)(tp_stream_t s, float *y, int64_t n, uint64_t seed, uint64_t tensor, uint64_t index0);

  /* ---- optimizer steps, in place on n elements (formulas in cpu/optim.c) ---------- */
  tp_status_t (*adamw_step)(tp_stream_t s, float *p, const float *g, float *m, float *v, int64_t n, float lr,
                            float beta1, float beta2, float eps, float weight_decay, int64_t step);
  /* buf may be NULL (no momentum); first: the first step (buf = g). */
  tp_status_t (*sgd_step)(tp_stream_t s, float *p, const float *g, float *buf, int64_t n, float lr, float momentum,
                          float weight_decay, int first);

  /* ---- low-precision storage: 16-bit and quantized weights, float32 arithmetic -------
   * wdt below is TP_BFLOAT16, TP_FLOAT16 or a quantized weight format (TP_INT8 rows, the
   * GGUF block formats TP_Q8_0 .. TP_Q6_K; float32 weights take the float32 entries
   * above).  Weights are stored in wdt, row-major [N, K]: a quantized row is
   * tp_weight_row_bytes(wdt, K) bytes (K whole blocks; the entries refuse other K) and
   * is dequantized on the fly (registers for the GEMV, a bounded panel for the GEMM);
   * quantized weights are frozen, so dw must be NULL with them.  Activations, biases,
   * gradients (the "main grad" of mixed-precision training) and the optimizer's master
   * weights stay float32; every product is accumulated in float32.  CUDA's GEMM path
   * (M > 8) rounds x (or dy) and the dequantized panel to bfloat16 for cuBLAS (two
   * bfloat16 roundings per product), its GEMV (M <= 8) stays float32. */
  /* y[n] in ydt = x[n] in xdt, for ydt, xdt in {float32, bfloat16, float16} (same dtype: a
   * copy).  To a 16-bit type: round to nearest even, NaN stays a (quiet) NaN of its sign,
   * beyond the largest finite value infinity, subnormals kept (NumPy's float16 and
   * ml_dtypes' bfloat16 casts bit for bit); bfloat16 <-> float16 through float32 (exact
   * widening, one rounding).  x and y do not overlap. */
  tp_status_t (*convert)(tp_stream_t s, void *y, tp_dtype_t ydt, const void *x, tp_dtype_t xdt, int64_t n);
  /* Bytes of workspace linear_forward_lp (backward = 0) or linear_backward_lp (1) want for
   * these sizes (any smaller non-zero amount the entry accepts is documented by the table;
   * the layers always pass this much).  0 is a valid answer. */
  size_t (*linear_lp_workspace)(int64_t M, int64_t K, int64_t N, tp_dtype_t wdt, int backward);
  /* y[M,N] = x[M,K] w[N,K]^T (+ b[N] when b), w in wdt: overwrites y (K = 0: y = b or 0).
   * CPU: x stays float32, w is widened a panel at a time into the workspace (decode-sized
   * M reads w once, converting in registers); CUDA: x is rounded to wdt in the workspace
   * and one tensor-core GEMM (wdt x wdt, float32 compute and output) runs. */
  tp_status_t (*linear_forward_lp)(tp_stream_t s, float *y, const float *x, const void *w, tp_dtype_t wdt,
                                   const float *b, int64_t M, int64_t K, int64_t N, void *workspace,
                                   size_t workspace_bytes);
  /* As linear_backward with w in wdt: dx[M,K] = dy w (overwrites, or += when accumulate_dx;
   * skipped when dx is NULL); dw[N,K] += dy^T x in float32 (skipped when NULL); db[N] +=
   * column sums of dy (when db).  CUDA rounds dy (for dx) and dy, x (for dw) to wdt in the
   * workspace; CPU computes with float32 dy and x. */
  tp_status_t (*linear_backward_lp)(tp_stream_t s, float *dx, float *dw, float *db, const float *dy, const float *x,
                                    const void *w, tp_dtype_t wdt, int64_t M, int64_t K, int64_t N, int accumulate_dx,
                                    void *workspace, size_t workspace_bytes);
  /* embedding_forward with table[V,C] in wdt: out[M,C] (float32) overwritten with the
   * widened row for tokens in the shard, zero otherwise. */
  tp_status_t (*embedding_forward_lp)(tp_stream_t s, float *out, const int64_t *tokens, const void *table,
                                      tp_dtype_t wdt, int64_t M, int64_t lo, int64_t V, int64_t C);
} tp_kernel_ops;

/* Every entry, in struct order (the parity harness lists and checks them; a new entry
 * without its line here fails the static assert below). */
/* clang-format off */
#define TP_KERNEL_ENTRIES(X)                                                                                       \
  X(gemm) X(linear_forward) X(linear_backward) X(add_bias) X(bias_grad) X(act_forward) X(act_backward)             \
  X(bias_act_forward) X(bias_act_backward_workspace) X(bias_act_backward) X(layernorm_forward)                     \
  X(layernorm_backward) X(rmsnorm_forward) X(rmsnorm_backward) X(rope) X(attention_workspace)                      \
  X(attention_forward) X(attention_backward) X(kv_cache_write) X(kv_cache_write_paged) X(positions)              \
  X(embedding_forward) X(embedding_backward) X(xent_row_max) X(xent_row_sums) X(xent_loss) X(xent_row_scale) X(xent_backward)           \
  X(xent_targets) X(xent_targets_hash) X(check_range) X(add) X(sub) X(scale) X(fill) X(init_uniform)              \
  X(init_normal) X(adamw_step) X(sgd_step) X(convert) X(linear_lp_workspace) X(linear_forward_lp)          \
  X(linear_backward_lp) X(embedding_forward_lp)
/* clang-format on */

#define TP_KERNEL_COUNT_ONE_(name) +1
enum { TP_KERNEL_NUM_ENTRIES = 0 TP_KERNEL_ENTRIES(TP_KERNEL_COUNT_ONE_) };
#ifdef __cplusplus /* the CUDA kernels (.cu, C++) include this header for the types */
#define TP_STATIC_ASSERT_ static_assert
#else
#define TP_STATIC_ASSERT_ _Static_assert
#endif
TP_STATIC_ASSERT_(sizeof(tp_kernel_ops) ==
                      offsetof(tp_kernel_ops, gemm) + TP_KERNEL_NUM_ENTRIES * sizeof(void (*)(void)),
                  "TP_KERNEL_ENTRIES must list every entry of tp_kernel_ops");

/* The kernel table of a device type, or NULL when this build or process has none
 * (registry.c: one line per device). */
#ifdef __cplusplus
extern "C" {
#endif
const tp_kernel_ops *tp_kernels_of(tp_device_t device);
/* Registers a device's kernel table (the CUDA plugin's, by cuda/cuda_load.c): once per type;
 * every entry must be set.  The CPU's is built in. */
tp_status_t tp_kernels_register(tp_device_t device, const tp_kernel_ops *ops);

extern const tp_kernel_ops tp_cpu_kernel_ops;
#ifdef __cplusplus
}
#endif

#endif
