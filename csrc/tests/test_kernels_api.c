/* Checks of the public tensor API (tpcore/kernels.h): a right call runs the table's
 * entry; a wrong dtype, shape, layout, device, NULL or workspace fails with a sentence
 * naming the kernel and the argument, before anything is touched. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "test_kernels.h"

static int api_bad;

static void check(const char *what, int cond) {
  if (!cond) printf("    %s\n", what), api_bad = 1;
}

/* st must be want, and the last error must contain each of the words. */
static void err(const char *what, tp_status_t st, tp_status_t want, const char *w1, const char *w2, const char *w3) {
  const char *msg = tp_last_error();
  int good = st == want && (!w1 || strstr(msg, w1)) && (!w2 || strstr(msg, w2)) && (!w3 || strstr(msg, w3));
  if (!good) printf("    %s: got %s \"%s\"\n", what, tp_status_name(st), msg), api_bad = 1;
}

static tp_tensor on(tp_tensor t, tp_device_t d) {
  t.device = d;
  return t;
}

static void api_linear(void) {
  enum { M = 3, Kd = 5, N = 4 };
  float *x = rnd(M * Kd, -1, 1), *w = rnd(N * Kd, -1, 1), *b = rnd(N, -1, 1), y[M * N], y2[M * N];
  tp_tensor tx = tp_tensor_2d(x, TP_FLOAT32, M, Kd), tw = tp_tensor_2d(w, TP_FLOAT32, N, Kd);
  tp_tensor tb = tp_tensor_1d(b, TP_FLOAT32, N), ty = tp_tensor_2d(y, TP_FLOAT32, M, N);
  check("linear_forward runs", tp_linear_forward(NULL, &ty, &tx, &tw, &tb) == TP_SUCCESS);
  tp_cpu_kernel_ops.linear_forward(NULL, y2, x, w, b, M, Kd, N);
  check("linear_forward = the table's entry", !memcmp(y, y2, sizeof y));
  tp_tensor t = tx;
  t.dtype = TP_FLOAT64;
  err("dtype", tp_linear_forward(NULL, &ty, &t, &tw, &tb), TP_ERR_INVALID_ARGUMENT, "linear_forward: x", "float32",
      "float64");
  tp_tensor w2 = tp_tensor_2d(w, TP_FLOAT32, N - 1, Kd + 1);
  err("shape", tp_linear_forward(NULL, &ty, &tx, &w2, &tb), TP_ERR_INVALID_ARGUMENT, "linear_forward: w", "shape",
      "(*, 5)");
  tp_tensor y3 = tp_tensor_2d(y, TP_FLOAT32, M, N - 1);
  err("output shape", tp_linear_forward(NULL, &y3, &tx, &tw, &tb), TP_ERR_INVALID_ARGUMENT, "linear_forward: y",
      "(3, 4)", NULL);
  tp_tensor b2 = tp_tensor_1d(b, TP_FLOAT32, N + 1);
  err("bias", tp_linear_forward(NULL, &ty, &tx, &tw, &b2), TP_ERR_INVALID_ARGUMENT, "linear_forward: b", "(4,)", NULL);
  t = tp_tensor_2d(x, TP_FLOAT32, Kd, M); /* a transposed view: strides (1, Kd) */
  t.shape[0] = M, t.shape[1] = Kd, t.strides[0] = 1, t.strides[1] = M;
  err("layout", tp_linear_forward(NULL, &ty, &t, &tw, &tb), TP_ERR_INVALID_ARGUMENT, "linear_forward: x", "contiguous",
      NULL);
  t = tx;
  t.ndim = 3, t.shape[2] = 1, t.strides[2] = 1;
  err("ndim", tp_linear_forward(NULL, &ty, &t, &tw, &tb), TP_ERR_INVALID_ARGUMENT, "linear_forward: x", "2 dimensions",
      NULL);
  err("NULL", tp_linear_forward(NULL, NULL, &tx, &tw, &tb), TP_ERR_INVALID_ARGUMENT, "linear_forward: y is NULL", NULL,
      NULL);
  t = tx;
  t.data = NULL;
  err("no data", tp_linear_forward(NULL, &ty, &t, &tw, &tb), TP_ERR_INVALID_ARGUMENT, "linear_forward: x", "NULL",
      NULL);
  /* a CUDA tensor: this build has no CUDA (a CUDA build runs it, or names the device) */
  tp_tensor cx = on(tx, TP_DEVICE_CUDA), cw = on(tw, TP_DEVICE_CUDA), cb = on(tb, TP_DEVICE_CUDA),
            cy = on(ty, TP_DEVICE_CUDA);
  if (!tp_device_available(TP_DEVICE_CUDA)) {
    err("cuda", tp_linear_forward(NULL, &cy, &cx, &cw, &cb), TP_ERR_UNSUPPORTED, "linear_forward: x is cuda memory",
        "no cuda", NULL);
    err("cuda workspace size", tp_bias_act_backward_workspace_size(TP_DEVICE_CUDA, 4, 4, TP_ACT_GELU, &(size_t){0}),
        TP_ERR_UNSUPPORTED, "bias_act_backward_workspace_size: device is cuda memory", "no cuda", NULL);
  }
  err("mixed devices", tp_linear_forward(NULL, &ty, &tx, &cw, &tb), TP_ERR_INVALID_ARGUMENT, "linear_forward: w",
      "cuda:0 memory, but this call runs on cpu", NULL);
  t = on(tx, (tp_device_t)7);
  err("bad device", tp_linear_forward(NULL, &ty, &t, &tw, &tb), TP_ERR_INVALID_ARGUMENT, "linear_forward: x",
      "not a tp_device_t", NULL);
  float dx[M * Kd], dw[N * Kd] = {0};
  tp_tensor tdx = tp_tensor_2d(dx, TP_FLOAT32, M, Kd), tdw = tp_tensor_2d(dw, TP_FLOAT32, N, Kd);
  check("linear_backward runs", tp_linear_backward(NULL, &tdx, &tdw, NULL, &ty, &tx, &tw, 0) == TP_SUCCESS);
  err("backward shape", tp_linear_backward(NULL, &tdx, &tdw, NULL, &ty, &tw, &tw, 0), TP_ERR_INVALID_ARGUMENT,
      "linear_backward: x", "(3, 5)", NULL);
}

