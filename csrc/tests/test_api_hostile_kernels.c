/* Hostile arguments to every public kernel (tpcore/kernels.h); see test_api_hostile.c. */
#include <math.h>

#include "test_api_hostile.h"

/* ------------------------------------------------------------------ kernels */

/* Each argument of a kernel in turn replaced by its hostile variants, the others good. */
typedef struct {
  int which; /* the argument replaced */
  const tp_tensor *args[8];
  int kind; /* which kernel */
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
    case 15: return tp_rope_apply(s, a[0], a[1], 1, 4, a[2], 10000.0f, 1.5f, 0);
    case 16: return tp_adamw_step(s, a[0], a[1], a[2], a[3], 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1);
    case 17: return tp_sgd_step(s, a[0], a[1], a[2], 0.1f, 0.9f, 0.0f, 1);
    case 18: return tp_convert(s, a[0], a[1]);
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

/* Views over the shared buffers of test_api_hostile.h that several groups below use. */
#define LINEAR_VIEWS                                                                                \
  tp_tensor x = T2(xa, M, K), y = T2(ya, M, N), w = T2(wa, N, K), b = T1(ba, N), dx = T2(ga, M, K); \
  tp_tensor dw = T2(wa + 1024, N, K), db = T1(ba + 1024, N), dy = T2(ya + 1024, M, N);              \
  (void)x, (void)y, (void)w, (void)b, (void)dx, (void)dw, (void)db, (void)dy
static float h[M * 2 * N], dh[M * 2 * N], out[M * N], dout[M * N], st[2 * M], st2[2 * M], mean[M], rstd[M];
static float ws[4096];

/* linear_forward / linear_backward, float32 and 16-bit weights */
static void hostile_linear(void) {
  LINEAR_VIEWS;
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
  /* 16-bit weights: the same calls with w in bfloat16 or float16 (dw stays float32) */
  for (int d = 0; d < 2; d++) {
    tp_tensor w16 = with_dtype(w, d ? TP_FLOAT16 : TP_BFLOAT16);
    {
      const char *nm[] = {"y", "x", "w", "b"};
      const tp_tensor *g[] = {&y, &x, &w16, &b};
      int opt[] = {0, 0, 0, 1};
      kernel_case("linear_forward", 0, 4, nm, g, opt, __LINE__);
    }
    {
      const char *nm[] = {"dx", "dw", "db", "dy", "x", "w"};
      const tp_tensor *g[] = {&dx, &dw, &db, &dy, &x, &w16};
      int opt[] = {1, 1, 1, 0, 0, 0};
      kernel_case("linear_backward", 1, 6, nm, g, opt, __LINE__);
    }
    ARG(tp_linear_backward(NULL, &dx, P(with_dtype(dw, w16.dtype)), &db, &dy, &x, &w16, 0), "linear_backward", "dw");
    ARG(tp_linear_forward(NULL, &y, P(with_dtype(x, w16.dtype)), &w16, &b), "linear_forward", "x");
  }
  ARG(tp_linear_forward(NULL, &y, &x, P(with_dtype(w, TP_INT64)), &b), "linear_forward", "w");
  ARG(tp_linear_forward(NULL, &y, &x, P(with_dtype(w, TP_UINT8)), &b), "linear_forward", "bfloat16");
}

/* convert: y and x of one shape, any of float32 / bfloat16 / float16 */
static void hostile_convert(void) {
  {
    tp_tensor cy = with_dtype(T2(ya, M, K), TP_BFLOAT16), cx = T2(xa, M, K);
    const char *nm[] = {"y", "x"};
    const tp_tensor *g[] = {&cy, &cx};
    int opt[] = {0, 0};
    kernel_case("convert", 18, 2, nm, g, opt, __LINE__);
    OK(tp_convert(NULL, P(with_dtype(T2(ya, M, K), TP_FLOAT16)), P(with_dtype(T2(xa, M, K), TP_BFLOAT16))));
    OK(tp_convert(NULL, P(T2(ya, M, K)), P(T2(xa, M, K)))); /* a copy */
    OK(tp_convert(NULL, P(T2(NULL, 0, K)), P(with_dtype(T2(NULL, 0, K), TP_FLOAT16))));
    ARG(tp_convert(NULL, P(with_dtype(T2(ya, M, K), TP_INT64)), &cx), "convert", "y");
    ARG(tp_convert(NULL, &cy, P(with_dtype(T2(xa, M, K), TP_FLOAT64))), "convert", "x");
    ARG(tp_convert(NULL, P(with_dtype(T2(ya, M, K + 1), TP_BFLOAT16)), &cx), "convert", "y");
    ARG(tp_convert(NULL, P(with_dtype(T1(ya, M * K), TP_BFLOAT16)), &cx), "convert", "dimensions");
    ARG(tp_convert(NULL, P(with_dtype(T2(xa + 1, M, K), TP_BFLOAT16)), &cx), "convert", "overlap");
    ARG(tp_convert(NULL, P(with_dtype(T2(xa, M, K), TP_FLOAT16)), &cx), "convert", "overlap");
  }
}

/* activations with and without bias, forward and backward, and the workspace */
static void hostile_activations(void) {
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
    ARG(tp_bias_act_backward_workspace_size((tp_device_t)9, M, N, TP_ACT_GELU, &need), "bias_act_backward", "device");
    ARG(tp_bias_act_backward_workspace_size(TP_DEVICE_CPU, M, N, (tp_activation_t)99, &need), "bias_act_backward",
        "act");
    ARG(tp_bias_act_backward_workspace_size(TP_DEVICE_CPU, M, N, TP_ACT_GELU, NULL), "bias_act_backward", "nbytes");
  }
  ARG(tp_act_forward(NULL, &O, &H, (tp_activation_t)-1), "act_forward", "act");
  ARG(tp_act_forward(NULL, &O, &H, (tp_activation_t)99), "act_forward", "act");
  ARG(tp_act_forward(NULL, &O, P(T2(h, M, 2 * N - 1)), TP_ACT_SWIGLU), "act_forward", "h");
  ARG(tp_act_backward(NULL, &DH, &H, &DO, (tp_activation_t)5), "act_backward", "act");
}

