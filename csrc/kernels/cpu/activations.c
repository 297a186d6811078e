/* Activation kernels, forward/backward pairs, float32.  Backward takes the
 * forward's input h and the output gradient and writes dh.
 * SwiGLU and GeGLU work on a fused [M, 2F] input whose first F columns of each row
 * are the gate and the next F the up projection: out = silu(gate) * up, or
 * gelu_tanh(gate) * up (GeGLU, with the steps of TP_ACT_GELU_TANH). */
#include <string.h>

#include "parallel.h"
#include "vmath.h"
#include "cpu_impl.h"

/* One function per loop, each compiled for every vector width (vmath.h): GCC
 * vectorizes a loop on its own more reliably than the same loop as one case of a
 * switch (the SiLU forward case did not vectorize there). */
#define ELEMENTWISE(name, body)                                                                                        \
  TP_VECTOR_CLONES static void name(float *restrict out, const float *restrict h, const float *restrict d, size_t n) { \
    (void)d;                                                                                                           \
    for (size_t i = 0; i < n; i++) {                                                                                   \
      float x = h[i];                                                                                                  \
      body;                                                                                                            \
    }                                                                                                                  \
  }

ELEMENTWISE(gelu_fwd, out[i] = 0.5f * x * (1.0f + ferf(x * INV_SQRT_2)))
ELEMENTWISE(gelu_tanh_fwd, out[i] = 0.5f * x * (1.0f + ftanh(SQRT_2_OVER_PI * (x + 0.044715f * x * x * x))))
ELEMENTWISE(silu_fwd, out[i] = x / (1.0f + fexp(-x)))
ELEMENTWISE(relu_fwd, out[i] = x > 0.0f ? x : 0.0f)
ELEMENTWISE(gelu_bwd, out[i] = d[i] * (0.5f * (1.0f + ferf(x * INV_SQRT_2)) + x * INV_SQRT_2PI * fexp(-0.5f * x * x)))
ELEMENTWISE(gelu_tanh_bwd, {
  float t = ftanh(SQRT_2_OVER_PI * (x + 0.044715f * x * x * x));
  float du = SQRT_2_OVER_PI * (1.0f + 3.0f * 0.044715f * x * x);
  out[i] = d[i] * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du);
})
ELEMENTWISE(silu_bwd, {
  float s = sigmoidf(x);
  out[i] = d[i] * s * (1.0f + x * (1.0f - s));
})
ELEMENTWISE(relu_bwd, out[i] = x > 0.0f ? d[i] : 0.0f)

/* SwiGLU on one row: gate g, up u (F each). */
TP_VECTOR_CLONES static void swiglu_fwd(float *restrict o, const float *restrict g, const float *restrict u,
                                        int64_t F) {
  for (int64_t j = 0; j < F; j++) o[j] = g[j] / (1.0f + fexp(-g[j])) * u[j];
}

TP_VECTOR_CLONES static void swiglu_bwd(float *restrict dg, float *restrict du, const float *restrict g,
                                        const float *restrict u, const float *restrict d, int64_t F) {
  for (int64_t j = 0; j < F; j++) {
    float s = sigmoidf(g[j]);
    du[j] = d[j] * g[j] * s;
    dg[j] = d[j] * u[j] * s * (1.0f + g[j] * (1.0f - s));
  }
}

/* GeGLU on one row: gelu_tanh as gelu_tanh_fwd / gelu_tanh_bwd compute it. */
TP_VECTOR_CLONES static void geglu_fwd(float *restrict o, const float *restrict g, const float *restrict u, int64_t F) {
  for (int64_t j = 0; j < F; j++) {
    float x = g[j];
    o[j] = 0.5f * x * (1.0f + ftanh(SQRT_2_OVER_PI * (x + 0.044715f * x * x * x))) * u[j];
  }
}

TP_VECTOR_CLONES static void geglu_bwd(float *restrict dg, float *restrict du, const float *restrict g,
                                       const float *restrict u, const float *restrict d, int64_t F) {
  for (int64_t j = 0; j < F; j++) {
    float x = g[j];
    float t = ftanh(SQRT_2_OVER_PI * (x + 0.044715f * x * x * x));
    float dt = SQRT_2_OVER_PI * (1.0f + 3.0f * 0.044715f * x * x);
    du[j] = d[j] * (0.5f * x * (1.0f + t));
    dg[j] = d[j] * u[j] * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dt);
  }
}

static void act_forward_rows(float *out, const float *h, int64_t M, int64_t F, tp_activation_t act) {
  size_t n = (size_t)(M * F);
  switch (act) {
    case TP_ACT_GELU: gelu_fwd(out, h, NULL, n); break;
    case TP_ACT_GELU_TANH: gelu_tanh_fwd(out, h, NULL, n); break;
    case TP_ACT_SILU: silu_fwd(out, h, NULL, n); break;
    case TP_ACT_RELU: relu_fwd(out, h, NULL, n); break;
    case TP_ACT_SWIGLU:
      for (int64_t m = 0; m < M; m++) swiglu_fwd(out + m * F, h + m * 2 * F, h + m * 2 * F + F, F);
      break;
    case TP_ACT_GEGLU:
      for (int64_t m = 0; m < M; m++) geglu_fwd(out + m * F, h + m * 2 * F, h + m * 2 * F + F, F);
      break;
  }
}

