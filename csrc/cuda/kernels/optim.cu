/* Optimizer steps on CUDA, in place on n elements (cpu/optim.c has the formulas and
 * is followed step for step: the bias corrections in double on the host, as there).
 *
 * Launch shape: 1-D grid-stride, one thread per element, 256 threads, at most 2^20
 * blocks. */
#include <math.h>

#include "common.cuh"

__global__ void tpk_adamw(float *p, const float *g, float *m, float *v, int64_t n, float beta1, float beta2, float eps,
                          float step_size, float inv_sqrt_bc2, float decay) {
  TPK_GRID_STRIDE(i, n) {
    float gi = g[i];
    float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step_size * mi / (sqrtf(vi) * inv_sqrt_bc2 + eps);
  }
}

__global__ void tpk_sgd(float *p, const float *g, float *buf, int64_t n, float lr, float momentum, float weight_decay,
                        int first) {
  TPK_GRID_STRIDE(i, n) {
    float gi = g[i] + weight_decay * p[i];
    if (buf) {
      gi = first ? gi : momentum * buf[i] + gi;
      buf[i] = gi;
    }
    p[i] -= lr * gi;
  }
}

extern "C" tp_status_t tp_cuda_adamw_step(tp_stream_t s, float *p, const float *g, float *m, float *v, int64_t n,
                                          float lr, float beta1, float beta2, float eps, float weight_decay,
                                          int64_t step) {
  if (n == 0) return TP_SUCCESS;
  double bc1 = 1.0 - pow((double)beta1, (double)step), bc2 = 1.0 - pow((double)beta2, (double)step);
  float step_size = (float)(lr / bc1), inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
  float decay = 1.0f - lr * weight_decay;
  tpk_adamw<<<tpk_grid(n, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(p, g, m, v, n, beta1, beta2, eps, step_size,
                                                                         inv_sqrt_bc2, decay);
  return tpk_launched("adamw_step");
}

extern "C" tp_status_t tp_cuda_sgd_step(tp_stream_t s, float *p, const float *g, float *buf, int64_t n, float lr,
                                        float momentum, float weight_decay, int first) {
  if (n == 0) return TP_SUCCESS;
  tpk_sgd<<<tpk_grid(n, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(p, g, buf, n, lr, momentum, weight_decay, first);
  return tpk_launched("sgd_step");
}
