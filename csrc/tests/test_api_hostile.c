/*
 * Hostile arguments to every public entry of the tensor + stream C API (issue 9): the
 * layers (linear column/row, MLP, embedding, cross-entropy, block with its cache), the
 * kernels, the device table, the shard split and the collectives.  Each bad call must
 * return a non-success status whose tp_last_error() names the operation and the
 * argument; zero-size calls succeed and do nothing; nothing crashes, hangs or trips
 * ASan/UBSan.  World size 1 (one process): the checks are local.
 * Prints one line per failure and "N passed, N failed".
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tpcore/layers.h"

static int npass, nfail;

/* Under ASan a request past its 2^40-byte limit aborts unless the allocator may return
 * NULL, as the C library's does: the device table must then report TP_ERR_NOMEM. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }

#define ANY_ERR ((tp_status_t)-1)

/* st must be `want` (ANY_ERR: any failure) and the sentence must hold a and b (NULL: skip). */
static void expect(tp_status_t st, tp_status_t want, const char *a, const char *b, const char *src, int line) {
  const char *e = tp_last_error();
  int ok = st != TP_SUCCESS && (want == ANY_ERR || st == want) && (!a || strstr(e, a)) && (!b || strstr(e, b));
  if (ok) {
    npass++;
    return;
  }
  nfail++;
  printf("FAIL line %d: %s\n  -> %s: \"%s\" (want %s with \"%s\" and \"%s\")\n", line, src, tp_status_name(st),
         st == TP_SUCCESS ? "" : e, want == ANY_ERR ? "an error" : tp_status_name(want), a ? a : "", b ? b : "");
}
static void expect_ok(tp_status_t st, const char *src, int line) {
  if (st == TP_SUCCESS) {
    npass++;
    return;
  }
  nfail++;
  printf("FAIL line %d: %s\n  -> %s: \"%s\" (want success)\n", line, src, tp_status_name(st), tp_last_error());
}
#define BAD(call, want, a, b) expect((call), (want), (a), (b), #call, __LINE__)
#define ARG(call, a, b) BAD(call, TP_ERR_INVALID_ARGUMENT, a, b)
#define OK(call) expect_ok((call), #call, __LINE__)
#define TRUE(cond) expect_ok((cond) ? TP_SUCCESS : TP_ERR_INTERNAL, #cond, __LINE__)

/* Views of host arrays and hostile variants. */
static tp_tensor T2(void *p, int64_t r, int64_t c) { return tp_tensor_2d(p, TP_FLOAT32, r, c); }
static tp_tensor T1(void *p, int64_t n) { return tp_tensor_1d(p, TP_FLOAT32, n); }
static tp_tensor I1(void *p, int64_t n) { return tp_tensor_1d(p, TP_INT64, n); }
static tp_tensor with_dtype(tp_tensor t, tp_dtype_t d) { t.dtype = d; return t; }
static tp_tensor with_ndim(tp_tensor t, int nd) { t.ndim = nd; return t; }
static tp_tensor with_dev(tp_tensor t, tp_device_t d, int id) { t.device = d; t.device_id = id; return t; }
static tp_tensor with_data(tp_tensor t, void *p) { t.data = p; return t; }
static tp_tensor with_stride(tp_tensor t, int i, int64_t s) { t.strides[i] = s; return t; }
static tp_tensor with_shape(tp_tensor t, int i, int64_t s) { t.shape[i] = s; return t; }
/* 3-D view of a 2-D tensor (an extra leading 1) */
static tp_tensor as3d(tp_tensor t) {
  int64_t shape[3] = {1, t.shape[0], t.shape[1]};
  return tp_tensor_nd(t.data, t.dtype, 3, shape);
}
#define P(t) ((tp_tensor[]){t})

/* a fake stream: any non-NULL value (the CPU has only the NULL stream) */
static tp_stream_t fake_stream(void) { return (tp_stream_t)(uintptr_t)0x1000; }

static const int64_t HUGE_DIMS[] = {(int64_t)1 << 31, (int64_t)1 << 62, INT64_MAX};

enum { M = 3, K = 5, N = 4 };
static float xa[64 * 64], ya[64 * 64], wa[64 * 64], ba[64 * 64], ga[64 * 64];
static int64_t tok[64];

/* ----------------------------------------------------------------- generic */

