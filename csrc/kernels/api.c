/* The public tensor API of tpcore/kernels.h: check the views, then run the entry of
 * the kernel table of their device (one pointer call; no copies, no allocation, but for
 * rope_apply's check of a device's inv_freq: D/2 floats read back). */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "tpcore/device.h"
#include "../core/throttle_impl.h"
#include "api_impl.h"

#define F32 TP_FLOAT32
#define I64 TP_INT64
#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})

/* The shard [lo, lo + V) of a vocabulary: lo >= 0 and lo + V within int64. */
static tp_status_t check_lo(tp_kcall *c, int64_t lo, int64_t V) {
  int64_t end;
  if (lo < 0 || !tp_add_count(lo, V, &end))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: lo must be >= 0 with lo + V (V = %lld) at most 2^63 - 1, got %lld", c->op, (long long)V,
                        (long long)lo);
  return TP_SUCCESS;
}

static tp_status_t check_act(tp_kcall *c, tp_activation_t act) {
  if ((unsigned)act > TP_ACT_LAST)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: act is %d, not a tp_activation_t", c->op, (int)act);
  return TP_SUCCESS;
}

/* ------------------------------------------------------------------ linear */

/* The dtype w is stored in: float32 (the float32 entries), bfloat16 / float16 or a
 * quantized weight format (the *_lp entries: every other argument stays float32).  A
 * quantized w is described by its logical shape [N, K] with the strides of a contiguous
 * [N, K] tensor; its rows are tp_weight_row_bytes(dtype, K) bytes back to back, K whole
 * blocks of the format. */
static tp_status_t weight_dtype(tp_kcall *c, const tp_tensor *w, tp_dtype_t *dt) {
  *dt = F32;
  if (!w) return TP_SUCCESS; /* tp_karg names it */
  if (w->dtype != F32 && tp_weight_format(w->dtype, NULL, NULL, NULL)) *dt = w->dtype;
  else if (w->dtype != F32)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: w must be float32, bfloat16, float16 or a quantized weight "
                        "format (int8, q8_0, q4_0, q4_1, q4_k, q5_k, q6_k), got %s",
                        c->op, tp_dtype_name(w->dtype));
  int64_t blk = 1;
  tp_weight_format(*dt, &blk, NULL, NULL);
  if (blk > 1 && w->ndim == 2 && w->shape[1] % blk)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: w (%s) has rows of %lld elements, not whole blocks of %lld",
                        c->op, tp_dtype_name(*dt), (long long)w->shape[1], (long long)blk);
  return TP_SUCCESS;
}

/* The workspace of a *_lp entry, allocated on the call's device for this call (freed by
 * lp_workspace_free; on a GPU the free waits for the device, so the kernel has finished). */
static tp_status_t lp_workspace(tp_kcall *c, size_t nbytes, void **ws) {
  *ws = NULL;
  if (!nbytes) return TP_SUCCESS;
  tp_status_t st = tp_device_alloc(c->dev, c->id, nbytes, ws);
  if (st != TP_SUCCESS)
    return tp_set_error(st, "%s: could not allocate the %zu-byte workspace for 16-bit weights: %s", c->op, nbytes,
                        tp_last_error());
  return TP_SUCCESS;
}

static void lp_workspace_free(tp_kcall *c, void *ws) {
  if (ws) tp_device_free(c->dev, c->id, ws);
}

/* The compute throttle (tpcore/throttle.h) after a GEMM of this API: t0 from
 * tp_throttle_begin() (< 0: off); on a GPU the stream is waited for to time the kernel. */
static tp_status_t throttled(tp_kcall *c, double t0, tp_status_t st, tp_stream_t s) {
  if (t0 < 0 || st != TP_SUCCESS) return st;
  if (c->dev != TP_DEVICE_CPU) TP_CHECK(tp_device_sync(c->dev, c->id, s));
  tp_throttle_end(t0);
  return TP_SUCCESS;
}

static tp_status_t linear_forward(tp_kcall *c, tp_stream_t s, const tp_tensor *y, const tp_tensor *x,
                                  const tp_tensor *w, const tp_tensor *b);