static void api_act(void) {
  enum { M = 4, F = 6 };
  float *h = rnd(M * 2 * F, -2, 2), out[M * F], out2[M * F], dh[M * 2 * F], db[2 * F] = {0};
  tp_tensor th = tp_tensor_2d(h, TP_FLOAT32, M, 2 * F), to = tp_tensor_2d(out, TP_FLOAT32, M, F);
  check("act_forward swiglu runs", tp_act_forward(NULL, &to, &th, TP_ACT_SWIGLU) == TP_SUCCESS);
  tp_cpu_kernel_ops.act_forward(NULL, out2, h, M, F, TP_ACT_SWIGLU);
  check("act_forward = the table's entry", !memcmp(out, out2, sizeof out));
  tp_tensor odd = tp_tensor_2d(h, TP_FLOAT32, M, 2 * F - 1);
  err("swiglu odd", tp_act_forward(NULL, &to, &odd, TP_ACT_SWIGLU), TP_ERR_INVALID_ARGUMENT, "act_forward: h", "even",
      NULL);
  err("act value", tp_act_forward(NULL, &to, &th, (tp_activation_t)9), TP_ERR_INVALID_ARGUMENT, "act_forward: act",
      NULL, NULL);
  err("out shape", tp_act_forward(NULL, &to, &th, TP_ACT_GELU), TP_ERR_INVALID_ARGUMENT, "act_forward: out", "(4, 12)",
      NULL);
  tp_tensor tdh = tp_tensor_2d(dh, TP_FLOAT32, M, 2 * F), tdb = tp_tensor_1d(db, TP_FLOAT32, 2 * F);
  size_t need = 0;
  check("workspace size",
        tp_bias_act_backward_workspace_size(TP_DEVICE_CPU, M, F, TP_ACT_SWIGLU, &need) == TP_SUCCESS &&
            need >= 2 * F * sizeof(float));
  err("no workspace", tp_bias_act_backward(NULL, &tdh, &tdb, &th, &to, TP_ACT_SWIGLU, NULL), TP_ERR_INVALID_ARGUMENT,
      "bias_act_backward: workspace", NULL, NULL);
  float small[3];
  tp_tensor ts = tp_tensor_1d(small, TP_FLOAT32, 3);
  err("small workspace", tp_bias_act_backward(NULL, &tdh, &tdb, &th, &to, TP_ACT_SWIGLU, &ts), TP_ERR_INVALID_ARGUMENT,
      "bias_act_backward: workspace", "bytes", NULL);
  void *ws = hmem(need);
  tp_tensor tw = tp_tensor_1d(ws, TP_UINT8, (int64_t)need);
  /* ndim outside [0, TP_MAX_DIMS]: an error, not a scalar (negative) or a read past shape[] (too many) */
  tp_tensor bad = tw;
  bad.ndim = -3;
  err("workspace ndim -3", tp_bias_act_backward(NULL, &tdh, &tdb, &th, &to, TP_ACT_SWIGLU, &bad),
      TP_ERR_INVALID_ARGUMENT, "bias_act_backward: workspace has -3 dimensions", NULL, NULL);
  bad.ndim = TP_MAX_DIMS + 1;
  err("workspace ndim 9", tp_bias_act_backward(NULL, &tdh, &tdb, &th, &to, TP_ACT_SWIGLU, &bad),
      TP_ERR_INVALID_ARGUMENT, "bias_act_backward: workspace has 9 dimensions", NULL, NULL);
  bad.ndim = 1000;
  check("numel of ndim 1000 is -1", tp_tensor_numel(&bad) == -1 && !tp_tensor_is_contiguous(&bad));
  bad.ndim = -1;
  check("numel of ndim -1 is -1", tp_tensor_numel(&bad) == -1 && !tp_tensor_is_contiguous(&bad));
  check("bias_act_backward runs", tp_bias_act_backward(NULL, &tdh, &tdb, &th, &to, TP_ACT_SWIGLU, &tw) == TP_SUCCESS);
  check("bias_act_backward without db needs no workspace",
        tp_bias_act_backward(NULL, &tdh, NULL, &th, &to, TP_ACT_SWIGLU, NULL) == TP_SUCCESS);
}

