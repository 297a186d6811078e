/*
 * The layers' data touches, one inline call each: every read or write of a layer's
 * (device) data goes through here, so that the layers themselves keep only the
 * algorithm and the collectives.  Copies and fills go through the device table
 * (tp_device_copy / copy_2d / memset); the arithmetic goes to the kernels.
 * `dev` is the layer's device; every pointer lives there.
 */
#ifndef TPCORE_LAYER_KERNELS_H
#define TPCORE_LAYER_KERNELS_H

#include <math.h>

#include "layers_impl.h"
#include "tpcore/kernels.h"

/* ------------------------------------------------------------- copies, fills */

static inline tp_status_t lk_copy(tp_device_t dev, void *dst, const void *src, size_t nbytes, tp_stream_t s) {
  return tp_device_copy(dev, dst, dev, src, nbytes, s);
}
/* rows x cols floats: dst row r at dst + r * dld, src row r at src + r * sld (elements). */
static inline tp_status_t lk_copy_rows(tp_device_t dev, float *dst, int64_t dld, const float *src, int64_t sld,
                                       int64_t rows, int64_t cols, tp_stream_t s) {
  if (rows <= 0 || cols <= 0) return TP_SUCCESS;
  return tp_device_copy_2d(dev, dst, (size_t)dld * sizeof(float), dev, src, (size_t)sld * sizeof(float),
                           (size_t)cols * sizeof(float), (size_t)rows, s);
}
static inline tp_status_t lk_zero(tp_device_t dev, void *dst, size_t nbytes, tp_stream_t s) {
  return tp_device_memset(dev, dst, 0, nbytes, s);
}

/* ------------------------------------------------------------------- kernels */

static inline tp_status_t lk_linear_forward(tp_device_t dev, float *y, const float *x, const float *w, const float *b,
                                            int64_t M, int64_t K, int64_t N, tp_stream_t s) {
  (void)dev, (void)s;
  tp_linear_forward(y, x, w, b, M, K, N);
  return TP_SUCCESS;
}
/* dx may be NULL (no input gradient); accumulate: dx += instead of = */
static inline tp_status_t lk_linear_backward_acc(tp_device_t dev, float *dx, float *dw, float *db, const float *dy,
                                                 const float *x, const float *w, int64_t M, int64_t K, int64_t N,
                                                 int accumulate, tp_stream_t s) {
  (void)dev, (void)s;
  tp_linear_backward(dx, dw, db, dy, x, w, M, K, N, accumulate);
  return TP_SUCCESS;
}
static inline tp_status_t lk_linear_backward(tp_device_t dev, float *dx, float *dw, float *db, const float *dy,
                                             const float *x, const float *w, int64_t M, int64_t K, int64_t N,
                                             tp_stream_t s) {
  return lk_linear_backward_acc(dev, dx, dw, db, dy, x, w, M, K, N, 0, s);
}

/* y[M, N] = r + b per row (b NULL: a copy of r). */
static inline tp_status_t lk_add_bias_rows(tp_device_t dev, float *y, const float *r, const float *b, int64_t M,
                                           int64_t N, tp_stream_t s) {
  if (!b) return lk_copy(dev, y, r, (size_t)(M * N) * sizeof(float), s);
  for (int64_t m = 0; m < M; m++) {
    const float *src = r + m * N;
    float *dst = y + m * N;
    for (int64_t j = 0; j < N; j++) dst[j] = src[j] + b[j];
  }
  return TP_SUCCESS;
}
/* y[n] = a + b */
static inline tp_status_t lk_add(tp_device_t dev, float *y, const float *a, const float *b, int64_t n, tp_stream_t s) {
  (void)dev, (void)s;
  for (int64_t i = 0; i < n; i++) y[i] = a[i] + b[i];
  return TP_SUCCESS;
}

/* y[n] = a - b */
static inline tp_status_t lk_sub(tp_device_t dev, float *y, const float *a, const float *b, int64_t n, tp_stream_t s) {
  (void)dev, (void)s;
  for (int64_t i = 0; i < n; i++) y[i] = a[i] - b[i];
  return TP_SUCCESS;
}

/* ------------------------------------------------------- norms, RoPE, attention */