static tp_status_t linear_backward(tp_kcall *c, tp_stream_t s, const tp_tensor *dx, const tp_tensor *dw,
                                   const tp_tensor *db, const tp_tensor *dy, const tp_tensor *x, const tp_tensor *w,
                                   int accumulate_dx);

tp_status_t tp_linear_forward(tp_stream_t s, const tp_tensor *y, const tp_tensor *x, const tp_tensor *w,
                              const tp_tensor *b) {
  tp_kcall c = {"linear_forward", TP_DEVICE_CPU, 0, 0};
  double t0 = tp_throttle_begin();
  return throttled(&c, t0, linear_forward(&c, s, y, x, w, b), s);
}

tp_status_t tp_linear_backward(tp_stream_t s, const tp_tensor *dx, const tp_tensor *dw, const tp_tensor *db,
                               const tp_tensor *dy, const tp_tensor *x, const tp_tensor *w, int accumulate_dx) {
  tp_kcall c = {"linear_backward", TP_DEVICE_CPU, 0, 0};
  double t0 = tp_throttle_begin();
  return throttled(&c, t0, linear_backward(&c, s, dx, dw, db, dy, x, w, accumulate_dx), s);
}

static tp_status_t linear_forward(tp_kcall *c, tp_stream_t s, const tp_tensor *y, const tp_tensor *x,
                                  const tp_tensor *w, const tp_tensor *b) {
  tp_dtype_t wdt;
  TP_CHECK(tp_karg(c, "x", x, 0, F32, 2, SHAPE(TP_ANY, TP_ANY)));
  int64_t M = x->shape[0], K = x->shape[1];
  TP_CHECK(weight_dtype(c, w, &wdt));
  TP_CHECK(tp_karg(c, "w", w, 0, wdt, 2, SHAPE(TP_ANY, K)));
  int64_t N = w->shape[0];
  TP_CHECK(tp_karg(c, "b", b, 1, F32, 1, SHAPE(N)));
  TP_CHECK(tp_karg(c, "y", y, 0, F32, 2, SHAPE(M, N)));
  TP_CHECK(tp_kblas_dim(c, "M (rows of x)", M));
  TP_CHECK(tp_kblas_dim(c, "K (columns of x)", K));
  TP_CHECK(tp_kblas_dim(c, "N (rows of w)", N));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(c, s, &k));
  if (wdt == F32) return k->linear_forward(s, y->data, x->data, w->data, b ? b->data : NULL, M, K, N);
  size_t nbytes = k->linear_lp_workspace(M, K, N, wdt, 0);
  void *ws;
  TP_CHECK(lp_workspace(c, nbytes, &ws));
  tp_status_t st = k->linear_forward_lp(s, y->data, x->data, w->data, wdt, b ? b->data : NULL, M, K, N, ws, nbytes);
  lp_workspace_free(c, ws);
  return st;
}