static void api_vocab_norm_rope(void) {
  enum { M = 3, V = 5, C = 4 };
  float *tab = rnd(V * C, -1, 1), out[M * C], *l = rnd(M * V, -1, 1), mx[M], *w = rnd(C, -1, 1), rs[M];
  int64_t tok[M] = {1, 7, 4};
  int32_t tok32[M] = {1, 2, 3};
  tp_tensor tt = tp_tensor_1d(tok, TP_INT64, M), tt32 = tp_tensor_1d(tok32, TP_INT32, M);
  tp_tensor ttab = tp_tensor_2d(tab, TP_FLOAT32, V, C), tout = tp_tensor_2d(out, TP_FLOAT32, M, C);
  check("embedding_forward runs",
        tp_embedding_forward(NULL, &tout, &tt, &ttab, 0) == TP_SUCCESS && out[C] == 0.0f && out[0] == tab[C]);
  err("tokens dtype", tp_embedding_forward(NULL, &tout, &tt32, &ttab, 0), TP_ERR_INVALID_ARGUMENT,
      "embedding_forward: tokens", "int64", "int32");
  /* the shard must lie in [0, 2^63): a negative lo or lo + V past int64 is refused (token - lo overflowed) */
  err("embedding lo < 0", tp_embedding_forward(NULL, &tout, &tt, &ttab, -1), TP_ERR_INVALID_ARGUMENT,
      "embedding_forward: lo", "got -1", NULL);
  err("embedding lo + V", tp_embedding_backward(NULL, &ttab, &tt, &tout, INT64_MAX - 2), TP_ERR_INVALID_ARGUMENT,
      "embedding_backward: lo", NULL, NULL);
  int64_t far[M] = {INT64_MIN, 1, INT64_MAX};
  tp_tensor tfar = tp_tensor_1d(far, TP_INT64, M);
  check("embedding_forward with ids far outside the shard runs (zero rows)",
        tp_embedding_forward(NULL, &tout, &tfar, &ttab, 3) == TP_SUCCESS && out[0] == 0.0f && out[C] == 0.0f &&
            out[2 * C] == 0.0f);
  tp_tensor tl = tp_tensor_2d(l, TP_FLOAT32, M, V), tmx = tp_tensor_1d(mx, TP_FLOAT32, M);
  check("xent_row_max runs", tp_xent_row_max(NULL, &tmx, &tl) == TP_SUCCESS);
  float sums[2 * M];
  tp_tensor tsum = tp_tensor_1d(sums, TP_FLOAT32, 2 * M);
  err("targets dtype", tp_xent_row_sums(NULL, &tsum, &tl, &tmx, &tt32, 0), TP_ERR_INVALID_ARGUMENT,
      "xent_row_sums: targets", "int64", NULL);
  tp_tensor ts1 = tp_tensor_1d(sums, TP_FLOAT32, M);
  err("sums shape", tp_xent_row_sums(NULL, &ts1, &tl, &tmx, &tt, 0), TP_ERR_INVALID_ARGUMENT, "xent_row_sums: sums",
      "(6,)", NULL);
  err("xent lo < 0", tp_xent_row_sums(NULL, &tsum, &tl, &tmx, &tt, -5), TP_ERR_INVALID_ARGUMENT, "xent_row_sums: lo",
      "got -5", NULL);
  check("xent_row_sums with targets far outside the shard runs",
        tp_xent_row_sums(NULL, &tsum, &tl, &tmx, &tfar, 2) == TP_SUCCESS && sums[M] == 0.0f && sums[M + 2] == 0.0f);
  float *x = rnd(M * C, -1, 1), y[M * C];
  tp_tensor tx = tp_tensor_2d(x, TP_FLOAT32, M, C), ty = tp_tensor_2d(y, TP_FLOAT32, M, C);
  tp_tensor tw = tp_tensor_1d(w, TP_FLOAT32, C), trs = tp_tensor_1d(rs, TP_FLOAT32, M);
  check("rmsnorm_forward runs", tp_rmsnorm_forward(NULL, &ty, &trs, &tx, &tw, 1e-5f) == TP_SUCCESS);
  tp_tensor tw2 = tp_tensor_1d(w, TP_FLOAT32, C - 1);
  err("norm weight", tp_layernorm_forward(NULL, &ty, NULL, NULL, &tx, &tw2, NULL, 1e-5f), TP_ERR_INVALID_ARGUMENT,
      "layernorm_forward: w", "(4,)", NULL);
  err("norm backward stats", tp_layernorm_backward(NULL, &ty, &tw, NULL, &ty, &tx, &tw, NULL, &trs),
      TP_ERR_INVALID_ARGUMENT, "layernorm_backward: mean is NULL", NULL, NULL);
  /* RoPE on the first 2 heads of 2 of rows of 7: strided rows are its layout */
  float *q = rnd(M * 7, -1, 1), q2[M * 7];
  memcpy(q2, q, sizeof q2);
  int64_t pos[M] = {0, 3, 9};
  tp_tensor tq = tp_tensor_2d(q, TP_FLOAT32, M, 4), tp = tp_tensor_1d(pos, TP_INT64, M);
  tq.strides[0] = 7;
  check("rope_apply on strided rows runs", tp_rope_apply(NULL, &tq, &tp, 2, 2, NULL, 10000.0f, 1.0f, 0) == TP_SUCCESS);
  tp_cpu_kernel_ops.rope(NULL, q2, M, 7, 2, 2, pos, NULL, 10000.0f, 1.0f, 0);
  check("rope_apply = the table's entry", !memcmp(q, q2, sizeof q2));
  float freq[1] = {0.37f};
  tp_tensor tf = tp_tensor_1d(freq, TP_FLOAT32, 1);
  check("rope_apply with a table runs", tp_rope_apply(NULL, &tq, &tp, 2, 2, &tf, 0.0f, 0.75f, 1) == TP_SUCCESS);
  tp_cpu_kernel_ops.rope(NULL, q2, M, 7, 2, 2, pos, freq, 0.0f, 0.75f, 1);
  check("rope_apply with a table = the table's entry", !memcmp(q, q2, sizeof q2));
  err("rope factor", tp_rope_apply(NULL, &tq, &tp, 2, 2, &tf, 1e4f, 0.0f, 0), TP_ERR_INVALID_ARGUMENT, "rope_apply",
      "factor", NULL);
  freq[0] = INFINITY;
  err("rope table", tp_rope_apply(NULL, &tq, &tp, 2, 2, &tf, 1e4f, 1.0f, 0), TP_ERR_INVALID_ARGUMENT, "rope_apply",
      "inv_freq", NULL);
  tq.strides[1] = 2;
  err("rope columns", tp_rope_apply(NULL, &tq, &tp, 2, 2, NULL, 10000.0f, 1.0f, 0), TP_ERR_INVALID_ARGUMENT,
      "rope_apply: x", "contiguous rows", NULL);
  err("rope D", tp_rope_apply(NULL, &tq, &tp, 1, 3, NULL, 10000.0f, 1.0f, 0), TP_ERR_INVALID_ARGUMENT, "rope_apply",
      "even", NULL);
  tq.strides[1] = 1, tq.strides[0] = (int64_t)1 << 62; /* 3 rows reach 2^63 elements: refused, not written */
  err("rope row stride", tp_rope_apply(NULL, &tq, &tp, 2, 2, NULL, 10000.0f, 1.0f, 0), TP_ERR_INVALID_ARGUMENT,
      "rope_apply: x", "reach past 2^63", NULL);
}