/* The hostile variants of an argument `t` of a call: run(t') must fail naming op and arg. */
typedef tp_status_t (*call1)(const tp_tensor *t, void *ctx);
typedef struct {
  const char *what;
  tp_tensor t;
  const char *sub;
  tp_status_t want;
  int loose; /* a size that may be reported through the argument it disagrees with: only the op named */
} variant;
static void hostile_variants_opt(const char *op, const char *arg, tp_tensor good, call1 run, void *ctx, int line,
                                 int null_ok) {
  char src[160];
  variant v[32];
  int n = 0;
  v[n++] = (variant){"NULL data", with_data(good, NULL), "NULL", TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"wrong dtype", with_dtype(good, good.dtype == TP_FLOAT32 ? TP_FLOAT64 : TP_FLOAT32), NULL,
                          TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"bad dtype", with_dtype(good, (tp_dtype_t)77), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"ndim 0", with_ndim(good, 0), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"ndim -1", with_ndim(good, -1), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"ndim 3", good.ndim == 2 ? as3d(good) : with_ndim(good, 3), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"ndim 9", with_ndim(good, TP_MAX_DIMS + 1), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"ndim INT_MAX", with_ndim(good, INT_MAX), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"negative dim", with_shape(good, 0, -1), NULL, TP_ERR_INVALID_ARGUMENT, 1};
  v[n++] = (variant){"INT64_MIN dim", with_shape(good, 0, INT64_MIN), NULL, TP_ERR_INVALID_ARGUMENT, 1};
  for (int h = 1; h < 3; h++) /* 2^62, INT64_MAX rows (2^31 rows of a few columns is a valid view) */
    v[n++] = (variant){"huge dim", with_shape(good, 0, HUGE_DIMS[h]), NULL, TP_ERR_INVALID_ARGUMENT, 1};
  if (good.ndim == 2) {
    tp_tensor o = with_shape(with_shape(good, 0, (int64_t)1 << 40), 1, (int64_t)1 << 40); /* 2^80 elements */
    v[n++] = (variant){"numel past int64", o, NULL, TP_ERR_INVALID_ARGUMENT, 1};
    v[n++] = (variant){"huge cols", with_shape(good, 1, INT64_MAX), NULL, TP_ERR_INVALID_ARGUMENT, 1};
    if (good.shape[1] > 1) v[n++] = (variant){"column stride 2", with_stride(good, 1, 2), NULL,
                                                   TP_ERR_INVALID_ARGUMENT, 0};
    if (good.shape[1] > 1) v[n++] = (variant){"zero strides", with_stride(with_stride(good, 0, 0), 1, 0), NULL,
                                                   TP_ERR_INVALID_ARGUMENT, 0};
    if (good.shape[0] > 1) v[n++] = (variant){"row stride 0", with_stride(good, 0, 0), NULL,
                                                   TP_ERR_INVALID_ARGUMENT, 0};
    if (good.shape[0] > 1) v[n++] = (variant){"negative row stride", with_stride(good, 0, -good.shape[1]), NULL,
                                                   TP_ERR_INVALID_ARGUMENT, 0};
  } else if (good.shape[0] > 1) {
    v[n++] = (variant){"stride 0", with_stride(good, 0, 0), NULL, TP_ERR_INVALID_ARGUMENT, 0};
    v[n++] = (variant){"stride 2", with_stride(good, 0, 2), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  }
  v[n++] = (variant){"cuda tensor", with_dev(good, TP_DEVICE_CUDA, 0), "cuda", ANY_ERR, 0};
  v[n++] = (variant){"device 7", with_dev(good, (tp_device_t)7, 0), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"device -1", with_dev(good, (tp_device_t)-1, 0), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  for (int i = 0; i < n; i++) {
    snprintf(src, sizeof src, "%s: %s %s (from line %d)", op, arg, v[i].what, line);
    tp_tensor t = v[i].t;
    expect(run(&t, ctx), v[i].want, op, v[i].loose ? NULL : arg, src, line);
  }
  if (null_ok) return;
  snprintf(src, sizeof src, "%s: %s NULL (from line %d)", op, arg, line);
  expect(run(NULL, ctx), TP_ERR_INVALID_ARGUMENT, op, arg, src, line);
}
static void hostile_variants(const char *op, const char *arg, tp_tensor good, call1 run, void *ctx, int line) {
  hostile_variants_opt(op, arg, good, run, ctx, line, 0);
}

/* ------------------------------------------------------------------ kernels */

/* Each argument of a kernel in turn replaced by its hostile variants, the others good. */
typedef struct {
  int which;              /* the argument replaced */
  const tp_tensor *args[8];
  int kind;               /* which kernel */
} kctx;

static tp_status_t run_kernel(const kctx *c, const tp_tensor *const *a, tp_stream_t s) {
  switch (c->kind) {
    case 0: return tp_linear_forward(s, a[0], a[1], a[2], a[3]);
    case 1: return tp_linear_backward(s, a[0], a[1], a[2], a[3], a[4], a[5], 0);
    case 2: return tp_act_forward(s, a[0], a[1], TP_ACT_GELU);
    case 3: return tp_act_backward(s, a[0], a[1], a[2], TP_ACT_GELU);
    case 4: return tp_bias_act_forward(s, a[0], a[1], a[2], TP_ACT_GELU);
    case 5: return tp_bias_act_backward(s, a[0], a[1], a[2], a[3], TP_ACT_GELU, a[4]);
    case 6: return tp_embedding_forward(s, a[0], a[1], a[2], 0);
    case 7: return tp_embedding_backward(s, a[0], a[1], a[2], 0);
    case 8: return tp_xent_row_max(s, a[0], a[1]);
    case 9: return tp_xent_row_sums(s, a[0], a[1], a[2], a[3], 0);
    case 10: return tp_xent_backward(s, a[0], a[1], a[2], a[3], a[4], a[5], 1.0f, 0);
    case 11: return tp_layernorm_forward(s, a[0], a[1], a[2], a[3], a[4], a[5], 1e-5f);
    case 12: return tp_layernorm_backward(s, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
    case 13: return tp_rmsnorm_forward(s, a[0], a[1], a[2], a[3], 1e-5f);
    case 14: return tp_rmsnorm_backward(s, a[0], a[1], a[2], a[3], a[4], a[5]);
    case 15: return tp_rope_apply(s, a[0], a[1], 1, 4, 10000.0f, 0);
    case 16: return tp_adamw_step(s, a[0], a[1], a[2], a[3], 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1);
    case 17: return tp_sgd_step(s, a[0], a[1], a[2], 0.1f, 0.9f, 0.0f, 1);
  }
  return TP_ERR_INTERNAL;
}
static tp_status_t kernel_with(const tp_tensor *t, void *ctx) {
  kctx *c = ctx;
  const tp_tensor *a[8];
  memcpy(a, c->args, sizeof a);
  a[c->which] = t;
  return run_kernel(c, a, NULL);
}

static void kernel_case(const char *op, int kind, int nargs, const char *const *names, const tp_tensor *const *good,
                        const int *optional, int line) {
  kctx c = {.kind = kind};
  memcpy(c.args, good, sizeof(c.args[0]) * (size_t)nargs);
  char src[96];
  snprintf(src, sizeof src, "%s on good arguments (line %d)", op, line);
  expect_ok(run_kernel(&c, c.args, NULL), src, line);
  for (int i = 0; i < nargs; i++) {
    if (!good[i] || !names[i]) continue;
    c.which = i;
    if (optional[i]) {
      /* NULL is accepted for an optional argument; the other variants are not */
      snprintf(src, sizeof src, "%s: optional %s NULL (line %d)", op, names[i], line);
      expect_ok(kernel_with(NULL, &c), src, line);
    }
    hostile_variants_opt(op, names[i], *good[i], kernel_with, &c, line, optional[i]);
  }
}


static void test_kernels(void) {
  static float h[M * 2 * N], dh[M * 2 * N], out[M * N], dout[M * N], st[2 * M], st2[2 * M], mean[M], rstd[M];
  static float ws[4096];
  for (int i = 0; i < M; i++) tok[i] = i % 2;
  tp_tensor x = T2(xa, M, K), y = T2(ya, M, N), w = T2(wa, N, K), b = T1(ba, N), dx = T2(ga, M, K);
  tp_tensor dw = T2(wa + 1024, N, K), db = T1(ba + 1024, N), dy = T2(ya + 1024, M, N);
  {
    const char *nm[] = {"y", "x", "w", "b"};
    const tp_tensor *g[] = {&y, &x, &w, &b};
    int opt[] = {0, 0, 0, 1};
    kernel_case("linear_forward", 0, 4, nm, g, opt, __LINE__);
  }
  {
    const char *nm[] = {"dx", "dw", "db", "dy", "x", "w"};
    const tp_tensor *g[] = {&dx, &dw, &db, &dy, &x, &w};
    int opt[] = {1, 1, 1, 0, 0, 0};
    kernel_case("linear_backward", 1, 6, nm, g, opt, __LINE__);
  }
  tp_tensor H = T2(h, M, N), O = T2(out, M, N), DH = T2(dh, M, N), DO = T2(dout, M, N), HB = T1(ba, N);
  {
    const char *nm[] = {"out", "h"};
    const tp_tensor *g[] = {&O, &H};
    int opt[] = {0, 0};
    kernel_case("act_forward", 2, 2, nm, g, opt, __LINE__);
  }
  {
    const char *nm[] = {"dh", "h", "dout"};
    const tp_tensor *g[] = {&DH, &H, &DO};
    int opt[] = {0, 0, 0};
    kernel_case("act_backward", 3, 3, nm, g, opt, __LINE__);
  }
  {
    const char *nm[] = {"out", "h", "b"};
    const tp_tensor *g[] = {&O, &H, &HB};
    int opt[] = {0, 0, 1};
    kernel_case("bias_act_forward", 4, 3, nm, g, opt, __LINE__);
  }
  {
    size_t need = 0;
    OK(tp_bias_act_backward_workspace_size(TP_DEVICE_CPU, M, N, TP_ACT_GELU, &need));
    TRUE(need <= sizeof ws);
    tp_tensor W = tp_tensor_1d(ws, TP_UINT8, (int64_t)sizeof ws), DB = T1(ba + 512, N);
    const char *nm[] = {"dh", "db", "h", "dout", NULL};
    const tp_tensor *g[] = {&DH, &DB, &H, &DO, &W};
    int opt[] = {0, 1, 0, 0, 0};
    kernel_case("bias_act_backward", 5, 5, nm, g, opt, __LINE__);
    ARG(tp_bias_act_backward(NULL, &DH, &DB, &H, &DO, TP_ACT_GELU, P(with_data(W, NULL))), "bias_act_backward",
        "workspace");
    ARG(tp_bias_act_backward(NULL, &DH, &DB, &H, &DO, TP_ACT_GELU, P(with_ndim(W, 9))), "bias_act_backward",
        "workspace");
    ARG(tp_bias_act_backward(NULL, &DH, &DB, &H, &DO, TP_ACT_GELU, P(with_ndim(W, -3))), "bias_act_backward",
        "workspace");
    ARG(tp_bias_act_backward(NULL, &DH, &DB, &H, &DO, TP_ACT_GELU, P(with_shape(W, 0, -8))), "bias_act_backward",
        "workspace");
    BAD(tp_bias_act_backward(NULL, &DH, &DB, &H, &DO, TP_ACT_GELU, P(with_dev(W, TP_DEVICE_CUDA, 0))), ANY_ERR,
        "bias_act_backward", "workspace");
    if (need)
      ARG(tp_bias_act_backward(NULL, &DH, &DB, &H, &DO, TP_ACT_GELU, P(with_shape(W, 0, 1))), "bias_act_backward",
          "workspace");
    ARG(tp_bias_act_backward_workspace_size(TP_DEVICE_CPU, -1, N, TP_ACT_GELU, &need), "bias_act_backward", "M");
    ARG(tp_bias_act_backward_workspace_size(TP_DEVICE_CPU, M, -1, TP_ACT_GELU, &need), "bias_act_backward", "F");
    BAD(tp_bias_act_backward_workspace_size(TP_DEVICE_CPU, INT64_MAX, INT64_MAX, TP_ACT_GELU, &need), ANY_ERR,
        "bias_act_backward", NULL);
    BAD(tp_bias_act_backward_workspace_size(TP_DEVICE_CUDA, M, N, TP_ACT_GELU, &need), ANY_ERR, "bias_act_backward",
        "cuda");
    ARG(tp_bias_act_backward_workspace_size((tp_device_t)9, M, N, TP_ACT_GELU, &need), "bias_act_backward",
        "device");
    ARG(tp_bias_act_backward_workspace_size(TP_DEVICE_CPU, M, N, (tp_activation_t)99, &need), "bias_act_backward",
        "act");
    ARG(tp_bias_act_backward_workspace_size(TP_DEVICE_CPU, M, N, TP_ACT_GELU, NULL), "bias_act_backward",
        "nbytes");
  }
  ARG(tp_act_forward(NULL, &O, &H, (tp_activation_t)-1), "act_forward", "act");
  ARG(tp_act_forward(NULL, &O, &H, (tp_activation_t)99), "act_forward", "act");
  ARG(tp_act_forward(NULL, &O, P(T2(h, M, 2 * N - 1)), TP_ACT_SWIGLU), "act_forward", "h");
  ARG(tp_act_backward(NULL, &DH, &H, &DO, (tp_activation_t)5), "act_backward", "act");
  /* embedding / cross-entropy */
  tp_tensor tab = T2(wa, 2, N), E = T2(ya, M, N), TK = I1(tok, M);
  {
    const char *nm[] = {"out", "tokens", "table"};
    const tp_tensor *g[] = {&E, &TK, &tab};
    int opt[] = {0, 0, 0};
    kernel_case("embedding_forward", 6, 3, nm, g, opt, __LINE__);
  }
  {
    const char *nm[] = {"dtable", "tokens", "dout"};
    const tp_tensor *g[] = {&tab, &TK, &E};
    int opt[] = {0, 0, 0};
    kernel_case("embedding_backward", 7, 3, nm, g, opt, __LINE__);
  }
  ARG(tp_embedding_forward(NULL, &E, &TK, &tab, -1), "embedding_forward", "lo");
  ARG(tp_embedding_forward(NULL, &E, &TK, &tab, INT64_MAX), "embedding_forward", "lo");
  ARG(tp_embedding_backward(NULL, &tab, &TK, &E, INT64_MIN), "embedding_backward", "lo");
  tp_tensor L = T2(xa, M, K), RM = T1(st, M), GM = T1(st, M), SU = T1(st2, 2 * M), SE = T1(st2, M), TG = I1(tok, M);
  {
    const char *nm[] = {"rowmax", "logits"};
    const tp_tensor *g[] = {&RM, &L};
    int opt[] = {0, 0};
    kernel_case("xent_row_max", 8, 2, nm, g, opt, __LINE__);
  }
  {
    const char *nm[] = {"sums", "logits", "gmax", "targets"};
    const tp_tensor *g[] = {&SU, &L, &GM, &TG};
    int opt[] = {0, 0, 0, 0};
    kernel_case("xent_row_sums", 9, 4, nm, g, opt, __LINE__);
  }
  {
    tp_tensor DL = T2(ga, M, K), RS = T1(rstd, M);
    for (int i = 0; i < M; i++) st2[i] = 1.0f, rstd[i] = 1.0f;
    const char *nm[] = {"dlogits", "logits", "gmax", "sumexp", "targets", "row_scale"};
    const tp_tensor *g[] = {&DL, &L, &GM, &SE, &TG, &RS};
    int opt[] = {0, 0, 0, 0, 0, 1};
    kernel_case("xent_backward", 10, 6, nm, g, opt, __LINE__);
  }
  ARG(tp_xent_row_sums(NULL, &SU, &L, &GM, &TG, -5), "xent_row_sums", "lo");
  ARG(tp_xent_backward(NULL, P(T2(ga, M, K)), &L, &GM, &SE, &TG, NULL, 1.0f, INT64_MAX), "xent_backward", "lo");
  /* norms */
  tp_tensor NX = T2(xa, M, K), NY = T2(ya, M, K), NW = T1(wa, K), NB = T1(ba, K), MU = T1(mean, M), RS = T1(rstd, M);
  tp_tensor NDX = T2(ga, M, K), NDY = T2(ga + 1024, M, K), NDW = T1(wa + 1024, K), NDB = T1(ba + 1024, K);
  {
    const char *nm[] = {"y", "mean", "rstd", "x", "w", "b"};
    const tp_tensor *g[] = {&NY, &MU, &RS, &NX, &NW, &NB};
    int opt[] = {0, 1, 1, 0, 0, 1};
    kernel_case("layernorm_forward", 11, 6, nm, g, opt, __LINE__);
  }
  OK(tp_layernorm_forward(NULL, &NY, &MU, &RS, &NX, &NW, &NB, 1e-5f));
  {
    const char *nm[] = {"dx", "dw", "db", "dy", "x", "w", "mean", "rstd"};
    const tp_tensor *g[] = {&NDX, &NDW, &NDB, &NDY, &NX, &NW, &MU, &RS};
    int opt[] = {0, 0, 1, 0, 0, 0, 0, 0};
    kernel_case("layernorm_backward", 12, 8, nm, g, opt, __LINE__);
  }
  {
    const char *nm[] = {"y", "rstd", "x", "w"};
    const tp_tensor *g[] = {&NY, &RS, &NX, &NW};
    int opt[] = {0, 1, 0, 0};
    kernel_case("rmsnorm_forward", 13, 4, nm, g, opt, __LINE__);
  }
  OK(tp_rmsnorm_forward(NULL, &NY, &RS, &NX, &NW, 1e-5f));
  {
    const char *nm[] = {"dx", "dw", "dy", "x", "w", "rstd"};
    const tp_tensor *g[] = {&NDX, &NDW, &NDY, &NX, &NW, &RS};
    int opt[] = {0, 0, 0, 0, 0, 0};
    kernel_case("rmsnorm_backward", 14, 6, nm, g, opt, __LINE__);
  }
  /* rope: x [rows, heads * D] with 1 head of D = 4 */
  {
    static int64_t pos[M] = {0, 1, 2};
    tp_tensor RX = T2(xa, M, 4), RP = I1(pos, M);
    const char *nm[] = {"x", "pos"};
    const tp_tensor *g[] = {&RX, &RP};
    int opt[] = {0, 0};
    kernel_case("rope_apply", 15, 2, nm, g, opt, __LINE__);
    ARG(tp_rope_apply(NULL, &RX, &RP, -1, 4, 1e4f, 0), "rope_apply", "heads");
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, 3, 1e4f, 0), "rope_apply", "D");
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, -4, 1e4f, 0), "rope_apply", "D");
    ARG(tp_rope_apply(NULL, &RX, &RP, INT64_MAX, 4, 1e4f, 0), "rope_apply", NULL);
    ARG(tp_rope_apply(NULL, &RX, &RP, (int64_t)1 << 62, (int64_t)1 << 62, 1e4f, 0), "rope_apply", NULL);
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, 4, 0.0f, 0), "rope_apply", "theta");
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, 4, -1.0f, 0), "rope_apply", "theta");
  }
  /* optimizers */
  {
    tp_tensor p = T2(xa, M, K), g = T2(ga, M, K), m = T2(ya, M, K), v = T2(ba, M, K);
    memset(ba, 0, sizeof(float) * M * K);
    const char *nm[] = {"p", "g", "m", "v"};
    const tp_tensor *gd[] = {&p, &g, &m, &v};
    int opt[] = {0, 0, 0, 0};
    kernel_case("adamw_step", 16, 4, nm, gd, opt, __LINE__);
    ARG(tp_adamw_step(NULL, &p, &g, &m, &v, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 0), "adamw_step", "step");
    ARG(tp_adamw_step(NULL, &p, &g, &m, &v, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, INT64_MIN), "adamw_step", "step");
    const char *nm2[] = {"p", "g", "buf"};
    const tp_tensor *gd2[] = {&p, &g, &m};
    int opt2[] = {0, 0, 1};
    kernel_case("sgd_step", 17, 3, nm2, gd2, opt2, __LINE__);
  }
  /* zero-size calls succeed and touch nothing (NULL data) */
  {
    tp_tensor z0 = T2(NULL, 0, K), zy = T2(NULL, 0, N), zk = T2(NULL, M, 0), zw = T2(NULL, N, 0);
    OK(tp_linear_forward(NULL, &zy, &z0, &w, &b));
    memset(ya, 0, sizeof(float) * M * N);
    OK(tp_linear_forward(NULL, &y, &zk, &zw, NULL)); /* K = 0: y = 0 */
    OK(tp_linear_backward(NULL, &z0, &dw, &db, &zy, &z0, &w, 0));
    OK(tp_act_forward(NULL, P(T2(NULL, 0, N)), P(T2(NULL, 0, N)), TP_ACT_GELU));
    OK(tp_act_backward(NULL, P(T2(NULL, 0, N)), P(T2(NULL, 0, N)), P(T2(NULL, 0, N)), TP_ACT_SILU));
    OK(tp_bias_act_forward(NULL, P(T2(NULL, 0, N)), P(T2(NULL, 0, 2 * N)), P(T1(ba, 2 * N)), TP_ACT_SWIGLU));
    OK(tp_embedding_forward(NULL, P(T2(NULL, 0, N)), P(I1(NULL, 0)), &tab, 0));
    OK(tp_embedding_backward(NULL, &tab, P(I1(NULL, 0)), P(T2(NULL, 0, N)), 0));
    OK(tp_xent_row_max(NULL, P(T1(NULL, 0)), P(T2(NULL, 0, K))));
    OK(tp_xent_row_sums(NULL, P(T1(NULL, 0)), P(T2(NULL, 0, K)), P(T1(NULL, 0)), P(I1(NULL, 0)), 0));
    OK(tp_layernorm_forward(NULL, P(T2(NULL, 0, K)), NULL, NULL, P(T2(NULL, 0, K)), &NW, NULL, 1e-5f));
    OK(tp_rmsnorm_forward(NULL, P(T2(NULL, 0, K)), NULL, P(T2(NULL, 0, K)), &NW, 1e-5f));
    OK(tp_rope_apply(NULL, P(T2(NULL, 0, 4)), P(I1(NULL, 0)), 1, 4, 1e4f, 0));
    OK(tp_adamw_step(NULL, P(T1(NULL, 0)), P(T1(NULL, 0)), P(T1(NULL, 0)), P(T1(NULL, 0)), 1e-3f, 0.9f, 0.999f,
                     1e-8f, 0.0f, 1));
    OK(tp_sgd_step(NULL, P(T1(NULL, 0)), P(T1(NULL, 0)), NULL, 0.1f, 0.0f, 0.0f, 1));
  }
  /* shapes past BLAS's int and 2^40: refused before any data is read */
  ARG(tp_linear_forward(NULL, P(T2(ya, (int64_t)1 << 31, 1)), P(T2(xa, (int64_t)1 << 31, 1)), P(T2(wa, 1, 1)), NULL),
      "linear_forward", "M");
  ARG(tp_linear_forward(NULL, P(T2(ya, 1, 1)), P(T2(xa, 1, (int64_t)1 << 31)), P(T2(wa, 1, (int64_t)1 << 31)), NULL),
      "linear_forward", "K");
  ARG(tp_linear_forward(NULL, P(T2(ya, 1, 3)), P(T2(xa, 1, 5)), P(T2(wa, 3, 4)), NULL), "linear_forward", "w");
  ARG(tp_linear_forward(NULL, P(T2(ya, 2, 3)), P(T2(xa, 1, 5)), P(T2(wa, 3, 5)), NULL), "linear_forward", "y");
  ARG(tp_linear_forward(NULL, &y, &x, &w, P(T1(ba, N + 1))), "linear_forward", "b");
  /* mixed devices within one call */
  BAD(tp_linear_forward(NULL, P(with_dev(y, TP_DEVICE_CUDA, 0)), P(with_dev(x, TP_DEVICE_CUDA, 0)),
                        P(with_dev(w, TP_DEVICE_CUDA, 0)), NULL), ANY_ERR, "linear_forward", "cuda");
  BAD(tp_linear_forward(NULL, &y, &x, &w, P(with_dev(b, TP_DEVICE_CUDA, 1))), ANY_ERR, "linear_forward", "b");
  /* attention */
  {
    static float q[2 * 3 * 8], kk[2 * 3 * 8], vv[2 * 3 * 8], o[2 * 3 * 8], pr[2 * 2 * 3 * 3];
    tp_attention_args a;
    memset(&a, 0, sizeof a);
    a.B = 2, a.Tq = 3, a.Tk = 3, a.Hq = 2, a.Hk = 1, a.D = 4;
    a.q = q, a.q_ld = 8, a.k = kk, a.v = vv, a.kv_ld = 4, a.kv_bstride = 12, a.o = o, a.o_ld = 8;
    a.causal = 1, a.scale = 0.5f, a.probs = pr;
    size_t need = 0;
    OK(tp_attention_workspace_size(&a, 0, &need));
    static float aws[1 << 16];
    TRUE(need <= sizeof aws);
    tp_tensor W = T1(aws, (int64_t)(sizeof aws / sizeof(float)));
    OK(tp_attention_forward(NULL, &a, need ? &W : NULL));
    static float dq[48], dk[24], dv[24], dout[48];
    size_t needb = 0;
    OK(tp_attention_workspace_size(&a, 1, &needb));
    OK(tp_attention_backward(NULL, &a, dq, dk, dv, dout, needb ? &W : NULL));
    ARG(tp_attention_forward(NULL, NULL, &W), "attention_forward", "args");
    ARG(tp_attention_workspace_size(&a, 0, NULL), "attention_workspace_size", "nbytes");
    ARG(tp_attention_workspace_size(NULL, 0, &need), "attention_workspace_size", "args");
    tp_attention_args b2;
#define ATT(field, val, sub)                                                  \
  do {                                                                        \
    b2 = a;                                                                   \
    b2.field = val;                                                           \
    ARG(tp_attention_forward(NULL, &b2, &W), "attention_forward", sub);       \
    ARG(tp_attention_backward(NULL, &b2, dq, dk, dv, dout, &W), "attention_backward", sub); \
    ARG(tp_attention_workspace_size(&b2, 0, &need), "attention_workspace_size", sub); \
  } while (0)
    ATT(B, -1, "B");
    ATT(Tq, -1, "Tq");
    ATT(Tk, INT64_MAX, "Tk");
    ATT(Hq, (int64_t)1 << 31, "Hq");
    ATT(Hk, 0, "Hk");
    ATT(D, -4, "D");
    ATT(Hq, 3, "Hq");
    ATT(q_ld, 1, "q_ld");
    ATT(kv_ld, INT64_MAX, "kv_ld");
    ATT(kv_bstride, -1, "kv_bstride");
    ATT(q, NULL, "q");
    ATT(k, NULL, "k");
    ATT(group, -1, "group");
    ATT(q_head0, INT64_MIN, "q_head0");
    ATT(device, (tp_device_t)5, "device");
    b2 = a;
    b2.B = INT_MAX, b2.Tq = INT_MAX, b2.Tk = INT_MAX;
    ARG(tp_attention_forward(NULL, &b2, &W), "attention_forward", NULL);
    b2 = a;
    b2.device = TP_DEVICE_CUDA;
    BAD(tp_attention_forward(NULL, &b2, &W), ANY_ERR, "attention_forward", "cuda");
    b2 = a;
    b2.probs = NULL;
    ARG(tp_attention_backward(NULL, &b2, dq, dk, dv, dout, &W), "attention_backward", "probs");
    ARG(tp_attention_backward(NULL, &a, NULL, dk, dv, dout, &W), "attention_backward", "dq");
    ARG(tp_attention_forward(NULL, &a, P(with_dev(W, TP_DEVICE_CUDA, 0))), "attention_forward", "workspace");
    ARG(tp_attention_forward(NULL, &a, P(with_ndim(W, 9))), "attention_forward", "workspace");
    if (need) ARG(tp_attention_forward(NULL, &a, P(T1(aws, 1))), "attention_forward", "workspace");
    /* zero-size */
    b2 = a;
    b2.B = 0, b2.q = NULL, b2.k = NULL, b2.v = NULL, b2.o = NULL, b2.probs = NULL;
    OK(tp_attention_forward(NULL, &b2, NULL));
  }
}