static tp_status_t linear_backward(tp_kcall *c, tp_stream_t s, const tp_tensor *dx, const tp_tensor *dw,
                                   const tp_tensor *db, const tp_tensor *dy, const tp_tensor *x, const tp_tensor *w,
                                   int accumulate_dx) {
  tp_dtype_t wdt;
  TP_CHECK(tp_karg(c, "dy", dy, 0, F32, 2, SHAPE(TP_ANY, TP_ANY)));
  int64_t M = dy->shape[0], N = dy->shape[1];
  TP_CHECK(weight_dtype(c, w, &wdt));
  TP_CHECK(tp_karg(c, "w", w, 0, wdt, 2, SHAPE(N, TP_ANY)));
  int64_t K = w->shape[1];
  TP_CHECK(tp_karg(c, "x", x, 0, F32, 2, SHAPE(M, K)));
  TP_CHECK(tp_karg(c, "dx", dx, 1, F32, 2, SHAPE(M, K)));
  TP_CHECK(tp_karg(c, "dw", dw, 1, F32, 2, SHAPE(N, K))); /* the float32 main gradient, whatever w's dtype */
  if (dw && tp_weight_is_quantized(wdt))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: dw must be NULL for a quantized w (%s weights are frozen)", c->op,
                        tp_dtype_name(wdt));
  TP_CHECK(tp_karg(c, "db", db, 1, F32, 1, SHAPE(N)));
  TP_CHECK(tp_kblas_dim(c, "M (rows of dy)", M));
  TP_CHECK(tp_kblas_dim(c, "K (columns of x)", K));
  TP_CHECK(tp_kblas_dim(c, "N (columns of dy)", N));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(c, s, &k));
  if (wdt == F32)
    return k->linear_backward(s, dx ? dx->data : NULL, dw ? dw->data : NULL, db ? db->data : NULL, dy->data, x->data,
                              w->data, M, K, N, accumulate_dx);
  size_t nbytes = k->linear_lp_workspace(M, K, N, wdt, 1);
  void *ws;
  TP_CHECK(lp_workspace(c, nbytes, &ws));
  tp_status_t st = k->linear_backward_lp(s, dx ? dx->data : NULL, dw ? dw->data : NULL, db ? db->data : NULL, dy->data,
                                         x->data, w->data, wdt, M, K, N, accumulate_dx, ws, nbytes);
  lp_workspace_free(c, ws);
  return st;
}

/* --------------------------------------------------------------- conversion */

static int convertible(tp_dtype_t t) { return t == F32 || t == TP_BFLOAT16 || t == TP_FLOAT16; }

tp_status_t tp_convert(tp_stream_t s, const tp_tensor *y, const tp_tensor *x) {
  tp_kcall c = {"convert", TP_DEVICE_CPU, 0, 0};
  if (!x) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "convert: x is NULL");
  if (x->ndim < 0 || x->ndim > TP_MAX_DIMS)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "convert: x has %d dimensions (0 to %d)", x->ndim, TP_MAX_DIMS);
  if (!convertible(x->dtype))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "convert: x must be float32, bfloat16 or float16, got %s",
                        tp_dtype_name(x->dtype));
  TP_CHECK(tp_karg(&c, "x", x, 0, x->dtype, x->ndim, x->shape));
  if (!y) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "convert: y is NULL");
  if (!convertible(y->dtype))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "convert: y must be float32, bfloat16 or float16, got %s",
                        tp_dtype_name(y->dtype));
  if (y->ndim != x->ndim)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "convert: y has %d dimensions but x has %d (y must have x's shape)",
                        y->ndim, x->ndim);
  TP_CHECK(tp_karg(&c, "y", y, 0, y->dtype, x->ndim, x->shape));
  int64_t n = tp_tensor_numel(x);
  /* tp_karg bounds n by 2^40 elements: the byte spans below cannot overflow */
  uintptr_t xa = (uintptr_t)x->data, ya = (uintptr_t)y->data;
  uintptr_t xe = xa + (uintptr_t)n * tp_dtype_size(x->dtype), ye = ya + (uintptr_t)n * tp_dtype_size(y->dtype);
  if (n > 0 && xa < ye && ya < xe)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "convert: y and x overlap (the conversion is not in place)");
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->convert(s, y->data, y->dtype, x->data, x->dtype, n);
}

/* ------------------------------------------------------------- activations */

/* h[M, hw] (hw = F, or 2F even for the gated SwiGLU and GeGLU): M and F. */
static tp_status_t act_input(tp_kcall *c, const char *name, const tp_tensor *h, tp_activation_t act, int64_t *M,
                             int64_t *F) {
  TP_CHECK(check_act(c, act));
  TP_CHECK(tp_karg(c, name, h, 0, F32, 2, SHAPE(TP_ANY, TP_ANY)));
  *M = h->shape[0];
  *F = h->shape[1];
  if (tp_act_gated(act)) {
    if (*F % 2)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "%s: %s must have an even number of columns for %s ([gate | "
                          "up]), got %lld",
                          c->op, name, act == TP_ACT_SWIGLU ? "swiglu" : "geglu", (long long)*F);
    *F /= 2;
  }
  return TP_SUCCESS;
}