static void act_backward_rows(float *dh, const float *h, const float *dout, int64_t M, int64_t F, tp_activation_t act) {
  size_t n = (size_t)(M * F);
  switch (act) {
    case TP_ACT_GELU: gelu_bwd(dh, h, dout, n); break;
    case TP_ACT_GELU_TANH: gelu_tanh_bwd(dh, h, dout, n); break;
    case TP_ACT_SILU: silu_bwd(dh, h, dout, n); break;
    case TP_ACT_RELU: relu_bwd(dh, h, dout, n); break;
    case TP_ACT_SWIGLU:
      for (int64_t m = 0; m < M; m++) {
        const float *g = h + m * 2 * F;
        float *dg = dh + m * 2 * F;
        swiglu_bwd(dg, dg + F, g, g + F, dout + m * F, F);
      }
      break;
    case TP_ACT_GEGLU:
      for (int64_t m = 0; m < M; m++) {
        const float *g = h + m * 2 * F;
        float *dg = dh + m * 2 * F;
        geglu_bwd(dg, dg + F, g, g + F, dout + m * F, F);
      }
      break;
  }
}

TP_VECTOR_CLONES static void add_row(float *restrict acc, const float *restrict x, int64_t n) {
  for (int64_t j = 0; j < n; j++) acc[j] += x[j];
}

/* The public kernels split the rows over this rank's threads (see parallel.h). */
typedef struct {
  float *out, *h, *db, *partial;
  const float *ch, *dout, *b;
  int64_t F, hw;
  tp_activation_t act;
} act_args;

static void act_forward_chunk(void *ctx, int64_t lo, int64_t hi, int chunk) {
  const act_args *a = ctx;
  (void)chunk;
  if (!a->b) {
    act_forward_rows(a->out + lo * a->F, a->ch + lo * a->hw, hi - lo, a->F, a->act);
    return;
  }
  for (int64_t m = lo; m < hi; m++) { /* h += b, then the activation, a row at a time (in cache) */
    float *h = a->h + m * a->hw;
    add_row(h, a->b, a->hw);
    act_forward_rows(a->out + m * a->F, h, 1, a->F, a->act);
  }
}

static void act_backward_chunk(void *ctx, int64_t lo, int64_t hi, int chunk) {
  const act_args *a = ctx;
  if (!a->db) {
    act_backward_rows(a->out + lo * a->hw, a->ch + lo * a->hw, a->dout + lo * a->F, hi - lo, a->F, a->act);
    return;
  }
  float *acc = a->partial + (int64_t)chunk * a->hw; /* this chunk's column sums of dh */
  for (int64_t m = lo; m < hi; m++) {
    float *dh = a->out + m * a->hw;
    act_backward_rows(dh, a->ch + m * a->hw, a->dout + m * a->F, 1, a->F, a->act);
    add_row(acc, dh, a->hw);
  }
}

tp_status_t tp_cpu_act_forward(tp_stream_t s, float *out, const float *h, int64_t M, int64_t F, tp_activation_t act) {
  (void)s;
  act_args a = {out, NULL, NULL, NULL, h, NULL, NULL, F, tp_act_gated(act) ? 2 * F : F, act};
  tp_parallel_rows(M, F, act_forward_chunk, &a);
  return TP_SUCCESS;
}

tp_status_t tp_cpu_act_backward(tp_stream_t s, float *dh, const float *h, const float *dout, int64_t M, int64_t F,
                                tp_activation_t act) {
  (void)s;
  act_args a = {dh, NULL, NULL, NULL, h, dout, NULL, F, tp_act_gated(act) ? 2 * F : F, act};
  tp_parallel_rows(M, F, act_backward_chunk, &a);
  return TP_SUCCESS;
}

tp_status_t tp_cpu_bias_act_forward(tp_stream_t s, float *out, float *h, const float *b, int64_t M, int64_t F,
                                    tp_activation_t act) {
  (void)s;
  act_args a = {out, h, NULL, NULL, h, NULL, b, F, tp_act_gated(act) ? 2 * F : F, act};
  tp_parallel_rows(M, F, act_forward_chunk, &a);
  return TP_SUCCESS;
}

/* One row of partial column sums per chunk (thread), as many chunks as the rank's
 * threads would use now: the caller asks once and reuses the workspace. */
size_t tp_cpu_bias_act_backward_workspace(int64_t M, int64_t F, tp_activation_t act) {
  int64_t hw = tp_act_gated(act) ? 2 * F : F;
  if (M <= 0) return 0;
  size_t n;
  if (!tp_mul_size((size_t)tp_parallel_plan(M, F), (size_t)(hw ? hw : 1) * sizeof(float), &n)) return SIZE_MAX;
  return n;
}

tp_status_t tp_cpu_bias_act_backward(tp_stream_t s, float *dh, float *db, const float *h, const float *dout, int64_t M,
                                     int64_t F, tp_activation_t act, void *workspace, size_t workspace_bytes) {
  (void)s;
  int64_t hw = tp_act_gated(act) ? 2 * F : F;
  int t = tp_parallel_plan(M, F);
  float *partial = NULL;
  if (db && M > 0) {
    size_t row = (size_t)(hw ? hw : 1) * sizeof(float), fit = workspace ? workspace_bytes / row : 0;
    if (fit < 1)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "bias_act_backward: the workspace of %zu bytes is below one row "
                          "of partial sums (%zu bytes)",
                          workspace ? workspace_bytes : 0, row);
    if ((size_t)t > fit) t = (int)fit; /* fewer threads, the same sums for the same (threads, workspace) */
    partial = workspace;
    memset(partial, 0, (size_t)t * row);
  }
  act_args a = {dh, NULL, partial ? db : NULL, partial, h, dout, NULL, F, hw, act};
  tp_parallel_run(t, M, act_backward_chunk, &a);
  if (partial) /* chunks in row order: the same sums for the same thread count */
    for (int c = 0; c < t; c++)
      for (int64_t j = 0; j < hw; j++) db[j] += partial[(int64_t)c * hw + j];
  return TP_SUCCESS;
}
