/*
 * The layers' data touches, one inline call each: every read or write of a layer's
 * (device) data goes through here, so that the layers themselves keep only the
 * algorithm and the collectives and never dereference a data pointer.  Copies and
 * fills go through the device table (tp_device_copy / copy_2d / memset), the
 * arithmetic and the checks that read data through the layer's kernel table
 * (csrc/kernels/kernels_impl.h); a check's result is read back once.
 * Every pointer lives on the layer's device (tp_lk.dev).
 */
#ifndef TPCORE_LAYER_KERNELS_H
#define TPCORE_LAYER_KERNELS_H

#include "../core/throttle_impl.h"
#include "../kernels/kernels_impl.h"
#include "layers_impl.h"

/* A layer's device and its kernel table, fixed at create. */
typedef struct {
  tp_device_t dev;
  int id;
  const tp_kernel_ops *k;
} tp_lk;

static inline tp_status_t tp_lk_init(tp_lk *c, const char *op, tp_device_t dev, int id) {
  c->dev = dev;
  c->id = id;
  c->k = tp_kernels_of(dev);
  if (!c->k)
    return tp_set_error(TP_ERR_UNSUPPORTED, "%s: this build of tpcore has no kernels for %s", op, tp_device_name(dev));
  return TP_SUCCESS;
}

/* The compute throttle (tpcore/throttle.h) around one compute kernel: t0 from
 * tp_throttle_begin() (< 0: off); on a GPU the stream is waited for first, so that the
 * sleep follows the kernel's own time.  Copies, fills and initialisation are not throttled. */
static inline tp_status_t lk_throttled(const tp_lk *c, double t0, tp_status_t st, tp_stream_t s) {
  if (t0 < 0 || st != TP_SUCCESS) return st;
  if (c->dev != TP_DEVICE_CPU) TP_CHECK(tp_device_sync(c->dev, c->id, s));
  tp_throttle_end(t0);
  return TP_SUCCESS;
}
#define LK_THROTTLED(c, s, call)                   \
  do {                                             \
    double lk_t0_ = tp_throttle_begin();           \
    tp_status_t lk_st_ = (call);                   \
    return lk_throttled((c), lk_t0_, lk_st_, (s)); \
  } while (0)

/* ------------------------------------------------------------- copies, fills */

static inline tp_status_t lk_copy(const tp_lk *c, void *dst, const void *src, size_t nbytes, tp_stream_t s) {
  return tp_device_copy(c->dev, dst, c->dev, src, nbytes, s);
}
/* rows x cols floats: dst row r at dst + r * dld, src row r at src + r * sld (elements). */
static inline tp_status_t lk_copy_rows(const tp_lk *c, float *dst, int64_t dld, const float *src, int64_t sld,
                                       int64_t rows, int64_t cols, tp_stream_t s) {
  if (rows <= 0 || cols <= 0) return TP_SUCCESS;
  return tp_device_copy_2d(c->dev, dst, (size_t)dld * sizeof(float), c->dev, src, (size_t)sld * sizeof(float),
                           (size_t)cols * sizeof(float), (size_t)rows, s);
}
static inline tp_status_t lk_zero(const tp_lk *c, void *dst, size_t nbytes, tp_stream_t s) {
  return tp_device_memset(c->dev, dst, 0, nbytes, s);
}
/* n int64 of device memory into host memory, the stream waited for: a check's result. */
static inline tp_status_t lk_read_i64(const tp_lk *c, int64_t *host, const int64_t *src, int64_t n, tp_stream_t s) {
  TP_CHECK(tp_device_copy(TP_DEVICE_CPU, host, c->dev, src, (size_t)n * sizeof(int64_t), s));
  return tp_device_sync(c->dev, c->id, s);
}
static inline tp_status_t lk_fill(const tp_lk *c, float *y, float value, int64_t n, tp_stream_t s) {
  return n > 0 ? c->k->fill(s, y, value, n) : TP_SUCCESS;
}
static inline tp_status_t lk_init_uniform(const tp_lk *c, float *y, int64_t n, uint64_t seed, uint64_t tensor,
                                          uint64_t index0, float bound, tp_stream_t s) {
  return n > 0 ? c->k->init_uniform(s, y, n, seed, tensor, index0, bound) : TP_SUCCESS;
}
static inline tp_status_t lk_init_normal(const tp_lk *c, float *y, int64_t n, uint64_t seed, uint64_t tensor,
                                         uint64_t index0, tp_stream_t s) {
  return n > 0 ? c->k->init_normal(s, y, n, seed, tensor, index0) : TP_SUCCESS;
}