/* ------------------------------------------------------------------ devices */

static void test_devices(void) {
  void *p = NULL;
  char buf[256], dst[256];
  memset(buf, 7, sizeof buf);
  TRUE(tp_device_available(TP_DEVICE_CPU));
  TRUE(!tp_device_available(TP_DEVICE_CUDA));
  TRUE(!tp_device_available((tp_device_t)-1));
  TRUE(!tp_device_available((tp_device_t)99));
  TRUE(tp_device_ops_of((tp_device_t)99) == NULL && tp_device_ops_of((tp_device_t)-7) == NULL);
  TRUE(strcmp(tp_device_name((tp_device_t)42), "invalid") == 0);
  ARG(tp_device_alloc(TP_DEVICE_CPU, 0, 16, NULL), "device_alloc", "ptr");
  BAD(tp_device_alloc(TP_DEVICE_CUDA, 0, 16, &p), TP_ERR_UNSUPPORTED, "device_alloc", "cuda");
  TRUE(p == NULL);
  ARG(tp_device_alloc((tp_device_t)5, 0, 16, &p), "device_alloc", "device");
  ARG(tp_device_alloc((tp_device_t)-1, 0, 16, &p), "device_alloc", "device");
  BAD(tp_device_alloc(TP_DEVICE_CPU, 0, SIZE_MAX, &p), ANY_ERR, "cpu", "bytes");
  TRUE(p == NULL);
  BAD(tp_device_alloc(TP_DEVICE_CPU, 0, SIZE_MAX - 100, &p), ANY_ERR, "cpu", "bytes");
  BAD(tp_device_alloc(TP_DEVICE_CPU, 0, (size_t)1 << 62, &p), ANY_ERR, "cpu", "bytes");
  TRUE(p == NULL);
  OK(tp_device_alloc(TP_DEVICE_CPU, 0, 0, &p)); /* zero bytes: a valid pointer to free */
  TRUE(p != NULL);
  tp_device_free(TP_DEVICE_CPU, 0, p);
  tp_device_free(TP_DEVICE_CPU, 0, NULL);
  tp_device_free(TP_DEVICE_CUDA, 0, buf); /* no such table: ignored, not freed */
  tp_device_free((tp_device_t)77, 0, buf);
  OK(tp_device_alloc(TP_DEVICE_CPU, 0, 100, &p));
  tp_device_free(TP_DEVICE_CPU, 0, p);
  /* copies */
  OK(tp_device_copy(TP_DEVICE_CPU, NULL, TP_DEVICE_CPU, NULL, 0, NULL));
  ARG(tp_device_copy(TP_DEVICE_CPU, NULL, TP_DEVICE_CPU, buf, 8, NULL), "device_copy", "NULL");
  ARG(tp_device_copy(TP_DEVICE_CPU, dst, TP_DEVICE_CPU, NULL, 8, NULL), "device_copy", "NULL");
  BAD(tp_device_copy(TP_DEVICE_CUDA, dst, TP_DEVICE_CPU, buf, 8, NULL), TP_ERR_UNSUPPORTED, "device_copy", "cuda");
  BAD(tp_device_copy(TP_DEVICE_CPU, dst, TP_DEVICE_CUDA, buf, 8, NULL), TP_ERR_UNSUPPORTED, "device_copy", "cuda");
  ARG(tp_device_copy((tp_device_t)9, dst, TP_DEVICE_CPU, buf, 8, NULL), "device_copy", "device");
  ARG(tp_device_copy(TP_DEVICE_CPU, dst, (tp_device_t)-2, buf, 8, NULL), "device_copy", "device");
  ARG(tp_device_copy(TP_DEVICE_CUDA, dst, (tp_device_t)9, buf, 8, NULL), "device_copy", "device");
  ARG(tp_device_copy((tp_device_t)9, dst, TP_DEVICE_CUDA, buf, 8, NULL), "device_copy", "device");
  OK(tp_device_copy(TP_DEVICE_CPU, dst, TP_DEVICE_CPU, buf, 8, NULL));
  TRUE(dst[7] == 7);
  /* 2-D copies */
  OK(tp_device_copy_2d(TP_DEVICE_CPU, NULL, 0, TP_DEVICE_CPU, NULL, 0, 0, 5, NULL));
  OK(tp_device_copy_2d(TP_DEVICE_CPU, NULL, 0, TP_DEVICE_CPU, NULL, 0, 4, 0, NULL));
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, dst, 4, TP_DEVICE_CPU, buf, 8, 8, 2, NULL), "device_copy_2d", "pitch");
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, dst, 8, TP_DEVICE_CPU, buf, 3, 8, 2, NULL), "device_copy_2d", "pitch");
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, NULL, 8, TP_DEVICE_CPU, buf, 8, 8, 2, NULL), "device_copy_2d", "NULL");
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, dst, 8, TP_DEVICE_CPU, NULL, 8, 8, 2, NULL), "device_copy_2d", "NULL");
  /* (rows - 1) * pitch + width past SIZE_MAX: refused before any byte moves */
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, dst, SIZE_MAX / 2, TP_DEVICE_CPU, buf, 8, 8, 3, NULL), "device_copy_2d",
      "overflow");
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, dst, 8, TP_DEVICE_CPU, buf, SIZE_MAX / 2, 8, 3, NULL), "device_copy_2d",
      "overflow");
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, dst, 16, TP_DEVICE_CPU, buf, 16, 16, SIZE_MAX / 8, NULL), "device_copy_2d",
      "overflow");
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, dst, SIZE_MAX, TP_DEVICE_CPU, buf, SIZE_MAX, SIZE_MAX, 2, NULL),
      "device_copy_2d", "overflow");
  BAD(tp_device_copy_2d(TP_DEVICE_CUDA, dst, 8, TP_DEVICE_CPU, buf, 8, 8, 2, NULL), TP_ERR_UNSUPPORTED,
      "device_copy_2d", "cuda");
  ARG(tp_device_copy_2d((tp_device_t)3, dst, 8, TP_DEVICE_CPU, buf, 8, 8, 2, NULL), "device_copy_2d", "device");
  memset(dst, 0, sizeof dst);
  OK(tp_device_copy_2d(TP_DEVICE_CPU, dst, 16, TP_DEVICE_CPU, buf, 8, 4, 3, NULL));
  TRUE(dst[0] == 7 && dst[3] == 7 && dst[4] == 0 && dst[32 + 3] == 7 && dst[36] == 0);
  /* memset / sync */
  OK(tp_device_memset(TP_DEVICE_CPU, NULL, 0, 0, NULL));
  ARG(tp_device_memset(TP_DEVICE_CPU, NULL, 0, 8, NULL), "device_memset", "NULL");
  BAD(tp_device_memset(TP_DEVICE_CUDA, dst, 0, 8, NULL), TP_ERR_UNSUPPORTED, "device_memset", "cuda");
  ARG(tp_device_memset((tp_device_t)4, dst, 0, 8, NULL), "device_memset", "device");
  OK(tp_device_sync(TP_DEVICE_CPU, 0, NULL));
  BAD(tp_device_sync(TP_DEVICE_CUDA, 0, NULL), TP_ERR_UNSUPPORTED, "device_sync", "cuda");
  ARG(tp_device_sync((tp_device_t)-3, 0, NULL), "device_sync", "device");
  tp_device_t d = (tp_device_t)9;
  int id = 9;
  tp_pointer_device(NULL, &d, &id);
  TRUE(d == TP_DEVICE_CPU && id == 0);
  tp_pointer_device(buf, NULL, NULL);
  /* tensor helpers on hostile views */
  tp_tensor t = T2(buf, 2, 3);
  TRUE(tp_tensor_numel(P(with_ndim(t, 9))) == -1);
  TRUE(tp_tensor_numel(P(with_ndim(t, -1))) == -1);
  TRUE(tp_tensor_numel(P(with_shape(t, 0, -2))) == -1);
  TRUE(tp_tensor_numel(P(with_shape(with_shape(t, 0, INT64_MAX), 1, 2))) == -1);
  TRUE(tp_tensor_numel(P(with_ndim(t, 0))) == 1);
  TRUE(!tp_tensor_is_contiguous(P(with_ndim(t, 9))));
  TRUE(!tp_tensor_is_contiguous(P(with_ndim(t, INT_MAX))));
  TRUE(!tp_tensor_is_contiguous(P(with_stride(t, 1, 0))));
}