static inline tp_status_t lk_layernorm_forward(tp_device_t dev, float *y, float *mean, float *rstd, const float *x,
                                               const float *w, const float *b, int64_t M, int64_t C, float eps,
                                               tp_stream_t s) {
  (void)dev, (void)s;
  tp_layernorm_forward(y, mean, rstd, x, w, b, M, C, eps);
  return TP_SUCCESS;
}
static inline tp_status_t lk_layernorm_backward(tp_device_t dev, float *dx, float *dw, float *db, const float *dy,
                                                const float *x, const float *w, const float *mean, const float *rstd,
                                                int64_t M, int64_t C, tp_stream_t s) {
  (void)dev, (void)s;
  tp_layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, M, C);
  return TP_SUCCESS;
}
static inline tp_status_t lk_rmsnorm_forward(tp_device_t dev, float *y, float *rstd, const float *x, const float *w,
                                             int64_t M, int64_t C, float eps, tp_stream_t s) {
  (void)dev, (void)s;
  tp_rmsnorm_forward(y, rstd, x, w, M, C, eps);
  return TP_SUCCESS;
}
static inline tp_status_t lk_rmsnorm_backward(tp_device_t dev, float *dx, float *dw, const float *dy, const float *x,
                                              const float *w, const float *rstd, int64_t M, int64_t C, tp_stream_t s) {
  (void)dev, (void)s;
  tp_rmsnorm_backward(dx, dw, dy, x, w, rstd, M, C);
  return TP_SUCCESS;
}
static inline tp_status_t lk_rope(tp_device_t dev, float *x, int64_t rows, int64_t ld, int64_t heads, int64_t D,
                                  const int64_t *pos, float theta, int inverse, tp_stream_t s) {
  (void)dev, (void)s;
  tp_rope_apply(x, rows, ld, heads, D, pos, theta, inverse);
  return TP_SUCCESS;
}
/* pos[b * T + t] = pos0[b] + t, klen[b] = pos0[b] + T */
static inline tp_status_t lk_positions(tp_device_t dev, int64_t *pos, int64_t *klen, const int64_t *pos0, int64_t B,
                                       int64_t T, tp_stream_t s) {
  (void)dev, (void)s;
  for (int64_t b = 0; b < B; b++) {
    klen[b] = pos0[b] + T;
    for (int64_t t = 0; t < T; t++) pos[b * T + t] = pos0[b] + t;
  }
  return TP_SUCCESS;
}
/* K/V rows of a step into the cache at pos0[b] + t (width floats each). */
static inline tp_status_t lk_kv_cache_write(tp_device_t dev, float *kc, float *vc, const float *k, const float *v,
                                            int64_t ld, const int64_t *pos0, int64_t B, int64_t T, int64_t max_len,
                                            int64_t width, tp_stream_t s) {
  for (int64_t b = 0; b < B; b++) {
    int64_t at = (b * max_len + pos0[b]) * width;
    TP_CHECK(lk_copy_rows(dev, kc + at, width, k + b * T * ld, ld, T, width, s));
    TP_CHECK(lk_copy_rows(dev, vc + at, width, v + b * T * ld, ld, T, width, s));
  }
  return TP_SUCCESS;
}
static inline size_t lk_attention_workspace(tp_device_t dev, const tp_attention_args *a, int backward) {
  (void)dev, (void)a, (void)backward;
  return 0;
}
static inline tp_status_t lk_attention_forward(tp_device_t dev, const tp_attention_args *a, void *ws, size_t wsb,
                                               tp_stream_t s) {
  (void)dev, (void)ws, (void)wsb, (void)s;
  if (tp_attention_forward(a)) return tp_set_error(TP_ERR_NOMEM, "out of memory");
  return TP_SUCCESS;
}
static inline tp_status_t lk_attention_backward(tp_device_t dev, const tp_attention_args *a, float *dq, float *dk,
                                                float *dv, const float *dout, void *ws, size_t wsb, tp_stream_t s) {
  (void)dev, (void)ws, (void)wsb, (void)s;
  if (tp_attention_backward(a, dq, dk, dv, dout)) return tp_set_error(TP_ERR_NOMEM, "out of memory");
  return TP_SUCCESS;
}

static inline tp_status_t lk_bias_act_forward(tp_device_t dev, float *out, float *h, const float *b, int64_t M,
                                              int64_t F, tp_activation_t act, tp_stream_t s) {
  (void)dev, (void)s;
  tp_bias_act_forward(out, h, b, M, F, act);
  return TP_SUCCESS;
}
static inline tp_status_t lk_bias_act_backward(tp_device_t dev, float *dh, float *db, const float *h,
                                               const float *dout, int64_t M, int64_t F, tp_activation_t act,
                                               tp_stream_t s) {
  (void)dev, (void)s;
  if (tp_bias_act_backward(dh, db, h, dout, M, F, act) != 0)
    return tp_set_error(TP_ERR_NOMEM, "out of memory");
  return TP_SUCCESS;
}

/* ------------------------------------------------------------- vocab pieces */

/* The first id outside [lo, hi): bad[0] = its index (-1: none), bad[1] = its value.
 * flag: two int64 of device scratch the check writes, read back once. */