/* ------------------------------------------------------------------- linear */

/* A weight as the layers keep it: float32, or bfloat16 / float16 storage (the *_lp
 * entries, float32 arithmetic) with the arena the lp entries' workspace comes from (one
 * per layer, grown on demand, never shared across layers in flight). */
typedef struct {
  void *p;
  tp_dtype_t dt;    /* TP_FLOAT32, TP_BFLOAT16, TP_FLOAT16, or a quantized format (TP_INT8 rows, TP_Q*) */
  tp_arena_t *lpws; /* the lp entries' workspace (unused for float32) */
} tp_lk_w;

static inline int tp_lk_lowp(tp_dtype_t dt) { return dt == TP_BFLOAT16 || dt == TP_FLOAT16; }

/* The weight dtype a config names: float32, bfloat16, float16, int8 or a GGUF block format. */
static inline tp_status_t tp_lk_check_wdtype(const char *op, tp_dtype_t dt) {
  if (tp_weight_format(dt, NULL, NULL, NULL)) return TP_SUCCESS;
  return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                      "%s: weight_dtype must be float32, bfloat16, float16, int8, q8_0, "
                      "q4_0, q4_1, q4_k, q5_k or q6_k, got %s (%d)",
                      op, tp_dtype_name(dt), (int)dt);
}

/* The elements of one block of dt (1 for float32 / 16-bit / int8 rows). */
static inline int64_t tp_lk_block(tp_dtype_t dt) {
  int64_t blk = 1;
  tp_weight_format(dt, &blk, NULL, NULL);
  return blk;
}

/* *nbytes = bytes of rows x cols of dt (rows of tp_weight_row_bytes each); an error naming op
 * and what when cols is not whole blocks or the size overflows. */
static inline tp_status_t tp_lk_wbytes(const char *op, const char *what, tp_dtype_t dt, int64_t rows, int64_t cols,
                                       size_t *nbytes) {
  size_t rb;
  int64_t blk = tp_lk_block(dt);
  if (cols % blk)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: %s has rows of %lld elements, not whole blocks of %lld (%s "
                        "weights)",
                        op, what, (long long)cols, (long long)blk, tp_dtype_name(dt));
  if (rows < 0 || !tp_weight_row_bytes(dt, cols, &rb) || !tp_mul_size((size_t)rows, rb, nbytes))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s of %lld x %lld (%s) overflows the address space", op, what,
                        (long long)rows, (long long)cols, tp_dtype_name(dt));
  return TP_SUCCESS;
}

/* The CPU's quantizer of one weight row (kernels/cpu/quant.c: the core's, used on the host). */
void tp_q_quant_row(tp_dtype_t f, void *row, const float *x, int64_t K);

/* lpws.c: the process-wide scratch of the CPU layers' low-precision GEMMs (locked while used). */
tp_arena_t *tp_lp_cpu_scratch_lock(void);
void tp_lp_cpu_scratch_unlock(void);

/* A low-precision call's workspace of `need` bytes: the layer's own arena (a GPU layer: its
 * kernels run later, on its stream) or the process-wide CPU scratch, locked until
 * lk_lp_end.  *ws NULL on failure (and nothing to end). */
static inline tp_status_t lk_lp_begin(const tp_lk *c, const tp_lk_w *w, size_t need, void **ws) {
  int cpu = c->dev == TP_DEVICE_CPU;
  tp_arena_t *a = cpu ? tp_lp_cpu_scratch_lock() : w->lpws;
  tp_status_t st = tp_arena_reserve(a, need, "linear: low-precision workspace");
  if (st != TP_SUCCESS && cpu) tp_lp_cpu_scratch_unlock();
  *ws = st == TP_SUCCESS ? a->base : NULL;
  return st;
}
static inline void lk_lp_end(const tp_lk *c) {
  if (c->dev == TP_DEVICE_CPU) tp_lp_cpu_scratch_unlock();
}