/* ---------------------------------------------------------------- partition */

static void test_partition(void) {
  int64_t sizes[8], offs[9], parts[4], po[5];
  OK(tp_partition(0, 3, NULL, 1, sizes, offs));
  TRUE(sizes[0] == 0 && offs[3] == 0);
  OK(tp_partition(10, 3, NULL, 1, NULL, NULL));
  ARG(tp_partition(-1, 2, NULL, 1, sizes, offs), "partition", "n");
  ARG(tp_partition(INT64_MIN, 2, NULL, 1, sizes, offs), "partition", "n");
  ARG(tp_partition(10, 0, NULL, 1, sizes, offs), "partition", "world");
  ARG(tp_partition(10, -5, NULL, 1, sizes, offs), "partition", "world");
  ARG(tp_partition(10, INT_MIN, NULL, 1, sizes, offs), "partition", "world");
  ARG(tp_partition(10, 2, NULL, 0, sizes, offs), "partition", "align");
  ARG(tp_partition(10, 2, NULL, -2, sizes, offs), "partition", "align");
  ARG(tp_partition(10, 2, NULL, INT64_MIN, sizes, offs), "partition", "align");
  ARG(tp_partition(10, 2, NULL, 3, sizes, offs), "partition", "align");
  OK(tp_partition(INT64_MAX, 3, NULL, 1, sizes, offs));
  TRUE(offs[3] == INT64_MAX && sizes[0] + sizes[1] + sizes[2] == INT64_MAX);
  OK(tp_partition(INT64_MAX, 1, NULL, INT64_MAX, sizes, offs));
  double wbad[3][3] = {{1, -1, 1}, {0, 0, 0}, {1, 1e308, 1e308}};
  double wnan[2] = {1, 0.0 / 0.0};
  for (int i = 0; i < 3; i++) ARG(tp_partition(12, 3, wbad[i], 1, sizes, offs), "partition", "weights");
  ARG(tp_partition(12, 2, wnan, 1, sizes, offs), "partition", "weights");
  /* weighted splits are computed in double: past 2^53 units refused (it wrote garbage sizes, and its
   * double -> int64 conversions overflowed, before) */
  double w3[3] = {1, 2, 3};
  ARG(tp_partition(INT64_MAX, 3, w3, 1, sizes, offs), "partition", "units");
  ARG(tp_partition(((int64_t)1 << 53) + 2, 3, w3, 1, sizes, offs), "partition", "units");
  OK(tp_partition((int64_t)1 << 53, 3, w3, 1, sizes, offs));
  TRUE(offs[3] == (int64_t)1 << 53 && sizes[0] >= 0 && sizes[1] >= 0 && sizes[2] >= 0 &&
       sizes[0] + sizes[1] + sizes[2] == (int64_t)1 << 53);
  double wtiny[3] = {1e-300, 1e-300, 1e300}, wbig[2] = {1e308, 1e-300};
  OK(tp_partition(12, 3, wtiny, 1, sizes, offs));
  TRUE(offs[3] == 12 && sizes[0] == 0 && sizes[1] == 0 && sizes[2] == 12);
  ARG(tp_partition((int64_t)1 << 50, 3, wtiny, 1, sizes, offs), "partition", "weights"); /* Python: floor(inf) raises */
  ARG(tp_partition((int64_t)1 << 50, 2, wbig, 1, sizes, offs), "partition", "weights"); /* units x w overflows */
  /* tp_partition_sizes */
  const int64_t neg[2] = {5, -1}, big[2] = {INT64_MAX, 1}, wrong[2] = {3, 3}, huge2[2] = {INT64_MAX, INT64_MAX};
  ARG(tp_partition_sizes(5, 2, neg, parts, po, "linear: partition", "out_features"), "linear: partition", "[1]");
  ARG(tp_partition_sizes(5, 2, big, parts, po, "linear: partition", "out_features"), "linear: partition", "2^63");
  ARG(tp_partition_sizes(5, 2, huge2, parts, po, "linear: partition", "out_features"), "linear: partition", "2^63");
  ARG(tp_partition_sizes(5, 2, wrong, parts, po, "linear: partition", "out_features"), "linear: partition",
      "out_features");
  ARG(tp_partition_sizes(-1, 2, NULL, parts, po, "linear: partition", "out_features"), "linear: partition", "dim");
  ARG(tp_partition_sizes(5, 0, NULL, parts, po, "linear: partition", "out_features"), "linear: partition", "world");
  ARG(tp_partition_sizes(5, -1, wrong, parts, po, "linear: partition", "out_features"), "linear: partition", "world");
  BAD(tp_partition_sizes(5, 2, wrong, parts, po, NULL, NULL), TP_ERR_INVALID_ARGUMENT, NULL, NULL);
  OK(tp_partition_sizes(0, 4, NULL, parts, po, "x", "y"));
  TRUE(po[4] == 0);
  OK(tp_partition_sizes(INT64_MAX, 2, NULL, NULL, NULL, "x", "y"));
}

