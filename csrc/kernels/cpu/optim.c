/* Optimizer steps on a parameter shard, float32, in place.
 * AdamW (decoupled weight decay, Loshchilov & Hutter; PyTorch's torch.optim.AdamW):
 *   p -= lr * wd * p;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
 *   p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
 * SGD with momentum and weight decay (torch.optim.SGD):
 *   g += wd p;  buf = momentum buf + g (buf = g at the first step);  p -= lr buf */
#include <math.h>

#include "cpu_impl.h"

tp_status_t tp_cpu_adamw_step(tp_stream_t s, float *p, const float *g, float *m, float *v, int64_t n, float lr,
                              float beta1, float beta2, float eps, float weight_decay, int64_t step) {
  (void)s;
  double bc1 = 1.0 - pow((double)beta1, (double)step), bc2 = 1.0 - pow((double)beta2, (double)step);
  float step_size = (float)(lr / bc1), inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
  float decay = 1.0f - lr * weight_decay;
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i];
    float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step_size * mi / (sqrtf(vi) * inv_sqrt_bc2 + eps);
  }
  return TP_SUCCESS;
}

tp_status_t tp_cpu_sgd_step(tp_stream_t s, float *p, const float *g, float *buf, int64_t n, float lr, float momentum,
                            float weight_decay, int first) {
  (void)s;
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i] + weight_decay * p[i];
    if (buf) {
      gi = first ? gi : momentum * buf[i] + gi;
      buf[i] = gi;
    }
    p[i] -= lr * gi;
  }
  return TP_SUCCESS;
}