static inline tp_status_t lk_linear_forward_(const tp_lk *c, float *y, const float *x, const tp_lk_w *w, const float *b,
                                             int64_t M, int64_t K, int64_t N, tp_stream_t s) {
  if (w->dt == TP_FLOAT32) return c->k->linear_forward(s, y, x, (const float *)w->p, b, M, K, N);
  size_t need = c->k->linear_lp_workspace(M, K, N, w->dt, 0);
  void *ws;
  TP_CHECK(lk_lp_begin(c, w, need, &ws));
  tp_status_t st = c->k->linear_forward_lp(s, y, x, w->p, w->dt, b, M, K, N, ws, need);
  lk_lp_end(c);
  return st;
}
static inline tp_status_t lk_linear_backward_(const tp_lk *c, float *dx, float *dw, float *db, const float *dy,
                                              const float *x, const tp_lk_w *w, int64_t M, int64_t K, int64_t N,
                                              tp_stream_t s) {
  if (w->dt == TP_FLOAT32) return c->k->linear_backward(s, dx, dw, db, dy, x, (const float *)w->p, M, K, N, 0);
  size_t need = c->k->linear_lp_workspace(M, K, N, w->dt, 1);
  void *ws;
  TP_CHECK(lk_lp_begin(c, w, need, &ws));
  tp_status_t st = c->k->linear_backward_lp(s, dx, dw, db, dy, x, w->p, w->dt, M, K, N, 0, ws, need);
  lk_lp_end(c);
  return st;
}
static inline tp_status_t lk_linear_forward(const tp_lk *c, float *y, const float *x, const tp_lk_w *w, const float *b,
                                            int64_t M, int64_t K, int64_t N, tp_stream_t s) {
  LK_THROTTLED(c, s, lk_linear_forward_(c, y, x, w, b, M, K, N, s));
}
static inline tp_status_t lk_linear_backward(const tp_lk *c, float *dx, float *dw, float *db, const float *dy,
                                             const float *x, const tp_lk_w *w, int64_t M, int64_t K, int64_t N,
                                             tp_stream_t s) {
  LK_THROTTLED(c, s, lk_linear_backward_(c, dx, dw, db, dy, x, w, M, K, N, s));
}
/* y[n] (ydt) = x[n] (xdt). */
static inline tp_status_t lk_convert(const tp_lk *c, void *y, tp_dtype_t ydt, const void *x, tp_dtype_t xdt, int64_t n,
                                     tp_stream_t s) {
  return n > 0 ? c->k->convert(s, y, ydt, x, xdt, n) : TP_SUCCESS;
}
/* Seeded initialisation of a quantized weight: whole rows of K elements (at and n multiples
 * of K), drawn in float32 into the bounded scratch, brought to the host when the layer lives
 * on a GPU, quantized row by row there (the CPU's quantizer) and copied into place. */