/* the embedding and the vocab-parallel cross-entropy */
static void hostile_embedding_xent(void) {
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
}

/* layernorm, rmsnorm, rope, AdamW and SGD */
static void hostile_norms_rope_optimizers(void) {
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
    static float freq[2] = {1.0f, 0.01f}, badf[2] = {0.5f, NAN};
    tp_tensor RX = T2(xa, M, 4), RP = I1(pos, M), RF = T1(freq, 2), RB = T1(badf, 2);
    const char *nm[] = {"x", "pos", "inv_freq"};
    const tp_tensor *g[] = {&RX, &RP, &RF};
    int opt[] = {0, 0, 1};
    kernel_case("rope_apply", 15, 3, nm, g, opt, __LINE__);
    ARG(tp_rope_apply(NULL, &RX, &RP, -1, 4, NULL, 1e4f, 1.0f, 0), "rope_apply", "heads");
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, 3, NULL, 1e4f, 1.0f, 0), "rope_apply", "D");
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, -4, NULL, 1e4f, 1.0f, 0), "rope_apply", "D");
    ARG(tp_rope_apply(NULL, &RX, &RP, INT64_MAX, 4, NULL, 1e4f, 1.0f, 0), "rope_apply", NULL);
    ARG(tp_rope_apply(NULL, &RX, &RP, (int64_t)1 << 62, (int64_t)1 << 62, NULL, 1e4f, 1.0f, 0), "rope_apply", NULL);
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, 4, NULL, 0.0f, 1.0f, 0), "rope_apply", "theta");
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, 4, NULL, -1.0f, 1.0f, 0), "rope_apply", "theta");
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, 4, NULL, INFINITY, 1.0f, 0), "rope_apply", "theta");
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, 4, &RF, 1e4f, 0.0f, 0), "rope_apply", "factor");
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, 4, &RF, 1e4f, -2.0f, 0), "rope_apply", "factor");
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, 4, &RF, 1e4f, NAN, 1), "rope_apply", "factor");
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, 4, &RF, 1e4f, INFINITY, 0), "rope_apply", "factor");
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, 4, &RB, 1e4f, 1.0f, 0), "rope_apply", "inv_freq");
    ARG(tp_rope_apply(NULL, &RX, &RP, 1, 4, P(T1(freq, 1)), 1e4f, 1.0f, 0), "rope_apply", "inv_freq");
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
}