static inline tp_status_t lk_find_out_of_range(tp_device_t dev, int64_t *flag, int64_t bad[2], const int64_t *ids,
                                               int64_t M, int64_t lo, int64_t hi, tp_stream_t s) {
  (void)dev, (void)flag, (void)s;
  bad[0] = -1, bad[1] = 0;
  for (int64_t m = 0; m < M; m++)
    if (ids[m] < lo || ids[m] >= hi) {
      bad[0] = m, bad[1] = ids[m];
      break;
    }
  return TP_SUCCESS;
}
static inline tp_status_t lk_embedding_forward(tp_device_t dev, float *out, const int64_t *tokens, const float *table,
                                               int64_t M, int64_t lo, int64_t V, int64_t C, tp_stream_t s) {
  (void)dev, (void)s;
  tp_embedding_forward(out, tokens, table, M, lo, V, C);
  return TP_SUCCESS;
}
static inline tp_status_t lk_embedding_backward(tp_device_t dev, float *dtable, const int64_t *tokens,
                                                const float *dout, int64_t M, int64_t lo, int64_t V, int64_t C,
                                                tp_stream_t s) {
  (void)dev, (void)s;
  tp_embedding_backward(dtable, tokens, dout, M, lo, V, C);
  return TP_SUCCESS;
}

/* A 24-bit fingerprint of the targets and ignore_index (exact in float32): max(h) == -max(-h)
 * over the ranks iff every rank hashed the same targets.  Read back into *h. */
static inline tp_status_t lk_targets_hash(tp_device_t dev, float *h, int64_t *flag, const int64_t *t, int64_t M,
                                          int64_t ignore_index, tp_stream_t s) {
  (void)dev, (void)flag, (void)s;
  uint64_t x = (0xcbf29ce484222325ULL ^ (uint64_t)M) * 0x100000001b3ULL ^ (uint64_t)ignore_index;
  for (int64_t m = 0; m < M; m++) x = (x ^ (uint64_t)t[m]) * 0x100000001b3ULL;
  x ^= x >> 29;
  *h = (float)(x & 0xFFFFFF);
  return TP_SUCCESS;
}
/* tg[m] = targets[m], or -1 where it equals ignore_index; res = [first row whose target is
 * outside [0, total) (-1: none), its target, rows not ignored] (read back once). */
static inline tp_status_t lk_xent_targets(tp_device_t dev, int64_t *tg, int64_t *flag, int64_t res[3],
                                          const int64_t *targets, int64_t M, int64_t ignore_index, int64_t total,
                                          tp_stream_t s) {
  (void)dev, (void)flag, (void)s;
  res[0] = -1, res[1] = 0, res[2] = 0;
  for (int64_t m = 0; m < M; m++) {
    int64_t t = targets[m];
    if (t == ignore_index) {
      tg[m] = -1;
      continue;
    }
    if (t < 0 || t >= total) {
      res[0] = m, res[1] = t;
      return TP_SUCCESS;
    }
    tg[m] = t;
    res[2]++;
  }
  return TP_SUCCESS;
}
static inline tp_status_t lk_xent_row_max(tp_device_t dev, float *rowmax, const float *logits, int64_t M, int64_t V,
                                          tp_stream_t s) {
  (void)dev, (void)s;
  tp_xent_row_max(rowmax, logits, M, V);
  return TP_SUCCESS;
}
static inline tp_status_t lk_xent_row_sums(tp_device_t dev, float *sums, const float *logits, const float *gmax,
                                           const int64_t *tg, int64_t M, int64_t lo, int64_t V, tp_stream_t s) {
  (void)dev, (void)s;
  tp_xent_row_sums(sums, logits, gmax, tg, M, lo, V);
  return TP_SUCCESS;
}
/* losses[m] = log(sumexp) + gmax - target logit, 0 on ignored rows (tg < 0). */
static inline tp_status_t lk_xent_losses(tp_device_t dev, float *losses, const float *sumexp, const float *gmax,
                                         const float *tl, const int64_t *tg, int64_t M, tp_stream_t s) {
  (void)dev, (void)s;
  for (int64_t m = 0; m < M; m++)
    losses[m] = tg[m] < 0 ? 0.0f : (float)(log((double)sumexp[m]) + (double)gmax[m] - (double)tl[m]);
  return TP_SUCCESS;
}
/* rs[m] = 0 on ignored rows, else dloss[m] (dloss NULL: 1). */
static inline tp_status_t lk_xent_row_scale(tp_device_t dev, float *rs, const int64_t *tg, const float *dloss,
                                            int64_t M, tp_stream_t s) {
  (void)dev, (void)s;
  for (int64_t m = 0; m < M; m++) rs[m] = tg[m] < 0 ? 0.0f : dloss ? dloss[m] : 1.0f;
  return TP_SUCCESS;
}
static inline tp_status_t lk_xent_backward(tp_device_t dev, float *dlogits, const float *logits, const float *gmax,
                                           const float *sumexp, const int64_t *tg, const float *rs, float scale,
                                           int64_t M, int64_t lo, int64_t V, tp_stream_t s) {
  (void)dev, (void)s;
  tp_xent_backward(dlogits, logits, gmax, sumexp, tg, rs, scale, M, lo, V);
  return TP_SUCCESS;
}

#endif