static inline tp_status_t lk_init_wq(const tp_lk *c, const tp_lk_w *w, int64_t at, int64_t n, int64_t K, int normal,
                                     uint64_t seed, uint64_t tensor, uint64_t index0, float bound, tp_stream_t s) {
  size_t rb;
  if (K <= 0 || at % K || n % K || !tp_weight_row_bytes(w->dt, K, &rb))
    return tp_set_error(TP_ERR_INTERNAL, "weight initialisation: %lld elements at %lld are not whole rows of %lld",
                        (long long)n, (long long)at, (long long)K);
  int64_t per = ((int64_t)1 << 20) / K, rows = n / K;
  if (per < 1) per = 1;
  if (per > rows) per = rows;
  size_t fb = (size_t)(per * K) * sizeof(float), qb = (size_t)per * rb;
  int host = c->dev == TP_DEVICE_CPU;
  TP_CHECK(tp_arena_reserve(w->lpws, fb, "weight initialisation")); /* the float32 draws, on the device */
  float *tmp = (float *)w->lpws->base;
  float *hx = NULL;
  char *hq = NULL;
  if (!host) { /* host staging: the draws and their quantized rows */
    TP_CHECK(tp_device_alloc(TP_DEVICE_CPU, 0, fb + qb, (void **)&hx));
    hq = (char *)hx + fb;
  }
  char *dst = (char *)w->p + (size_t)(at / K) * rb;
  tp_status_t st = TP_SUCCESS;
  for (int64_t r = 0; r < rows && st == TP_SUCCESS; r += per) {
    int64_t nr = rows - r < per ? rows - r : per;
    uint64_t i0 = index0 + (uint64_t)(r * K);
    st = normal ? c->k->init_normal(s, tmp, nr * K, seed, tensor, i0)
                : c->k->init_uniform(s, tmp, nr * K, seed, tensor, i0, bound);
    if (st != TP_SUCCESS) break;
    if (host) {
      for (int64_t j = 0; j < nr; j++) tp_q_quant_row(w->dt, dst + (size_t)(r + j) * rb, tmp + j * K, K);
      continue;
    }
    st = tp_device_copy(TP_DEVICE_CPU, hx, c->dev, tmp, (size_t)(nr * K) * sizeof(float), s);
    if (st == TP_SUCCESS) st = tp_device_sync(c->dev, c->id, s);
    if (st != TP_SUCCESS) break;
    for (int64_t j = 0; j < nr; j++) tp_q_quant_row(w->dt, hq + (size_t)j * rb, hx + j * K, K);
    st = tp_device_copy(c->dev, dst + (size_t)r * rb, TP_DEVICE_CPU, hq, (size_t)nr * rb, s);
    if (st == TP_SUCCESS) st = tp_device_sync(c->dev, c->id, s);
  }
  if (hx) tp_device_free(TP_DEVICE_CPU, 0, hx);
  return st;
}

/* Seeded initialisation of n weight elements in w->dt: float32 draws straight into place;
 * a low-precision weight draws float32 runs into a bounded scratch (w->lpws; the layer
 * releases it when its initialisation is done) and rounds them, so it holds exactly the
 * rounded float32 layer's values; a quantized one quantizes whole rows of K elements
 * (lk_init_wq).  Elements [at, at + n) of w (row-major, rows of K) get draws index0.. of
 * the tensor: normal, init_normal's N(0,1); else U(-bound, bound). */
static inline tp_status_t lk_init_w(const tp_lk *c, const tp_lk_w *w, int64_t at, int64_t n, int64_t K, int normal,
                                    uint64_t seed, uint64_t tensor, uint64_t index0, float bound, tp_stream_t s) {
  if (n <= 0) return TP_SUCCESS;
  if (tp_weight_is_quantized(w->dt)) return lk_init_wq(c, w, at, n, K, normal, seed, tensor, index0, bound, s);
  if (w->dt == TP_FLOAT32) {
    float *y = (float *)w->p + at;
    return normal ? c->k->init_normal(s, y, n, seed, tensor, index0)
                  : c->k->init_uniform(s, y, n, seed, tensor, index0, bound);
  }
  const int64_t chunk = (int64_t)1 << 20;
  int64_t run = n < chunk ? n : chunk;
  TP_CHECK(tp_arena_reserve(w->lpws, (size_t)run * sizeof(float), "weight initialisation"));
  float *tmp = (float *)w->lpws->base;
  char *dst = (char *)w->p + (size_t)at * tp_dtype_size(w->dt);
  for (int64_t i = 0; i < n; i += run) {
    int64_t r = n - i < run ? n - i : run;
    TP_CHECK(normal ? c->k->init_normal(s, tmp, r, seed, tensor, index0 + (uint64_t)i)
                    : c->k->init_uniform(s, tmp, r, seed, tensor, index0 + (uint64_t)i, bound));
    TP_CHECK(c->k->convert(s, dst + (size_t)i * tp_dtype_size(w->dt), w->dt, tmp, TP_FLOAT32, r));
  }
  return TP_SUCCESS;
}
/* y[M, N] = r + b per row (b NULL: a copy of r; y may be r). */
static inline tp_status_t lk_add_bias_rows(const tp_lk *c, float *y, const float *r, const float *b, int64_t M,
                                           int64_t N, tp_stream_t s) {
  if (!b) return lk_copy(c, y, r, (size_t)(M * N) * sizeof(float), s);
  if (M <= 0 || N <= 0) return TP_SUCCESS;
  LK_THROTTLED(c, s, c->k->add_bias(s, y, r, b, M, N));
}
/* y[n] = a + b, y[n] = a - b (y may alias a or b) */
static inline tp_status_t lk_add(const tp_lk *c, float *y, const float *a, const float *b, int64_t n, tp_stream_t s) {
  if (n <= 0) return TP_SUCCESS;
  LK_THROTTLED(c, s, c->k->add(s, y, a, b, n));
}
static inline tp_status_t lk_sub(const tp_lk *c, float *y, const float *a, const float *b, int64_t n, tp_stream_t s) {
  if (n <= 0) return TP_SUCCESS;
  LK_THROTTLED(c, s, c->k->sub(s, y, a, b, n));
}