/* zero-size calls (touch nothing), shapes past BLAS's int, mixed devices */
static void hostile_zero_and_huge_sizes(void) {
  LINEAR_VIEWS;
  tp_tensor tab = T2(wa, 2, N), NW = T1(wa, K);
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
    OK(tp_rope_apply(NULL, P(T2(NULL, 0, 4)), P(I1(NULL, 0)), 1, 4, NULL, 1e4f, 1.0f, 0));
    OK(tp_rope_apply(NULL, P(T2(NULL, 0, 4)), P(I1(NULL, 0)), 1, 4, P(T1(ba, 2)), 0.0f, 2.0f, 1)); /* theta unused */
    OK(tp_adamw_step(NULL, P(T1(NULL, 0)), P(T1(NULL, 0)), P(T1(NULL, 0)), P(T1(NULL, 0)), 1e-3f, 0.9f, 0.999f, 1e-8f,
                     0.0f, 1));
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
                        P(with_dev(w, TP_DEVICE_CUDA, 0)), NULL),
      ANY_ERR, "linear_forward", "cuda");
  BAD(tp_linear_forward(NULL, &y, &x, &w, P(with_dev(b, TP_DEVICE_CUDA, 1))), ANY_ERR, "linear_forward", "b");
}

/* attention: every field of its arguments, workspaces, zero size */
static void hostile_attention(void) {
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
#define ATT(field, val, sub)                                                                \
  do {                                                                                      \
    b2 = a;                                                                                 \
    b2.field = val;                                                                         \
    ARG(tp_attention_forward(NULL, &b2, &W), "attention_forward", sub);                     \
    ARG(tp_attention_backward(NULL, &b2, dq, dk, dv, dout, &W), "attention_backward", sub); \
    ARG(tp_attention_workspace_size(&b2, 0, &need), "attention_workspace_size", sub);       \
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
    ATT(softcap, NAN, "softcap"); /* the model families' fields: soft-cap, window, ring */
    ATT(softcap, -1.0f, "softcap");
    ATT(softcap, INFINITY, "softcap");
    ATT(window, -1, "window");
    ATT(kv_ring, -1, "kv_ring");
    ATT(kv_ring, 3, "kv_ring"); /* no k_len (forward), backward (any ring) */
    {                           /* a ring over a cache: window + Tq - 1 <= kv_ring <= Tk, no probs, no key mask */
      static const int64_t klen[2] = {3, 7}, qpos[2] = {0, 4};
      static const uint8_t km[6] = {1, 1, 1, 1, 1, 1};
      b2 = a;
      b2.probs = NULL, b2.k_len = klen, b2.q_pos = qpos, b2.kv_ring = 3, b2.window = 1;
      OK(tp_attention_forward(NULL, &b2, &W)); /* 1 + 3 - 1 = 3 rows: fits */
      b2.window = 0;
      ARG(tp_attention_forward(NULL, &b2, &W), "attention_forward", "window");
      b2.window = 2;
      ARG(tp_attention_forward(NULL, &b2, &W), "attention_forward", "window + Tq - 1 <= kv_ring");
      b2.window = INT64_MAX;
      ARG(tp_attention_forward(NULL, &b2, &W), "attention_forward", "window + Tq - 1 <= kv_ring");
      b2.window = 1, b2.kv_ring = 4, b2.Tq = 1;
      ARG(tp_attention_forward(NULL, &b2, &W), "attention_forward", "Tk");
      b2.kv_ring = 3, b2.Tq = 3, b2.probs = pr;
      ARG(tp_attention_forward(NULL, &b2, &W), "attention_forward", "probs");
      b2.probs = NULL, b2.key_mask = km;
      ARG(tp_attention_forward(NULL, &b2, &W), "attention_forward", "key_mask");
    }
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

void test_kernels(void) {
  for (int i = 0; i < M; i++) tok[i] = i % 2;
  hostile_linear();
  hostile_convert();
  hostile_activations();
  hostile_embedding_xent();
  hostile_norms_rope_optimizers();
  hostile_zero_and_huge_sizes();
  hostile_attention();
}