/* ------------------------------------------------------------- collectives */

static void test_collectives(tp_comm_t comm) {
  float s[8] = {1, 2, 3, 4, 5, 6, 7, 8}, r[8];
  size_t counts[1] = {4}, bigc[1] = {SIZE_MAX};
  tp_stream_t fs = fake_stream();
  unsigned mask = 0;
  OK(tp_comm_devices(comm, &mask));
  TRUE(mask == (1u << TP_DEVICE_CPU));
  ARG(tp_comm_devices(comm, NULL), "devices", "NULL");
  BAD(tp_comm_devices(NULL, &mask), ANY_ERR, "devices", "comm");
  /* a stream on a host backend: an argument error naming the call and the stream */
  ARG(tp_all_reduce(s, r, 4, TP_FLOAT32, TP_SUM, comm, fs), "all_reduce", "stream");
  ARG(tp_all_gather(s, r, 4, TP_FLOAT32, comm, fs), "all_gather", "stream");
  ARG(tp_all_gather_v(s, r, counts, TP_FLOAT32, comm, fs), "all_gather", "stream");
  ARG(tp_reduce_scatter(s, r, 4, TP_FLOAT32, TP_SUM, comm, fs), "reduce_scatter", "stream");
  ARG(tp_reduce_scatter_v(s, r, counts, TP_FLOAT32, TP_SUM, comm, fs), "reduce_scatter", "stream");
  ARG(tp_broadcast(s, r, 4, TP_FLOAT32, 0, comm, fs), "broadcast", "stream");
  ARG(tp_reduce(s, r, 4, TP_FLOAT32, TP_SUM, 0, comm, fs), "reduce", "stream");
  ARG(tp_barrier(comm, fs), "barrier", "stream");
  ARG(tp_send(s, 4, TP_FLOAT32, 0, comm, fs), "send", NULL); /* world 1: peer 0 is this rank (refused first) */
  ARG(tp_recv(r, 4, TP_FLOAT32, 0, comm, fs), "recv", NULL);
  ARG(tp_sendrecv(s, 4, 0, r, 4, 0, TP_FLOAT32, comm, fs), "sendrecv", "stream");
  /* the communicator still works after those */
  OK(tp_all_reduce(s, r, 4, TP_FLOAT32, TP_SUM, comm, NULL));
  TRUE(r[3] == 4);
  /* zero counts succeed with NULL buffers */
  OK(tp_all_reduce(NULL, NULL, 0, TP_FLOAT32, TP_SUM, comm, NULL));
  OK(tp_all_gather(NULL, NULL, 0, TP_FLOAT32, comm, NULL));
  OK(tp_broadcast(NULL, NULL, 0, TP_FLOAT32, 0, comm, NULL));
  /* NULL buffers, bad dtype/op/root, counts past the address space */
  ARG(tp_all_reduce(NULL, r, 4, TP_FLOAT32, TP_SUM, comm, NULL), "all_reduce", "send");
  ARG(tp_all_reduce(s, NULL, 4, TP_FLOAT32, TP_SUM, comm, NULL), "all_reduce", "recv");
  ARG(tp_all_reduce(s, r, 4, (tp_dtype_t)99, TP_SUM, comm, NULL), "all_reduce", "dtype");
  ARG(tp_all_reduce(s, r, 4, TP_FLOAT32, (tp_redop_t)-1, comm, NULL), "all_reduce", "op");
  ARG(tp_all_reduce(s, r, SIZE_MAX, TP_FLOAT32, TP_SUM, comm, NULL), "all_reduce", "count");
  ARG(tp_all_reduce(s, r, SIZE_MAX / 4 + 1, TP_FLOAT32, TP_SUM, comm, NULL), "all_reduce", "count");
  ARG(tp_all_gather(s, r, SIZE_MAX / 2, TP_FLOAT64, comm, NULL), "all_gather", "count");
  ARG(tp_all_gather_v(s, r, NULL, TP_FLOAT32, comm, NULL), "all_gather", "counts");
  ARG(tp_all_gather_v(s, r, bigc, TP_FLOAT32, comm, NULL), "all_gather", "count");
  ARG(tp_reduce_scatter_v(s, r, bigc, TP_FLOAT32, TP_SUM, comm, NULL), "reduce_scatter", "count");
  ARG(tp_reduce_scatter(s, r, SIZE_MAX, TP_FLOAT32, TP_SUM, comm, NULL), "reduce_scatter", "count");
  ARG(tp_broadcast(s, r, 4, TP_FLOAT32, 1, comm, NULL), "broadcast", "root");
  ARG(tp_broadcast(s, r, 4, TP_FLOAT32, -1, comm, NULL), "broadcast", "root");
  ARG(tp_reduce(s, r, 4, TP_FLOAT32, TP_SUM, INT_MAX, comm, NULL), "reduce", "root");
  ARG(tp_send(s, 4, TP_FLOAT32, 5, comm, NULL), "send", "peer");
  ARG(tp_recv(r, 4, TP_FLOAT32, -1, comm, NULL), "recv", "peer");
  ARG(tp_send(NULL, 4, TP_FLOAT32, 0, comm, NULL), "send", NULL);
  ARG(tp_send(s, SIZE_MAX, TP_FLOAT32, 0, comm, NULL), "send", NULL);
  ARG(tp_sendrecv(s, 4, 3, r, 4, 0, TP_FLOAT32, comm, NULL), "sendrecv", NULL);
  BAD(tp_all_reduce(s, r, 4, TP_FLOAT32, TP_SUM, NULL, NULL), ANY_ERR, "all_reduce", "comm");
  BAD(tp_barrier(NULL, NULL), ANY_ERR, "barrier", "comm");
  OK(tp_all_reduce(s, r, 4, TP_FLOAT32, TP_SUM, comm, NULL));
}

/* ------------------------------------------------------------------- layers */

typedef struct {
  void *layer;
  int kind; /* 0 linear fwd x, 1 linear fwd y, 2 linear bwd dy, 3 linear bwd dx, ... */
  const tp_tensor *a, *b;
} lctx;

static tp_status_t layer_call(const tp_tensor *t, void *ctx) {
  lctx *c = ctx;
  switch (c->kind) {
    case 0: return tp_parallel_linear_forward(c->layer, c->a, t, NULL);
    case 1: return tp_parallel_linear_forward(c->layer, t, c->a, NULL);
    case 2: return tp_parallel_linear_backward(c->layer, c->a, t, NULL);
    case 3: return tp_parallel_linear_backward(c->layer, t, c->a, NULL);
    case 4: return tp_parallel_mlp_forward(c->layer, c->a, t, NULL);
    case 5: return tp_parallel_mlp_forward(c->layer, t, c->a, NULL);
    case 6: return tp_parallel_mlp_backward(c->layer, c->a, t, NULL);
    case 7: return tp_parallel_mlp_backward(c->layer, t, c->a, NULL);
    case 8: return tp_vocab_embedding_forward(c->layer, c->a, t, NULL);
    case 9: return tp_vocab_embedding_forward(c->layer, t, c->a, NULL);
    case 10: return tp_vocab_embedding_backward(c->layer, t, NULL);
    case 11: return tp_vocab_xent_forward(c->layer, c->a, t, c->b, -1, -100, NULL, NULL, NULL);
    case 12: return tp_vocab_xent_forward(c->layer, c->a, c->b, t, -1, -100, NULL, NULL, NULL);
    case 13: return tp_vocab_xent_forward(c->layer, t, c->a, c->b, -1, -100, NULL, NULL, NULL);
    case 14: return tp_vocab_xent_backward(c->layer, t, c->a, 1.0f, NULL);
    case 15: return tp_vocab_xent_backward(c->layer, c->a, t, 1.0f, NULL);
  }
  return TP_ERR_INTERNAL;
}
static void layer_variants(const char *op, const char *arg, void *layer, int kind, tp_tensor good, const tp_tensor *a,
                           const tp_tensor *b, int line) {
  lctx c = {layer, kind, a, b};
  hostile_variants(op, arg, good, layer_call, &c, line);
}