static inline tp_status_t lk_bias_act_forward(const tp_lk *c, float *out, float *h, const float *b, int64_t M,
                                              int64_t F, tp_activation_t act, tp_stream_t s) {
  LK_THROTTLED(c, s, c->k->bias_act_forward(s, out, h, b, M, F, act));
}
static inline size_t lk_bias_act_backward_workspace(const tp_lk *c, int64_t M, int64_t F, tp_activation_t act) {
  return c->k->bias_act_backward_workspace(M, F, act);
}
static inline tp_status_t lk_bias_act_backward(const tp_lk *c, float *dh, float *db, const float *h, const float *dout,
                                               int64_t M, int64_t F, tp_activation_t act, void *ws, size_t wsb,
                                               tp_stream_t s) {
  LK_THROTTLED(c, s, c->k->bias_act_backward(s, dh, db, h, dout, M, F, act, ws, wsb));
}

/* ------------------------------------------------------- norms, RoPE, attention */

static inline tp_status_t lk_layernorm_forward(const tp_lk *c, float *y, float *mean, float *rstd, const float *x,
                                               const float *w, const float *b, int64_t M, int64_t C, float eps,
                                               tp_stream_t s) {
  LK_THROTTLED(c, s, c->k->layernorm_forward(s, y, mean, rstd, x, w, b, M, C, eps));
}
static inline tp_status_t lk_layernorm_backward(const tp_lk *c, float *dx, float *dw, float *db, const float *dy,
                                                const float *x, const float *w, const float *mean, const float *rstd,
                                                int64_t M, int64_t C, tp_stream_t s) {
  LK_THROTTLED(c, s, c->k->layernorm_backward(s, dx, dw, db, dy, x, w, mean, rstd, M, C));
}
static inline tp_status_t lk_rmsnorm_forward(const tp_lk *c, float *y, float *rstd, const float *x, const float *w,
                                             int64_t M, int64_t C, float eps, tp_stream_t s) {
  LK_THROTTLED(c, s, c->k->rmsnorm_forward(s, y, rstd, x, w, M, C, eps));
}
static inline tp_status_t lk_rmsnorm_backward(const tp_lk *c, float *dx, float *dw, const float *dy, const float *x,
                                              const float *w, const float *rstd, int64_t M, int64_t C, tp_stream_t s) {
  LK_THROTTLED(c, s, c->k->rmsnorm_backward(s, dx, dw, dy, x, w, rstd, M, C));
}
static inline tp_status_t lk_rope(const tp_lk *c, float *x, int64_t rows, int64_t ld, int64_t heads, int64_t D,
                                  const int64_t *pos, const float *inv_freq, float theta, float factor, int inverse,
                                  tp_stream_t s) {
  if (rows <= 0) return TP_SUCCESS;
  LK_THROTTLED(c, s, c->k->rope(s, x, rows, ld, heads, D, pos, inv_freq, theta, factor, inverse));
}
/* pos[b * T + t] = pos0[b] + t, klen[b] = pos0[b] + T */
static inline tp_status_t lk_positions(const tp_lk *c, int64_t *pos, int64_t *klen, const int64_t *pos0, int64_t B,
                                       int64_t T, tp_stream_t s) {
  return B > 0 ? c->k->positions(s, pos, klen, pos0, B, T) : TP_SUCCESS;
}
/* K/V rows of a step into the cache at row pos0[b] + t (ring > 0: (pos0[b] + t) % ring, a
 * sliding layer's ring of ring rows) of cache sequence slots[b] (NULL: b), width floats each. */