tp_status_t tp_act_forward(tp_stream_t s, const tp_tensor *out, const tp_tensor *h, tp_activation_t act) {
  tp_kcall c = {"act_forward", TP_DEVICE_CPU, 0, 0};
  int64_t M, F;
  TP_CHECK(act_input(&c, "h", h, act, &M, &F));
  TP_CHECK(tp_karg(&c, "out", out, 0, F32, 2, SHAPE(M, F)));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->act_forward(s, out->data, h->data, M, F, act);
}

tp_status_t tp_act_backward(tp_stream_t s, const tp_tensor *dh, const tp_tensor *h, const tp_tensor *dout,
                            tp_activation_t act) {
  tp_kcall c = {"act_backward", TP_DEVICE_CPU, 0, 0};
  int64_t M, F;
  TP_CHECK(act_input(&c, "h", h, act, &M, &F));
  TP_CHECK(tp_karg(&c, "dout", dout, 0, F32, 2, SHAPE(M, F)));
  TP_CHECK(tp_karg(&c, "dh", dh, 0, F32, 2, SHAPE(M, h->shape[1])));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->act_backward(s, dh->data, h->data, dout->data, M, F, act);
}

tp_status_t tp_bias_act_forward(tp_stream_t s, const tp_tensor *out, const tp_tensor *h, const tp_tensor *b,
                                tp_activation_t act) {
  tp_kcall c = {"bias_act_forward", TP_DEVICE_CPU, 0, 0};
  int64_t M, F;
  TP_CHECK(act_input(&c, "h", h, act, &M, &F));
  TP_CHECK(tp_karg(&c, "b", b, 1, F32, 1, SHAPE(h->shape[1])));
  TP_CHECK(tp_karg(&c, "out", out, 0, F32, 2, SHAPE(M, F)));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->bias_act_forward(s, out->data, h->data, b ? b->data : NULL, M, F, act);
}

tp_status_t tp_bias_act_backward_workspace_size(tp_device_t device, int64_t M, int64_t F, tp_activation_t act,
                                                size_t *nbytes) {
  tp_kcall c = {"bias_act_backward_workspace_size", TP_DEVICE_CPU, 0, 0};
  if (!nbytes) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: nbytes is NULL", c.op);
  *nbytes = 0;
  TP_CHECK(check_act(&c, act));
  int64_t n;
  if (M < 0 || F < 0 || !tp_numel3(M, F, 2, &n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: M = %lld and F = %lld must be >= 0 with M x 2F at most 2^40",
                        c.op, (long long)M, (long long)F);
  TP_CHECK(tp_kdevice(&c, "device", device, 0));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, NULL, &k));
  *nbytes = k->bias_act_backward_workspace(M, F, act);
  return TP_SUCCESS;
}

tp_status_t tp_bias_act_backward(tp_stream_t s, const tp_tensor *dh, const tp_tensor *db, const tp_tensor *h,
                                 const tp_tensor *dout, tp_activation_t act, const tp_tensor *workspace) {
  tp_kcall c = {"bias_act_backward", TP_DEVICE_CPU, 0, 0};
  int64_t M, F;
  TP_CHECK(act_input(&c, "h", h, act, &M, &F));
  TP_CHECK(tp_karg(&c, "dout", dout, 0, F32, 2, SHAPE(M, F)));
  TP_CHECK(tp_karg(&c, "dh", dh, 0, F32, 2, SHAPE(M, h->shape[1])));
  TP_CHECK(tp_karg(&c, "db", db, 1, F32, 1, SHAPE(h->shape[1])));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  void *ws;
  size_t wsb, need = db && M > 0 ? (size_t)(h->shape[1] ? h->shape[1] : 1) * sizeof(float) : 0; /* one row at least */
  TP_CHECK(tp_kworkspace(&c, workspace, need, &ws, &wsb));
  return k->bias_act_backward(s, dh->data, db ? db->data : NULL, h->data, dout->data, M, F, act, ws, wsb);
}

/* ---------------------------------------------------------- vocab-parallel */