static void test_linear(tp_comm_t comm, tp_parallel_kind_t kind) {
  const char *nm = kind == TP_COLUMN_PARALLEL ? "column" : "row";
  tp_linear_config_t cfg = TP_LINEAR_CONFIG_INITIALIZER;
  cfg.kind = kind, cfg.in_features = K, cfg.out_features = N;
  tp_parallel_linear_t L = NULL;
  /* hostile configs */
  ARG(tp_parallel_linear_create(NULL, comm, &cfg), "linear", "out");
  ARG(tp_parallel_linear_create(&L, comm, NULL), "linear", "config");
  BAD(tp_parallel_linear_create(&L, NULL, &cfg), ANY_ERR, "linear", "comm");
  tp_linear_config_t c2 = cfg;
  c2.size = 3;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "config");
  c2 = cfg, c2.device = TP_DEVICE_CUDA;
  BAD(tp_parallel_linear_create(&L, comm, &c2), TP_ERR_UNSUPPORTED, "linear", "cuda");
  c2 = cfg, c2.device = (tp_device_t)17;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "device");
  c2 = cfg, c2.device = (tp_device_t)-1;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "device");
  c2 = cfg, c2.device_id = 1;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "device_id");
  c2 = cfg, c2.device_id = -1;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "device_id");
  c2 = cfg, c2.kind = (tp_parallel_kind_t)7;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "kind");
  c2 = cfg, c2.in_features = -1;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "in_features");
  c2 = cfg, c2.out_features = INT64_MIN;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "out_features");
  for (int h = 0; h < 3; h++) {
    c2 = cfg, c2.in_features = HUGE_DIMS[h];
    ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "in_features");
    c2 = cfg, c2.out_features = HUGE_DIMS[h];
    ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "out_features");
  }
  c2 = cfg, c2.in_features = (int64_t)1 << 30, c2.out_features = (int64_t)1 << 30; /* 2^60 weights */
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", NULL);
  const int64_t badpart[1] = {99}, negpart[1] = {-1};
  c2 = cfg, c2.partition = badpart;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "partition");
  c2 = cfg, c2.partition = negpart;
  ARG(tp_parallel_linear_create(&L, comm, &c2), "linear", "partition");
  TRUE(L == NULL);
  /* zero-size layer: in = out = 0 */
  c2 = cfg, c2.in_features = 0, c2.out_features = 0;
  tp_parallel_linear_t Z = NULL;
  tp_status_t zs = tp_parallel_linear_create(&Z, comm, &c2);
  if (zs == TP_SUCCESS) {
    OK(tp_parallel_linear_forward(Z, P(T2(NULL, 3, 0)), P(T2(NULL, 3, 0)), NULL));
    OK(tp_parallel_linear_backward(Z, P(T2(NULL, 3, 0)), P(T2(NULL, 3, 0)), NULL));
    tp_parallel_linear_destroy(Z);
  } else {
    ARG(zs, "linear", "features");
  }
  OK(tp_parallel_linear_create(&L, comm, &cfg));
  if (!L) return;
  tp_linear_info_t info;
  OK(tp_parallel_linear_info(L, &info));
  ARG(tp_parallel_linear_info(L, NULL), "linear", "info");
  ARG(tp_parallel_linear_info(NULL, &info), "linear", "layer");
  tp_tensor x = T2(xa, M, K), y = T2(ya, M, N), dx = T2(ga, M, K), dy = T2(ya + 1024, M, N);
  /* backward before any forward */
  BAD(tp_parallel_linear_backward(L, &dx, &dy, NULL), ANY_ERR, "linear backward", "forward");
  /* forward on hostile tensors */
  layer_variants("linear forward", "x", L, 0, x, &y, NULL, __LINE__);
  layer_variants("linear forward", "y", L, 1, y, &x, NULL, __LINE__);
  ARG(tp_parallel_linear_forward(L, P(T2(ya, M + 1, N)), &x, NULL), "linear forward", "y");
  ARG(tp_parallel_linear_forward(L, &y, P(T2(xa, M, K + 1)), NULL), "linear forward", "x");
  ARG(tp_parallel_linear_forward(L, P(T2(ya, (int64_t)1 << 31, N)), P(T2(xa, (int64_t)1 << 31, K)), NULL),
      "linear forward", NULL);
  ARG(tp_parallel_linear_forward(NULL, &y, &x, NULL), "linear forward", "layer");
  /* a failed forward leaves no forward behind: backward after a refused first forward */
  BAD(tp_parallel_linear_backward(L, &dx, &dy, NULL), ANY_ERR, "linear backward", "forward");
  /* zero rows */
  OK(tp_parallel_linear_forward(L, P(T2(NULL, 0, N)), P(T2(NULL, 0, K)), NULL));
  OK(tp_parallel_linear_backward(L, P(T2(NULL, 0, K)), P(T2(NULL, 0, N)), NULL));
  /* growing then shrinking M: the arena reused */
  static const int64_t Ms[] = {1, 7, 33, 2, 64, 5, 1};
  for (size_t i = 0; i < sizeof Ms / sizeof Ms[0]; i++) {
    int64_t m = Ms[i];
    for (int64_t j = 0; j < m * K; j++) xa[j] = (float)((j % 7) - 3) * 0.1f;
    OK(tp_parallel_linear_forward(L, P(T2(ya, m, N)), P(T2(xa, m, K)), NULL));
    OK(tp_parallel_linear_backward(L, P(T2(ga, m, K)), P(T2(ya + 1024 * 2, m, N)), NULL));
    /* backward with a different M than the last forward */
    ARG(tp_parallel_linear_backward(L, P(T2(ga, m + 1, K)), P(T2(ya + 1024 * 2, m + 1, N)), NULL), "linear backward",
        NULL);
  }
  OK(tp_parallel_linear_forward(L, &y, &x, NULL));
  layer_variants("linear backward", "dy", L, 2, dy, &dx, NULL, __LINE__);
  layer_variants("linear backward", "dx", L, 3, dx, &dy, NULL, __LINE__);
  ARG(tp_parallel_linear_backward(NULL, &dx, &dy, NULL), "linear backward", "layer");
  tp_parallel_linear_destroy(L);
  tp_parallel_linear_destroy(NULL);
  printf("linear %s: done\n", nm);
}

static void test_mlp(tp_comm_t comm) {
  tp_mlp_config_t cfg = TP_MLP_CONFIG_INITIALIZER;
  cfg.hidden = K, cfg.ffn_hidden = 6;
  tp_parallel_mlp_t m = NULL;
  ARG(tp_parallel_mlp_create(NULL, comm, &cfg), "mlp", "out");
  ARG(tp_parallel_mlp_create(&m, comm, NULL), "mlp", "config");
  tp_mlp_config_t c2 = cfg;
  c2.size = 1;
  ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", "config");
  c2 = cfg, c2.device = TP_DEVICE_CUDA;
  BAD(tp_parallel_mlp_create(&m, comm, &c2), TP_ERR_UNSUPPORTED, "mlp", "cuda");
  c2 = cfg, c2.device = (tp_device_t)3;
  ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", "device");
  c2 = cfg, c2.device_id = 2;
  ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", "device_id");
  c2 = cfg, c2.activation = (tp_activation_t)42;
  ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", "activation");
  c2 = cfg, c2.hidden = -3;
  ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", "features");
  for (int h = 0; h < 3; h++) {
    c2 = cfg, c2.ffn_hidden = HUGE_DIMS[h];
    ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", NULL);
    c2 = cfg, c2.hidden = HUGE_DIMS[h];
    ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", NULL);
  }
  const int64_t badpart[1] = {7};
  c2 = cfg, c2.partition = badpart;
  ARG(tp_parallel_mlp_create(&m, comm, &c2), "mlp", "partition");
  TRUE(m == NULL);
  OK(tp_parallel_mlp_create(&m, comm, &cfg));
  if (!m) return;
  TRUE(tp_parallel_mlp_layer(m, 0) != NULL && tp_parallel_mlp_layer(m, 1) != NULL);
  TRUE(tp_parallel_mlp_layer(m, 2) == NULL && tp_parallel_mlp_layer(m, -1) == NULL);
  TRUE(tp_parallel_mlp_layer(NULL, 0) == NULL);
  tp_tensor x = T2(xa, M, K), y = T2(ya, M, K), dx = T2(ga, M, K), dy = T2(ya + 1024, M, K);
  BAD(tp_parallel_mlp_backward(m, &dx, &dy, NULL), ANY_ERR, "mlp backward", "forward");
  layer_variants("mlp forward", "x", m, 4, x, &y, NULL, __LINE__);
  layer_variants("mlp forward", "y", m, 5, y, &x, NULL, __LINE__);
  ARG(tp_parallel_mlp_forward(m, P(T2(ya, M, K)), P(T2(xa, M + 2, K)), NULL), "mlp forward", NULL);
  ARG(tp_parallel_mlp_forward(m, P(T2(ya, (int64_t)1 << 31, K)), P(T2(xa, (int64_t)1 << 31, K)), NULL),
      "mlp forward", NULL);
  ARG(tp_parallel_mlp_forward(NULL, &y, &x, NULL), "mlp forward", NULL);
  BAD(tp_parallel_mlp_backward(m, &dx, &dy, NULL), ANY_ERR, "mlp backward", "forward");
  OK(tp_parallel_mlp_forward(m, P(T2(NULL, 0, K)), P(T2(NULL, 0, K)), NULL));
  OK(tp_parallel_mlp_backward(m, P(T2(NULL, 0, K)), P(T2(NULL, 0, K)), NULL));
  static const int64_t Ms[] = {2, 40, 1, 64, 3};
  for (size_t i = 0; i < sizeof Ms / sizeof Ms[0]; i++) {
    int64_t mm = Ms[i];
    OK(tp_parallel_mlp_forward(m, P(T2(ya, mm, K)), P(T2(xa, mm, K)), NULL));
    OK(tp_parallel_mlp_backward(m, P(T2(ga, mm, K)), P(T2(ya + 1024 * 2, mm, K)), NULL));
    ARG(tp_parallel_mlp_backward(m, P(T2(ga, mm + 1, K)), P(T2(ya + 1024 * 2, mm + 1, K)), NULL), "mlp backward",
        NULL);
  }
  OK(tp_parallel_mlp_forward(m, &y, &x, NULL));
  layer_variants("mlp backward", "dy", m, 6, dy, &dx, NULL, __LINE__);
  layer_variants("mlp backward", "dx", m, 7, dx, &dy, NULL, __LINE__);
  tp_parallel_mlp_destroy(m);
  tp_parallel_mlp_destroy(NULL);
  printf("mlp: done\n");
}