static void api_attention_optim(void) {
  enum { T = 5, H = 2, D = 4 };
  float *q = rnd(T * 3 * H * D, -1, 1), o[T * H * D];
  tp_attention_args a;
  memset(&a, 0, sizeof a);
  a.B = 1, a.Tq = a.Tk = T, a.Hq = a.Hk = H, a.D = D, a.causal = 1, a.scale = 0.5f;
  a.q = q, a.k = q + H * D, a.v = q + 2 * H * D, a.q_ld = a.kv_ld = 3 * H * D, a.kv_bstride = T * 3 * H * D;
  a.o = o, a.o_ld = H * D;
  size_t need = 0;
  check("attention workspace size", tp_attention_workspace_size(&a, 0, &need) == TP_SUCCESS);
  void *ws = hmem(need ? need : 1);
  tp_tensor tw = tp_tensor_1d(ws, TP_UINT8, (int64_t)need);
  check("attention_forward runs", tp_attention_forward(NULL, &a, need ? &tw : NULL) == TP_SUCCESS);
  err("attention NULL", tp_attention_forward(NULL, NULL, NULL), TP_ERR_INVALID_ARGUMENT, "attention_forward: args",
      NULL, NULL);
  err("attention no workspace", tp_attention_forward(NULL, &a, NULL), TP_ERR_INVALID_ARGUMENT, "attention_forward",
      "workspace", NULL);
  tp_attention_args b = a;
  b.Hk = 3;
  err("attention heads", tp_attention_forward(NULL, &b, &tw), TP_ERR_INVALID_ARGUMENT, "attention_forward: args->Hq",
      "multiple", NULL);
  b = a;
  b.q_ld = 3;
  err("attention ld", tp_attention_forward(NULL, &b, &tw), TP_ERR_INVALID_ARGUMENT, "attention_forward: args->q_ld",
      NULL, NULL);
  err("attention probs", tp_attention_backward(NULL, &a, o, o, o, o, &tw), TP_ERR_INVALID_ARGUMENT,
      "attention_backward: args->probs", NULL, NULL);
  b = a; /* 3 sequences 2^62 elements apart: (B - 1) x kv_bstride passes 2^63 (refused, not indexed) */
  b.B = 3, b.kv_bstride = (int64_t)1 << 62;
  err("attention kv_bstride reach", tp_attention_forward(NULL, &b, &tw), TP_ERR_INVALID_ARGUMENT, "attention_forward",
      "reach past 2^63", NULL);
  int64_t slot[1] = {1}; /* kv_slot: each slot inside kv_batch, forward only, kv_batch >= 1 */
  b = a;
  b.kv_slot = slot, b.kv_batch = 1;
  err("attention kv_slot range", tp_attention_forward(NULL, &b, &tw), TP_ERR_INVALID_ARGUMENT,
      "attention_forward: args->kv_slot[0] = 1", "kv_batch = 1", NULL);
  b.kv_batch = 0;
  err("attention kv_batch", tp_attention_forward(NULL, &b, &tw), TP_ERR_INVALID_ARGUMENT,
      "attention_forward: args->kv_batch = 0", NULL, NULL);
  b.kv_batch = 3, b.kv_bstride = (int64_t)1 << 62, b.Tk = 1; /* 3 sequences 2^62 apart reach past 2^63 */
  err("attention kv_batch reach", tp_attention_forward(NULL, &b, &tw), TP_ERR_INVALID_ARGUMENT, "attention_forward",
      "reach past 2^63", NULL);
  b = a, b.kv_slot = slot, b.kv_batch = 2, b.probs = o;
  err("attention kv_slot backward", tp_attention_backward(NULL, &b, o, o, o, o, &tw), TP_ERR_INVALID_ARGUMENT,
      "attention_backward: args->kv_slot", "forward", NULL);
  b = a;
  b.device = TP_DEVICE_CUDA;
  if (!tp_device_available(TP_DEVICE_CUDA))
    err("attention cuda", tp_attention_forward(NULL, &b, NULL), TP_ERR_UNSUPPORTED,
        "attention_forward: args is cuda memory", "no cuda", NULL);
  err("attention mixed",
      tp_attention_forward(NULL, &a,
                           &(tp_tensor){.data = ws,
                                        .dtype = TP_UINT8,
                                        .ndim = 1,
                                        .shape = {(int64_t)need},
                                        .strides = {1},
                                        .device = TP_DEVICE_CUDA}),
      TP_ERR_INVALID_ARGUMENT, "attention_forward: workspace is cuda:0 memory", NULL, NULL);
  enum { N = 7 };
  float *p = rnd(N, -1, 1), *g = rnd(N, -1, 1), m[N] = {0}, v[N] = {0};
  tp_tensor tp = tp_tensor_1d(p, TP_FLOAT32, N), tg = tp_tensor_1d(g, TP_FLOAT32, N);
  tp_tensor tm = tp_tensor_1d(m, TP_FLOAT32, N), tv = tp_tensor_1d(v, TP_FLOAT32, N);
  tp_tensor tv2 = tp_tensor_1d(v, TP_FLOAT32, N - 1);
  check("adamw_step runs", tp_adamw_step(NULL, &tp, &tg, &tm, &tv, 0.01f, 0.9f, 0.999f, 1e-8f, 0, 1) == TP_SUCCESS);
  err("adamw step", tp_adamw_step(NULL, &tp, &tg, &tm, &tv, 0.01f, 0.9f, 0.999f, 1e-8f, 0, 0), TP_ERR_INVALID_ARGUMENT,
      "adamw_step", "step", NULL);
  err("adamw shape", tp_adamw_step(NULL, &tp, &tg, &tm, &tv2, 0.01f, 0.9f, 0.999f, 1e-8f, 0, 1),
      TP_ERR_INVALID_ARGUMENT, "adamw_step: v", "(7,)", NULL);
  tp_tensor tg64 = tp_tensor_1d(g, TP_FLOAT64, N);
  err("sgd dtype", tp_sgd_step(NULL, &tp, &tg64, NULL, 0.1f, 0, 0, 1), TP_ERR_INVALID_ARGUMENT, "sgd_step: g",
      "float32", NULL);
  check("sgd_step runs", tp_sgd_step(NULL, &tp, &tg, NULL, 0.1f, 0, 0, 1) == TP_SUCCESS);
}

