/* Activation kernels, forward/backward pairs, float32.  Backward takes the
 * forward's input h and the output gradient and writes dh.
 * SwiGLU works on a fused [M, 2F] input whose first F columns of each row are
 * the gate and the next F the up projection: out = silu(gate) * up. */
#include "parallel.h"
#include "vmath.h"
#include "tpcore/kernels.h"

static void act_forward_rows(float *out, const float *h, int64_t M, int64_t F, tp_activation_t act) {
  size_t n = (size_t)(M * F);
  switch (act) {
    case TP_ACT_GELU:
      for (size_t i = 0; i < n; i++) out[i] = 0.5f * h[i] * (1.0f + ferf(h[i] * INV_SQRT_2));
      break;
    case TP_ACT_GELU_TANH:
      for (size_t i = 0; i < n; i++) {
        float x = h[i];
        out[i] = 0.5f * x * (1.0f + ftanh(SQRT_2_OVER_PI * (x + 0.044715f * x * x * x)));
      }
      break;
    case TP_ACT_SILU:
      for (size_t i = 0; i < n; i++) out[i] = h[i] * sigmoidf(h[i]);
      break;
    case TP_ACT_RELU:
      for (size_t i = 0; i < n; i++) out[i] = h[i] > 0.0f ? h[i] : 0.0f;
      break;
    case TP_ACT_SWIGLU:
      for (int64_t m = 0; m < M; m++) {
        const float *g = h + m * 2 * F, *u = g + F;
        float *o = out + m * F;
        for (int64_t j = 0; j < F; j++) o[j] = g[j] * sigmoidf(g[j]) * u[j];
      }
      break;
  }
}

static void act_backward_rows(float *dh, const float *h, const float *dout, int64_t M, int64_t F,
                              tp_activation_t act) {
  size_t n = (size_t)(M * F);
  switch (act) {
    case TP_ACT_GELU:
      for (size_t i = 0; i < n; i++) {
        float x = h[i];
        float cdf = 0.5f * (1.0f + ferf(x * INV_SQRT_2));
        dh[i] = dout[i] * (cdf + x * INV_SQRT_2PI * fexp(-0.5f * x * x));
      }
      break;
    case TP_ACT_GELU_TANH:
      for (size_t i = 0; i < n; i++) {
        float x = h[i];
        float u = SQRT_2_OVER_PI * (x + 0.044715f * x * x * x);
        float t = ftanh(u);
        float du = SQRT_2_OVER_PI * (1.0f + 3.0f * 0.044715f * x * x);
        dh[i] = dout[i] * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du);
      }
      break;
    case TP_ACT_SILU:
      for (size_t i = 0; i < n; i++) {
        float s = sigmoidf(h[i]);
        dh[i] = dout[i] * s * (1.0f + h[i] * (1.0f - s));
      }
      break;
    case TP_ACT_RELU:
      for (size_t i = 0; i < n; i++) dh[i] = h[i] > 0.0f ? dout[i] : 0.0f;
      break;
    case TP_ACT_SWIGLU:
      for (int64_t m = 0; m < M; m++) {
        const float *g = h + m * 2 * F, *u = g + F, *d = dout + m * F;
        float *dg = dh + m * 2 * F, *du = dg + F;
        for (int64_t j = 0; j < F; j++) {
          float s = sigmoidf(g[j]);
          float silu = g[j] * s;
          du[j] = d[j] * silu;
          dg[j] = d[j] * u[j] * s * (1.0f + g[j] * (1.0f - s));
        }
      }
      break;
  }
}

/* The public kernels split the rows over this rank's threads (see parallel.h). */
typedef struct {
  float *out;
  const float *h, *dout;
  int64_t F;
  tp_activation_t act;
} act_args;

static void act_forward_chunk(void *ctx, int64_t lo, int64_t hi) {
  const act_args *a = ctx;
  int64_t hw = a->act == TP_ACT_SWIGLU ? 2 * a->F : a->F;
  act_forward_rows(a->out + lo * a->F, a->h + lo * hw, hi - lo, a->F, a->act);
}

static void act_backward_chunk(void *ctx, int64_t lo, int64_t hi) {
  const act_args *a = ctx;
  int64_t hw = a->act == TP_ACT_SWIGLU ? 2 * a->F : a->F;
  act_backward_rows(a->out + lo * hw, a->h + lo * hw, a->dout + lo * a->F, hi - lo, a->F, a->act);
}

void tp_act_forward(float *out, const float *h, int64_t M, int64_t F, tp_activation_t act) {
  act_args a = {out, h, NULL, F, act};
  tp_parallel_rows(M, F, act_forward_chunk, &a);
}

void tp_act_backward(float *dh, const float *h, const float *dout, int64_t M, int64_t F, tp_activation_t act) {
  act_args a = {dh, h, dout, F, act};
  tp_parallel_rows(M, F, act_backward_chunk, &a);
}