tp_status_t tp_embedding_forward(tp_stream_t s, const tp_tensor *out, const tp_tensor *tokens, const tp_tensor *table,
                                 int64_t lo) {
  tp_kcall c = {"embedding_forward", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(tp_karg(&c, "table", table, 0, F32, 2, SHAPE(TP_ANY, TP_ANY)));
  TP_CHECK(tp_karg(&c, "tokens", tokens, 0, I64, 1, SHAPE(TP_ANY)));
  int64_t V = table->shape[0], C = table->shape[1], M = tokens->shape[0];
  TP_CHECK(tp_karg(&c, "out", out, 0, F32, 2, SHAPE(M, C)));
  TP_CHECK(check_lo(&c, lo, V));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->embedding_forward(s, out->data, tokens->data, table->data, M, lo, V, C);
}

tp_status_t tp_embedding_backward(tp_stream_t s, const tp_tensor *dtable, const tp_tensor *tokens,
                                  const tp_tensor *dout, int64_t lo) {
  tp_kcall c = {"embedding_backward", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(tp_karg(&c, "dtable", dtable, 0, F32, 2, SHAPE(TP_ANY, TP_ANY)));
  TP_CHECK(tp_karg(&c, "tokens", tokens, 0, I64, 1, SHAPE(TP_ANY)));
  int64_t V = dtable->shape[0], C = dtable->shape[1], M = tokens->shape[0];
  TP_CHECK(tp_karg(&c, "dout", dout, 0, F32, 2, SHAPE(M, C)));
  TP_CHECK(check_lo(&c, lo, V));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->embedding_backward(s, dtable->data, tokens->data, dout->data, M, lo, V, C);
}

tp_status_t tp_xent_row_max(tp_stream_t s, const tp_tensor *rowmax, const tp_tensor *logits) {
  tp_kcall c = {"xent_row_max", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(tp_karg(&c, "logits", logits, 0, F32, 2, SHAPE(TP_ANY, TP_ANY)));
  TP_CHECK(tp_karg(&c, "rowmax", rowmax, 0, F32, 1, SHAPE(logits->shape[0])));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->xent_row_max(s, rowmax->data, logits->data, logits->shape[0], logits->shape[1]);
}

tp_status_t tp_xent_row_sums(tp_stream_t s, const tp_tensor *sums, const tp_tensor *logits, const tp_tensor *gmax,
                             const tp_tensor *targets, int64_t lo) {
  tp_kcall c = {"xent_row_sums", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(tp_karg(&c, "logits", logits, 0, F32, 2, SHAPE(TP_ANY, TP_ANY)));
  int64_t M = logits->shape[0], V = logits->shape[1];
  TP_CHECK(tp_karg(&c, "gmax", gmax, 0, F32, 1, SHAPE(M)));
  TP_CHECK(tp_karg(&c, "targets", targets, 0, I64, 1, SHAPE(M)));
  TP_CHECK(tp_karg(&c, "sums", sums, 0, F32, 1, SHAPE(2 * M)));
  TP_CHECK(check_lo(&c, lo, V));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->xent_row_sums(s, sums->data, logits->data, gmax->data, targets->data, M, lo, V);
}

tp_status_t tp_xent_backward(tp_stream_t s, const tp_tensor *dlogits, const tp_tensor *logits, const tp_tensor *gmax,
                             const tp_tensor *sumexp, const tp_tensor *targets, const tp_tensor *row_scale, float scale,
                             int64_t lo) {
  tp_kcall c = {"xent_backward", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(tp_karg(&c, "logits", logits, 0, F32, 2, SHAPE(TP_ANY, TP_ANY)));
  int64_t M = logits->shape[0], V = logits->shape[1];
  TP_CHECK(tp_karg(&c, "gmax", gmax, 0, F32, 1, SHAPE(M)));
  TP_CHECK(tp_karg(&c, "sumexp", sumexp, 0, F32, 1, SHAPE(M)));
  TP_CHECK(tp_karg(&c, "targets", targets, 0, I64, 1, SHAPE(M)));
  TP_CHECK(tp_karg(&c, "row_scale", row_scale, 1, F32, 1, SHAPE(M)));
  TP_CHECK(tp_karg(&c, "dlogits", dlogits, 0, F32, 2, SHAPE(M, V)));
  TP_CHECK(check_lo(&c, lo, V));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->xent_backward(s, dlogits->data, logits->data, gmax->data, sumexp->data, targets->data,
                          row_scale ? row_scale->data : NULL, scale, M, lo, V);
}

/* ------------------------------------------------------------------- norms */

tp_status_t tp_layernorm_forward(tp_stream_t s, const tp_tensor *y, const tp_tensor *mean, const tp_tensor *rstd,
                                 const tp_tensor *x, const tp_tensor *w, const tp_tensor *b, float eps) {
  tp_kcall c = {"layernorm_forward", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(tp_karg(&c, "x", x, 0, F32, 2, SHAPE(TP_ANY, TP_ANY)));
  int64_t M = x->shape[0], C = x->shape[1];
  TP_CHECK(tp_karg(&c, "w", w, 0, F32, 1, SHAPE(C)));
  TP_CHECK(tp_karg(&c, "b", b, 1, F32, 1, SHAPE(C)));
  TP_CHECK(tp_karg(&c, "y", y, 0, F32, 2, SHAPE(M, C)));
  TP_CHECK(tp_karg(&c, "mean", mean, 1, F32, 1, SHAPE(M)));
  TP_CHECK(tp_karg(&c, "rstd", rstd, 1, F32, 1, SHAPE(M)));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->layernorm_forward(s, y->data, mean ? mean->data : NULL, rstd ? rstd->data : NULL, x->data, w->data,
                              b ? b->data : NULL, M, C, eps);
}

tp_status_t tp_layernorm_backward(tp_stream_t s, const tp_tensor *dx, const tp_tensor *dw, const tp_tensor *db,
                                  const tp_tensor *dy, const tp_tensor *x, const tp_tensor *w, const tp_tensor *mean,
                                  const tp_tensor *rstd) {
  tp_kcall c = {"layernorm_backward", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(tp_karg(&c, "x", x, 0, F32, 2, SHAPE(TP_ANY, TP_ANY)));
  int64_t M = x->shape[0], C = x->shape[1];
  TP_CHECK(tp_karg(&c, "dy", dy, 0, F32, 2, SHAPE(M, C)));
  TP_CHECK(tp_karg(&c, "w", w, 0, F32, 1, SHAPE(C)));
  TP_CHECK(tp_karg(&c, "mean", mean, 0, F32, 1, SHAPE(M)));
  TP_CHECK(tp_karg(&c, "rstd", rstd, 0, F32, 1, SHAPE(M)));
  TP_CHECK(tp_karg(&c, "dx", dx, 0, F32, 2, SHAPE(M, C)));
  TP_CHECK(tp_karg(&c, "dw", dw, 0, F32, 1, SHAPE(C)));
  TP_CHECK(tp_karg(&c, "db", db, 1, F32, 1, SHAPE(C)));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->layernorm_backward(s, dx->data, dw->data, db ? db->data : NULL, dy->data, x->data, w->data, mean->data,
                               rstd->data, M, C);
}

tp_status_t tp_rmsnorm_forward(tp_stream_t s, const tp_tensor *y, const tp_tensor *rstd, const tp_tensor *x,
                               const tp_tensor *w, float eps) {
  tp_kcall c = {"rmsnorm_forward", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(tp_karg(&c, "x", x, 0, F32, 2, SHAPE(TP_ANY, TP_ANY)));
  int64_t M = x->shape[0], C = x->shape[1];
  TP_CHECK(tp_karg(&c, "w", w, 0, F32, 1, SHAPE(C)));
  TP_CHECK(tp_karg(&c, "y", y, 0, F32, 2, SHAPE(M, C)));
  TP_CHECK(tp_karg(&c, "rstd", rstd, 1, F32, 1, SHAPE(M)));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->rmsnorm_forward(s, y->data, rstd ? rstd->data : NULL, x->data, w->data, M, C, eps);
}

tp_status_t tp_rmsnorm_backward(tp_stream_t s, const tp_tensor *dx, const tp_tensor *dw, const tp_tensor *dy,
                                const tp_tensor *x, const tp_tensor *w, const tp_tensor *rstd) {
  tp_kcall c = {"rmsnorm_backward", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(tp_karg(&c, "x", x, 0, F32, 2, SHAPE(TP_ANY, TP_ANY)));
  int64_t M = x->shape[0], C = x->shape[1];
  TP_CHECK(tp_karg(&c, "dy", dy, 0, F32, 2, SHAPE(M, C)));
  TP_CHECK(tp_karg(&c, "w", w, 0, F32, 1, SHAPE(C)));
  TP_CHECK(tp_karg(&c, "rstd", rstd, 0, F32, 1, SHAPE(M)));
  TP_CHECK(tp_karg(&c, "dx", dx, 0, F32, 2, SHAPE(M, C)));
  TP_CHECK(tp_karg(&c, "dw", dw, 0, F32, 1, SHAPE(C)));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  return k->rmsnorm_backward(s, dx->data, dw->data, dy->data, x->data, w->data, rstd->data, M, C);
}

/* The rotary table inv_freq[n] of the call's device: every value finite (read on the host;
 * a device table is copied there first, the stream waited for). */
static tp_status_t check_inv_freq(tp_kcall *c, const tp_tensor *t, int64_t n, tp_stream_t s) {
  const float *v = t->data;
  float *host = NULL;
  if (n > 0 && c->dev != TP_DEVICE_CPU) {
    size_t nb;
    if (!tp_mul_size((size_t)n, sizeof(float), &nb) || !(host = malloc(nb)))
      return tp_set_error(TP_ERR_NOMEM, "%s: no host memory to check inv_freq (%lld floats)", c->op, (long long)n);
    tp_status_t st = tp_device_copy(TP_DEVICE_CPU, host, c->dev, t->data, nb, s);
    if (st == TP_SUCCESS) st = tp_device_sync(c->dev, c->id, s);
    if (st != TP_SUCCESS) {
      free(host);
      return st;
    }
    v = host;
  }
  int64_t bad = -1;
  for (int64_t i = 0; i < n && bad < 0; i++)
    if (!isfinite(v[i])) bad = i;
  float found = bad >= 0 ? v[bad] : 0.0f;
  free(host);
  if (bad >= 0)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: inv_freq must hold finite values, got %g at index %lld", c->op,
                        (double)found, (long long)bad);
  return TP_SUCCESS;
}

tp_status_t tp_rope_apply(tp_stream_t s, const tp_tensor *x, const tp_tensor *pos, int64_t heads, int64_t D,
                          const tp_tensor *inv_freq, float theta, float factor, int inverse) {
  tp_kcall c = {"rope_apply", TP_DEVICE_CPU, 0, 0};
  int64_t width;
  if (heads < 0 || D < 0 || D % 2 || !tp_mul_count(heads, D, &width))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: heads (%lld) must be >= 0 and D (%lld) even and >= 0", c.op,
                        (long long)heads, (long long)D);
  if (!inv_freq && !(theta > 0.0f && isfinite(theta)))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: theta must be finite and > 0 (without inv_freq), got %g", c.op,
                        (double)theta);
  if (!(factor > 0.0f && isfinite(factor)))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: factor must be finite and > 0, got %g", c.op, (double)factor);
  TP_CHECK(tp_karg_rows(&c, "x", x, F32, TP_ANY, width));
  int64_t rows = x->shape[0];
  TP_CHECK(tp_karg(&c, "pos", pos, 0, I64, 1, SHAPE(rows)));
  TP_CHECK(tp_karg(&c, "inv_freq", inv_freq, 1, F32, 1, SHAPE(D / 2)));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  if (inv_freq) TP_CHECK(check_inv_freq(&c, inv_freq, D / 2, s));
  int64_t ld = rows > 1 ? x->strides[0] : width;
  return k->rope(s, x->data, rows, ld, heads, D, pos->data, inv_freq ? inv_freq->data : NULL, theta, factor, inverse);
}