/* The device table's copies: sizes that overflow are refused, not wrapped (a 2-D copy of
 * 2^31 rows of 2^33 bytes spans 2^64 bytes, which wraps to 0 in size_t arithmetic). */
static void api_device_table(void) {
  char a[64] = {0}, b[64] = {1};
  size_t w = (size_t)1 << 33, rows = (size_t)1 << 31;
  err("copy_2d overflow", tp_device_copy_2d(TP_DEVICE_CPU, a, w, TP_DEVICE_CPU, b, w, w, rows, NULL),
      TP_ERR_INVALID_ARGUMENT, "device_copy_2d", "overflow", NULL);
  err("copy_2d pitch overflow", tp_device_copy_2d(TP_DEVICE_CPU, a, SIZE_MAX / 2, TP_DEVICE_CPU, b, 8, 8, 4, NULL),
      TP_ERR_INVALID_ARGUMENT, "device_copy_2d", "overflow", NULL);
  check("copy_2d of 4 rows runs",
        tp_device_copy_2d(TP_DEVICE_CPU, a, 16, TP_DEVICE_CPU, b, 8, 8, 4, NULL) == TP_SUCCESS &&
            !memcmp(a + 16, b + 8, 8) && !memcmp(a + 48, b + 24, 8));
}

void run_api_tests(int *passed, int *failed) {
  DEV = TP_DEVICE_CPU;
  K = tp_kernels_of(TP_DEVICE_CPU);
  struct {
    const char *name;
    void (*fn)(void);
  } t[] = {{"linear", api_linear},
           {"activations", api_act},
           {"vocab, norms, rope", api_vocab_norm_rope},
           {"attention, optimizers", api_attention_optim},
           {"device table", api_device_table}};
  for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
    api_bad = 0;
    t[i].fn();
    printf("api %s: %s\n", t[i].name, api_bad ? "FAIL" : "ok");
    api_bad ? (*failed)++ : (*passed)++;
  }
}