static void test_vocab(tp_comm_t comm) {
  enum { V = 6, C = 4 };
  tp_embedding_config_t cfg = TP_EMBEDDING_CONFIG_INITIALIZER;
  cfg.num_embeddings = V, cfg.embedding_dim = C;
  tp_vocab_embedding_t e = NULL;
  ARG(tp_vocab_embedding_create(NULL, comm, &cfg), "embedding", "out");
  ARG(tp_vocab_embedding_create(&e, comm, NULL), "embedding", "config");
  tp_embedding_config_t c2 = cfg;
  c2.size = 0;
  ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", "config");
  c2 = cfg, c2.device = TP_DEVICE_CUDA;
  BAD(tp_vocab_embedding_create(&e, comm, &c2), TP_ERR_UNSUPPORTED, "embedding", "cuda");
  c2 = cfg, c2.device = (tp_device_t)100;
  ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", "device");
  c2 = cfg, c2.device_id = INT_MAX;
  ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", "device_id");
  c2 = cfg, c2.num_embeddings = -1;
  ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", "num_embeddings");
  c2 = cfg, c2.embedding_dim = -1;
  ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", "embedding_dim");
  for (int h = 1; h < 3; h++) { /* 2^31 rows of 4 would be a valid (32 GiB) table */
    c2 = cfg, c2.num_embeddings = HUGE_DIMS[h];
    ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", NULL);
    c2 = cfg, c2.embedding_dim = HUGE_DIMS[h];
    ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", NULL);
  }
  const int64_t badpart[1] = {V - 1};
  c2 = cfg, c2.partition = badpart;
  ARG(tp_vocab_embedding_create(&e, comm, &c2), "embedding", "partition");
  TRUE(e == NULL);
  OK(tp_vocab_embedding_create(&e, comm, &cfg));
  if (!e) return;
  tp_embedding_info_t info;
  ARG(tp_vocab_embedding_info(e, NULL), "embedding", "info");
  OK(tp_vocab_embedding_info(e, &info));
  for (int i = 0; i < M; i++) tok[i] = i;
  tp_tensor t = I1(tok, M), y = T2(ya, M, C), dy = T2(ga, M, C);
  BAD(tp_vocab_embedding_backward(e, &dy, NULL), ANY_ERR, "embedding backward", "forward");
  layer_variants("embedding forward", "tokens", e, 8, t, &y, NULL, __LINE__);
  layer_variants("embedding forward", "y", e, 9, y, &t, NULL, __LINE__);
  ARG(tp_vocab_embedding_forward(e, P(T2(ya, M + 1, C)), &t, NULL), "embedding forward", "y");
  /* token ids outside [0, V) */
  tok[1] = V;
  ARG(tp_vocab_embedding_forward(e, &y, &t, NULL), "embedding forward", "token");
  tok[1] = -1;
  ARG(tp_vocab_embedding_forward(e, &y, &t, NULL), "embedding forward", "token");
  tok[1] = INT64_MIN;
  ARG(tp_vocab_embedding_forward(e, &y, &t, NULL), "embedding forward", "token");
  tok[1] = INT64_MAX;
  ARG(tp_vocab_embedding_forward(e, &y, &t, NULL), "embedding forward", "token");
  tok[1] = 1;
  BAD(tp_vocab_embedding_backward(e, &dy, NULL), ANY_ERR, "embedding backward", "forward");
  OK(tp_vocab_embedding_forward(e, P(T2(NULL, 0, C)), P(I1(NULL, 0)), NULL));
  OK(tp_vocab_embedding_backward(e, P(T2(NULL, 0, C)), NULL));
  static const int64_t Ms[] = {1, 50, 2, 64, 3};
  for (size_t i = 0; i < sizeof Ms / sizeof Ms[0]; i++) {
    int64_t m = Ms[i];
    for (int64_t j = 0; j < m; j++) tok[j] = j % V;
    OK(tp_vocab_embedding_forward(e, P(T2(ya, m, C)), P(I1(tok, m)), NULL));
    OK(tp_vocab_embedding_backward(e, P(T2(ga, m, C)), NULL));
    ARG(tp_vocab_embedding_backward(e, P(T2(ga, m + 1, C)), NULL), "embedding backward", "dy");
  }
  for (int i = 0; i < M; i++) tok[i] = i;
  OK(tp_vocab_embedding_forward(e, &y, &t, NULL));
  lctx lc = {e, 10, NULL, NULL};
  hostile_variants("embedding backward", "dy", dy, layer_call, &lc, __LINE__);
  tp_vocab_embedding_destroy(e);
  tp_vocab_embedding_destroy(NULL);

  /* cross-entropy */
  tp_xent_config_t xc = TP_XENT_CONFIG_INITIALIZER;
  tp_vocab_xent_t x = NULL;
  ARG(tp_vocab_xent_create(NULL, comm, &xc), "cross-entropy", "out");
  tp_xent_config_t x2 = xc;
  x2.size = 2;
  ARG(tp_vocab_xent_create(&x, comm, &x2), "cross-entropy", "config");
  x2 = xc, x2.device = TP_DEVICE_CUDA;
  BAD(tp_vocab_xent_create(&x, comm, &x2), TP_ERR_UNSUPPORTED, "cross-entropy", "cuda");
  x2 = xc, x2.device = (tp_device_t)-9;
  ARG(tp_vocab_xent_create(&x, comm, &x2), "cross-entropy", "device");
  x2 = xc, x2.device_id = -2;
  ARG(tp_vocab_xent_create(&x, comm, &x2), "cross-entropy", "device_id");
  TRUE(x == NULL);
  OK(tp_vocab_xent_create(&x, comm, NULL));
  if (!x) return;
  static float logits[64 * V], losses[64], dl[64 * V], dloss[64];
  for (int i = 0; i < 64 * V; i++) logits[i] = (float)(i % 5) * 0.3f;
  for (int i = 0; i < M; i++) tok[i] = i, dloss[i] = 1.0f;
  tp_tensor lg = T2(logits, M, V), tg = I1(tok, M), ls = T1(losses, M), dlg = T2(dl, M, V), dls = T1(dloss, M);
  BAD(tp_vocab_xent_backward(x, &dlg, &dls, 1.0f, NULL), ANY_ERR, "cross-entropy backward", "forward");
  layer_variants("cross-entropy forward", "logits", x, 11, lg, &ls, &tg, __LINE__);
  ARG(tp_vocab_xent_forward(x, &ls, P(T2(logits, -1, V)), &tg, -1, -100, NULL, NULL, NULL), "cross-entropy forward",
      "logits");
  ARG(tp_vocab_xent_forward(x, &ls, P(T2(logits, M, INT64_MAX)), &tg, -1, -100, NULL, NULL, NULL),
      "cross-entropy forward", "logits");
  layer_variants("cross-entropy forward", "targets", x, 12, tg, &ls, &lg, __LINE__);
  layer_variants("cross-entropy forward", "losses", x, 13, ls, &lg, &tg, __LINE__);
  ARG(tp_vocab_xent_forward(x, &ls, &lg, P(I1(tok, M + 1)), -1, -100, NULL, NULL, NULL), "cross-entropy forward",
      "targets");
  tok[2] = V; /* past the vocabulary */
  ARG(tp_vocab_xent_forward(x, &ls, &lg, &tg, -1, -100, NULL, NULL, NULL), "cross-entropy", "target");
  tok[2] = INT64_MIN;
  ARG(tp_vocab_xent_forward(x, &ls, &lg, &tg, -1, -100, NULL, NULL, NULL), "cross-entropy", "target");
  tok[2] = 2;
  ARG(tp_vocab_xent_forward(x, &ls, &lg, &tg, INT64_MAX, -100, NULL, NULL, NULL), "cross-entropy forward",
      "vocab_offset");
  BAD(tp_vocab_xent_backward(x, &dlg, &dls, 1.0f, NULL), ANY_ERR, "cross-entropy backward", "forward");
  int64_t valid = -1, vocab = -1;
  OK(tp_vocab_xent_forward(x, P(T1(NULL, 0)), P(T2(NULL, 0, V)), P(I1(NULL, 0)), -1, -100, &valid, &vocab, NULL));
  TRUE(valid == 0);
  OK(tp_vocab_xent_backward(x, P(T2(NULL, 0, V)), NULL, 1.0f, NULL));
  static const int64_t Mx[] = {1, 60, 2, 64, 3};
  for (size_t i = 0; i < sizeof Mx / sizeof Mx[0]; i++) {
    int64_t m = Mx[i];
    for (int64_t j = 0; j < m; j++) tok[j] = j % V, dloss[j] = 1.0f;
    OK(tp_vocab_xent_forward(x, P(T1(losses, m)), P(T2(logits, m, V)), P(I1(tok, m)), -1, -100, &valid, &vocab,
                             NULL));
    TRUE(valid == m && vocab == V);
    OK(tp_vocab_xent_backward(x, P(T2(dl, m, V)), P(T1(dloss, m)), 1.0f, NULL));
    ARG(tp_vocab_xent_backward(x, P(T2(dl, m + 1, V)), NULL, 1.0f, NULL), "cross-entropy backward", "dlogits");
  }
  for (int i = 0; i < M; i++) tok[i] = i;
  OK(tp_vocab_xent_forward(x, &ls, &lg, &tg, -1, -100, NULL, NULL, NULL));
  layer_variants("cross-entropy backward", "dlogits", x, 14, dlg, &dls, NULL, __LINE__);
  {
    /* dloss: optional (NULL = all ones), the rest hostile */
    lctx c = {x, 15, &dlg, NULL};
    OK(tp_vocab_xent_backward(x, &dlg, NULL, 1.0f, NULL));
    tp_tensor bad[] = {with_data(dls, NULL), with_dtype(dls, TP_FLOAT64), with_ndim(dls, 9), with_ndim(dls, 2),
                       with_shape(dls, 0, -1), with_shape(dls, 0, INT64_MAX), with_stride(dls, 0, 0),
                       with_dev(dls, TP_DEVICE_CUDA, 0), with_dev(dls, (tp_device_t)11, 0)};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
      BAD(layer_call(&bad[i], &c), ANY_ERR, "cross-entropy backward", "dloss");
  }
  tp_vocab_xent_destroy(x);
  tp_vocab_xent_destroy(NULL);
  printf("vocab: done\n");
}