static inline tp_status_t lk_kv_cache_write(const tp_lk *c, float *kc, float *vc, const float *k, const float *v,
                                            int64_t ld, const int64_t *pos0, const int64_t *slots, int64_t B, int64_t T,
                                            int64_t max_len, int64_t width, int64_t ring, tp_stream_t s) {
  return B > 0 && T > 0 && width > 0
             ? c->k->kv_cache_write(s, kc, vc, k, v, ld, pos0, slots, B, T, max_len, width, ring)
             : TP_SUCCESS;
}
/* K/V rows of a step into a paged pool: position pos0[b] + t in block table[b * cols + p / bs]
 * at row p % bs (no block: skipped). */
static inline tp_status_t lk_kv_cache_write_paged(const tp_lk *c, float *kc, float *vc, const float *k, const float *v,
                                                  int64_t ld, const int64_t *pos0, const int64_t *table, int64_t cols,
                                                  int64_t bs, int64_t B, int64_t T, int64_t width, tp_stream_t s) {
  return B > 0 && T > 0 && width > 0
             ? c->k->kv_cache_write_paged(s, kc, vc, k, v, ld, pos0, table, cols, bs, B, T, width)
             : TP_SUCCESS;
}
static inline size_t lk_attention_workspace(const tp_lk *c, const tp_attention_args *a, int backward) {
  return c->k->attention_workspace(a, backward);
}
static inline tp_status_t lk_attention_forward(const tp_lk *c, const tp_attention_args *a, void *ws, size_t wsb,
                                               tp_stream_t s) {
  LK_THROTTLED(c, s, c->k->attention_forward(s, a, ws, wsb));
}
static inline tp_status_t lk_attention_backward(const tp_lk *c, const tp_attention_args *a, float *dq, float *dk,
                                                float *dv, const float *dout, void *ws, size_t wsb, tp_stream_t s) {
  LK_THROTTLED(c, s, c->k->attention_backward(s, a, dq, dk, dv, dout, ws, wsb));
}

/* ------------------------------------------------------------- vocab pieces */

/* The first id outside [lo, hi): bad[0] = its index (-1: none), bad[1] = its value.  flag:
 * one int64 of device scratch the check writes, read back once (and the bad id after it). */