static void test_block(tp_comm_t comm) {
  enum { C = 8, HEADS = 2, D = 4, FF = 12 };
  tp_block_config_t cfg = TP_BLOCK_CONFIG_INITIALIZER;
  cfg.hidden = C, cfg.heads = HEADS, cfg.kv_heads = HEADS, cfg.head_dim = D, cfg.ffn_hidden = FF;
  tp_block_t b = NULL;
  ARG(tp_block_create(NULL, comm, &cfg), "block", "out");
  ARG(tp_block_create(&b, comm, NULL), "block", "config");
  tp_block_config_t c2 = cfg;
  c2.size = 8;
  ARG(tp_block_create(&b, comm, &c2), "block", "config");
  c2 = cfg, c2.device = TP_DEVICE_CUDA;
  BAD(tp_block_create(&b, comm, &c2), TP_ERR_UNSUPPORTED, "block", "cuda");
  c2 = cfg, c2.device = (tp_device_t)2;
  ARG(tp_block_create(&b, comm, &c2), "block", "device");
  c2 = cfg, c2.device_id = 5;
  ARG(tp_block_create(&b, comm, &c2), "block", "device_id");
  c2 = cfg, c2.heads = 3;
  ARG(tp_block_create(&b, comm, &c2), "block", "heads");
  c2 = cfg, c2.kv_heads = -1;
  ARG(tp_block_create(&b, comm, &c2), "block", "heads");
  c2 = cfg, c2.head_dim = -4;
  ARG(tp_block_create(&b, comm, &c2), "block", "head_dim");
  c2 = cfg, c2.norm = (tp_norm_t)9;
  ARG(tp_block_create(&b, comm, &c2), "block", "norm");
  c2 = cfg, c2.activation = (tp_activation_t)-1;
  ARG(tp_block_create(&b, comm, &c2), "block", "activation");
  c2 = cfg, c2.rope_theta = 1e4f, c2.head_dim = 3;
  ARG(tp_block_create(&b, comm, &c2), "block", "head_dim");
  for (int h = 0; h < 3; h++) {
    c2 = cfg, c2.hidden = HUGE_DIMS[h];
    ARG(tp_block_create(&b, comm, &c2), "block", NULL);
    c2 = cfg, c2.head_dim = HUGE_DIMS[h];
    ARG(tp_block_create(&b, comm, &c2), "block", NULL);
    c2 = cfg, c2.heads = HUGE_DIMS[h], c2.kv_heads = HUGE_DIMS[h];
    ARG(tp_block_create(&b, comm, &c2), "block", NULL);
    c2 = cfg, c2.ffn_hidden = HUGE_DIMS[h];
    ARG(tp_block_create(&b, comm, &c2), "block", NULL);
  }
  const int64_t badheads[1] = {HEADS + 1}, badffn[1] = {-FF};
  c2 = cfg, c2.head_partition = badheads;
  ARG(tp_block_create(&b, comm, &c2), "block", "head_partition");
  c2 = cfg, c2.ffn_partition = badffn;
  ARG(tp_block_create(&b, comm, &c2), "block", "partition");
  TRUE(b == NULL);
  cfg.rope_theta = 1e4f;
  OK(tp_block_create(&b, comm, &cfg));
  if (!b) return;
  tp_block_info_t info;
  ARG(tp_block_info(b, NULL), "block", "info");
  OK(tp_block_info(b, &info));
  tp_param_t prm[32];
  int np = tp_block_params(b, prm, 32);
  TRUE(np > 0 && np <= 32);
  TRUE(tp_block_params(b, NULL, 0) == np);
  TRUE(tp_block_params(b, prm, -1) == np);
  TRUE(tp_block_params(NULL, prm, 32) <= 0);
  tp_block_batch_t bt = {1, M, NULL, NULL, 0, 1};
  tp_tensor x = T2(xa, M, C), y = T2(ya, M, C), dx = T2(ga, M, C), dy = T2(ya + 1024, M, C);
  for (int i = 0; i < 64 * 64; i++) xa[i] = (float)((i % 9) - 4) * 0.1f, ya[i] = (float)((i % 5) - 2) * 0.1f;
  BAD(tp_block_backward(b, &dx, &dy, NULL), ANY_ERR, "block backward", "forward");
  /* hostile batches */
  ARG(tp_block_forward(b, &y, &x, NULL, NULL), "block forward", "batch");
  tp_block_batch_t b2 = bt;
  b2.B = -1;
  ARG(tp_block_forward(b, &y, &x, &b2, NULL), "block forward", NULL);
  b2 = bt, b2.B = 3, b2.T = 2; /* B * T != rows */
  ARG(tp_block_forward(b, &y, &x, &b2, NULL), "block forward", NULL);
  b2 = bt, b2.B = INT64_MAX, b2.T = INT64_MAX;
  ARG(tp_block_forward(b, &y, &x, &b2, NULL), "block forward", NULL);
  b2 = bt, b2.use_cache = 1; /* no cache allocated yet */
  BAD(tp_block_forward(b, &y, &x, &b2, NULL), ANY_ERR, "block forward", "cache");
  int64_t pos0[1] = {-1};
  b2 = bt, b2.pos0 = pos0;
  ARG(tp_block_forward(b, &y, &x, &b2, NULL), "block forward", "pos0");
  pos0[0] = INT64_MAX;
  ARG(tp_block_forward(b, &y, &x, &b2, NULL), "block forward", "pos0");
  ARG(tp_block_forward(NULL, &y, &x, &bt, NULL), "block forward", NULL);
  /* hostile tensors */
  {
    struct {
      const char *arg;
      tp_tensor good;
      int which;
    } v[] = {{"x", x, 0}, {"y", y, 1}};
    for (int i = 0; i < 2; i++) {
      tp_tensor t[] = {with_data(v[i].good, NULL), with_dtype(v[i].good, TP_FLOAT16), with_ndim(v[i].good, 9),
                       with_ndim(v[i].good, 0), as3d(v[i].good), with_shape(v[i].good, 1, C + 1),
                       with_shape(v[i].good, 0, -1), with_shape(v[i].good, 1, INT64_MAX),
                       with_stride(v[i].good, 1, 0), with_stride(v[i].good, 0, 0),
                       with_dev(v[i].good, TP_DEVICE_CUDA, 0), with_dev(v[i].good, (tp_device_t)33, 0)};
      for (size_t j = 0; j < sizeof t / sizeof t[0]; j++) {
        tp_status_t st = v[i].which ? tp_block_forward(b, &t[j], &x, &bt, NULL) : tp_block_forward(b, &y, &t[j], &bt, NULL);
        BAD(st, ANY_ERR, "block forward", v[i].arg);
      }
    }
  }
  BAD(tp_block_backward(b, &dx, &dy, NULL), ANY_ERR, "block backward", "forward");
  /* zero rows */
  tp_block_batch_t bz = {0, 0, NULL, NULL, 0, 1};
  OK(tp_block_forward(b, P(T2(NULL, 0, C)), P(T2(NULL, 0, C)), &bz, NULL));
  OK(tp_block_backward(b, P(T2(NULL, 0, C)), P(T2(NULL, 0, C)), NULL));
  /* growing and shrinking M */
  static const int64_t Ts[] = {1, 9, 2, 16, 3};
  for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++) {
    tp_block_batch_t bb = {2, Ts[i], NULL, NULL, 0, 1};
    int64_t m = 2 * Ts[i];
    OK(tp_block_forward(b, P(T2(ya + 2048, m, C)), P(T2(xa, m, C)), &bb, NULL));
    OK(tp_block_backward(b, P(T2(ga, m, C)), P(T2(ya, m, C)), NULL));
    ARG(tp_block_backward(b, P(T2(ga, m + 2, C)), P(T2(ya, m + 2, C)), NULL), "block backward", NULL);
  }
  /* forward without need_backward: backward refused */
  tp_block_batch_t nb = {1, M, NULL, NULL, 0, 0};
  OK(tp_block_forward(b, &y, &x, &nb, NULL));
  BAD(tp_block_backward(b, &dx, &dy, NULL), ANY_ERR, "block backward", NULL);
  OK(tp_block_forward(b, &y, &x, &bt, NULL));
  {
    tp_tensor t[] = {with_data(dy, NULL), with_dtype(dy, TP_INT32), with_ndim(dy, 9), with_ndim(dy, -1),
                     as3d(dy), with_shape(dy, 1, C - 1), with_shape(dy, 0, INT64_MIN), with_stride(dy, 1, 3),
                     with_dev(dy, TP_DEVICE_CUDA, 0), with_dev(dy, (tp_device_t)99, 0)};
    for (size_t j = 0; j < sizeof t / sizeof t[0]; j++) {
      BAD(tp_block_backward(b, &dx, &t[j], NULL), ANY_ERR, "block backward", "dy");
      BAD(tp_block_backward(b, &t[j], &dy, NULL), ANY_ERR, "block backward", "dx");
    }
  }
  ARG(tp_block_backward(NULL, &dx, &dy, NULL), "block backward", NULL);
  /* the cache */
  ARG(tp_block_cache(b, 0, 8), "block", "batch");
  ARG(tp_block_cache(b, -1, 8), "block", "batch");
  ARG(tp_block_cache(b, 1, 0), "block", "max_len");
  ARG(tp_block_cache(b, 1, INT64_MAX), "block", "max_len");
  ARG(tp_block_cache(b, INT64_MAX, 1), "block", "batch");
  ARG(tp_block_cache(b, (int64_t)1 << 31, 1), "block", "batch");
  ARG(tp_block_cache(b, INT_MAX, INT_MAX), "block", NULL); /* 2^62 x nk x D floats */
  ARG(tp_block_cache(NULL, 1, 8), "block", NULL);
  OK(tp_block_cache(b, 2, 8));
  tp_block_batch_t cb = {2, 3, NULL, NULL, 1, 0};
  int64_t p0[2] = {0, 0};
  cb.pos0 = p0;
  OK(tp_block_forward(b, P(T2(ya, 6, C)), P(T2(xa, 6, C)), &cb, NULL));
  p0[0] = 6; /* 6 + 3 > max_len 8 */
  ARG(tp_block_forward(b, P(T2(ya, 6, C)), P(T2(xa, 6, C)), &cb, NULL), "block forward", NULL);
  p0[0] = -1;
  ARG(tp_block_forward(b, P(T2(ya, 6, C)), P(T2(xa, 6, C)), &cb, NULL), "block forward", "pos0");
  p0[0] = INT64_MAX;
  ARG(tp_block_forward(b, P(T2(ya, 6, C)), P(T2(xa, 6, C)), &cb, NULL), "block forward", "pos0");
  p0[0] = 3;
  tp_block_batch_t cb3 = {3, 2, NULL, NULL, 1, 0}; /* more sequences than the cache holds */
  int64_t p3[3] = {0, 0, 0};
  cb3.pos0 = p3;
  ARG(tp_block_forward(b, P(T2(ya, 6, C)), P(T2(xa, 6, C)), &cb3, NULL), "block forward", NULL);
  uint8_t mask[6] = {1, 1, 1, 1, 1, 1};
  tp_block_batch_t cm = cb;
  cm.key_mask = mask; /* key_mask with the cache: refused */
  ARG(tp_block_forward(b, P(T2(ya, 6, C)), P(T2(xa, 6, C)), &cm, NULL), "block forward", "key_mask");
  tp_block_batch_t cbb = cb;
  cbb.need_backward = 1;
  p0[0] = 0, p0[1] = 0;
  tp_status_t cst = tp_block_forward(b, P(T2(ya, 6, C)), P(T2(xa, 6, C)), &cbb, NULL);
  if (cst != TP_SUCCESS) BAD(cst, ANY_ERR, "block forward", "cache");
  /* the cache shrinks and grows (reallocated, contents reset) */
  OK(tp_block_cache(b, 1, 2));
  OK(tp_block_info(b, &info));
  TRUE(info.cache_batch == 1 && info.cache_len == 2);
  OK(tp_block_cache(b, 4, 32));
  OK(tp_block_info(b, &info));
  TRUE(info.cache_batch == 4 && info.cache_len == 32);
  tp_block_destroy(b);
  tp_block_destroy(NULL);
  printf("block: done\n");
}

int main(void) {
  char job[64];
  snprintf(job, sizeof job, "hostile_%d", (int)getpid());
  tp_comm_config_t cc = TP_COMM_CONFIG_INITIALIZER;
  cc.job_id = job;
  cc.timeout_s = 30;
  tp_comm_t comm;
  if (tp_comm_init_rank(&comm, 1, 0, &cc) != TP_SUCCESS) {
    printf("init: %s\n0 passed, 1 failed\n", tp_last_error());
    return 1;
  }
  test_devices();
  printf("devices: done\n");
  test_partition();
  printf("partition: done\n");
  test_kernels();
  printf("kernels: done\n");
  test_collectives(comm);
  printf("collectives: done\n");
  test_linear(comm, TP_COLUMN_PARALLEL);
  test_linear(comm, TP_ROW_PARALLEL);
  test_mlp(comm);
  test_vocab(comm);
  test_block(comm);
  tp_comm_destroy(comm);
  printf("%d passed, %d failed\n", npass, nfail);
  return nfail ? 1 : 0;
}