static inline tp_status_t lk_find_out_of_range(const tp_lk *c, int64_t *flag, int64_t bad[2], const int64_t *ids,
                                               int64_t M, int64_t lo, int64_t hi, tp_stream_t s) {
  bad[0] = -1, bad[1] = 0;
  if (M <= 0) return TP_SUCCESS;
  TP_CHECK(c->k->check_range(s, flag, ids, M, lo, hi));
  TP_CHECK(lk_read_i64(c, bad, flag, 1, s));
  if (bad[0] >= 0) TP_CHECK(lk_read_i64(c, bad + 1, ids + bad[0], 1, s));
  return TP_SUCCESS;
}
static inline tp_status_t lk_embedding_forward(const tp_lk *c, float *out, const int64_t *tokens, const tp_lk_w *table,
                                               int64_t M, int64_t lo, int64_t V, int64_t C, tp_stream_t s) {
  if (M <= 0) return TP_SUCCESS;
  if (table->dt == TP_FLOAT32)
    LK_THROTTLED(c, s, c->k->embedding_forward(s, out, tokens, (const float *)table->p, M, lo, V, C));
  LK_THROTTLED(c, s, c->k->embedding_forward_lp(s, out, tokens, table->p, table->dt, M, lo, V, C));
}
static inline tp_status_t lk_embedding_backward(const tp_lk *c, float *dtable, const int64_t *tokens, const float *dout,
                                                int64_t M, int64_t lo, int64_t V, int64_t C, tp_stream_t s) {
  if (M <= 0 || !dtable) return TP_SUCCESS; /* a quantized table is frozen: no gradient */
  LK_THROTTLED(c, s, c->k->embedding_backward(s, dtable, tokens, dout, M, lo, V, C));
}
/* fp[0] = the 24-bit fingerprint of (targets, ignore_index), fp[1] = -fp[0] (device memory) */
static inline tp_status_t lk_targets_hash(const tp_lk *c, float *fp, const int64_t *t, int64_t M, int64_t ignore_index,
                                          tp_stream_t s) {
  return c->k->xent_targets_hash(s, fp, t, M, ignore_index);
}
/* tg[m] = targets[m], or -1 where it equals ignore_index; res = [first row whose target is
 * outside [0, total) (-1: none), its target, rows not ignored] (flag: 2 int64 of device
 * scratch, read back once). */
static inline tp_status_t lk_xent_targets(const tp_lk *c, int64_t *tg, int64_t *flag, int64_t res[3],
                                          const int64_t *targets, int64_t M, int64_t ignore_index, int64_t total,
                                          tp_stream_t s) {
  res[0] = -1, res[1] = 0, res[2] = 0;
  if (M <= 0) return TP_SUCCESS;
  int64_t r[2];
  TP_CHECK(c->k->xent_targets(s, tg, flag, targets, M, ignore_index, total));
  TP_CHECK(lk_read_i64(c, r, flag, 2, s));
  res[0] = r[0], res[2] = r[1];
  if (r[0] >= 0) TP_CHECK(lk_read_i64(c, res + 1, targets + r[0], 1, s));
  return TP_SUCCESS;
}
static inline tp_status_t lk_xent_row_max(const tp_lk *c, float *rowmax, const float *logits, int64_t M, int64_t V,
                                          tp_stream_t s) {
  if (M <= 0) return TP_SUCCESS;
  LK_THROTTLED(c, s, c->k->xent_row_max(s, rowmax, logits, M, V));
}
static inline tp_status_t lk_xent_row_sums(const tp_lk *c, float *sums, const float *logits, const float *gmax,
                                           const int64_t *tg, int64_t M, int64_t lo, int64_t V, tp_stream_t s) {
  if (M <= 0) return TP_SUCCESS;
  LK_THROTTLED(c, s, c->k->xent_row_sums(s, sums, logits, gmax, tg, M, lo, V));
}
static inline tp_status_t lk_xent_losses(const tp_lk *c, float *losses, const float *sumexp, const float *gmax,
                                         const float *tl, const int64_t *tg, int64_t M, tp_stream_t s) {
  if (M <= 0) return TP_SUCCESS;
  LK_THROTTLED(c, s, c->k->xent_loss(s, losses, sumexp, gmax, tl, tg, M));
}
static inline tp_status_t lk_xent_row_scale(const tp_lk *c, float *rs, const int64_t *tg, const float *dloss, int64_t M,
                                            tp_stream_t s) {
  if (M <= 0) return TP_SUCCESS;
  LK_THROTTLED(c, s, c->k->xent_row_scale(s, rs, tg, dloss, M));
}
static inline tp_status_t lk_xent_backward(const tp_lk *c, float *dlogits, const float *logits, const float *gmax,
                                           const float *sumexp, const int64_t *tg, const float *rs, float scale,
                                           int64_t M, int64_t lo, int64_t V, tp_stream_t s) {
  if (M <= 0 || V <= 0) return TP_SUCCESS;
  LK_THROTTLED(c, s, c->k->xent_backward(s, dlogits, logits, gmax, sumexp, tg, rs, scale, M, lo, V));
}

#endif
