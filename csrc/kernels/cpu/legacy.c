/* Transitional shims of ../kernels_legacy.h over the CPU table's entries. */
#include <stdlib.h>

#include "../kernels_legacy.h"
#include "cpu_impl.h"

void tp_legacy_linear_forward(float *y, const float *x, const float *w, const float *b, int64_t M, int64_t K,
                              int64_t N) {
  tp_cpu_linear_forward(NULL, y, x, w, b, M, K, N);
}
void tp_legacy_linear_backward(float *dx, float *dw, float *db, const float *dy, const float *x, const float *w,
                               int64_t M, int64_t K, int64_t N, int accumulate_dx) {
  tp_cpu_linear_backward(NULL, dx, dw, db, dy, x, w, M, K, N, accumulate_dx);
}
void tp_legacy_act_forward(float *out, const float *h, int64_t M, int64_t F, tp_activation_t act) {
  tp_cpu_act_forward(NULL, out, h, M, F, act);
}
void tp_legacy_act_backward(float *dh, const float *h, const float *dout, int64_t M, int64_t F, tp_activation_t act) {
  tp_cpu_act_backward(NULL, dh, h, dout, M, F, act);
}
void tp_legacy_bias_act_forward(float *out, float *h, const float *b, int64_t M, int64_t F, tp_activation_t act) {
  tp_cpu_bias_act_forward(NULL, out, h, b, M, F, act);
}
int tp_legacy_bias_act_backward(float *dh, float *db, const float *h, const float *dout, int64_t M, int64_t F,
                                tp_activation_t act) {
  size_t n = db ? tp_cpu_bias_act_backward_workspace(M, F, act) : 0;
  void *ws = n ? malloc(n) : NULL;
  if (n && !ws) return -1;
  tp_status_t st = tp_cpu_bias_act_backward(NULL, dh, db, h, dout, M, F, act, ws, n);
  free(ws);
  return st == TP_SUCCESS ? 0 : -1;
}
void tp_legacy_embedding_forward(float *out, const int64_t *tokens, const float *table, int64_t M, int64_t lo,
                                 int64_t V, int64_t C) {
  tp_cpu_embedding_forward(NULL, out, tokens, table, M, lo, V, C);
}
void tp_legacy_embedding_backward(float *dtable, const int64_t *tokens, const float *dout, int64_t M, int64_t lo,
                                  int64_t V, int64_t C) {
  tp_cpu_embedding_backward(NULL, dtable, tokens, dout, M, lo, V, C);
}
void tp_legacy_xent_row_max(float *rowmax, const float *logits, int64_t M, int64_t V) {
  tp_cpu_xent_row_max(NULL, rowmax, logits, M, V);
}
void tp_legacy_xent_row_sums(float *sums, const float *logits, const float *gmax, const int64_t *targets, int64_t M,
                             int64_t lo, int64_t V) {
  tp_cpu_xent_row_sums(NULL, sums, logits, gmax, targets, M, lo, V);
}
void tp_legacy_xent_backward(float *dlogits, const float *logits, const float *gmax, const float *sumexp,
                             const int64_t *targets, const float *row_scale, float scale, int64_t M, int64_t lo,
                             int64_t V) {
  tp_cpu_xent_backward(NULL, dlogits, logits, gmax, sumexp, targets, row_scale, scale, M, lo, V);
}
void tp_legacy_layernorm_forward(float *y, float *mean, float *rstd, const float *x, const float *w, const float *b,
                                 int64_t M, int64_t C, float eps) {
  tp_cpu_layernorm_forward(NULL, y, mean, rstd, x, w, b, M, C, eps);
}
void tp_legacy_layernorm_backward(float *dx, float *dw, float *db, const float *dy, const float *x, const float *w,
                                  const float *mean, const float *rstd, int64_t M, int64_t C) {
  tp_cpu_layernorm_backward(NULL, dx, dw, db, dy, x, w, mean, rstd, M, C);
}
void tp_legacy_rmsnorm_forward(float *y, float *rstd, const float *x, const float *w, int64_t M, int64_t C,
                               float eps) {
  tp_cpu_rmsnorm_forward(NULL, y, rstd, x, w, M, C, eps);
}
void tp_legacy_rmsnorm_backward(float *dx, float *dw, const float *dy, const float *x, const float *w,
                                const float *rstd, int64_t M, int64_t C) {
  tp_cpu_rmsnorm_backward(NULL, dx, dw, dy, x, w, rstd, M, C);
}
void tp_legacy_rope_apply(float *x, int64_t rows, int64_t ld, int64_t heads, int64_t D, const int64_t *pos,
                          float theta, int inverse) {
  tp_cpu_rope(NULL, x, rows, ld, heads, D, pos, theta, inverse);
}
static int attention(const tp_attention_args *a, int backward, float *dq, float *dk, float *dv, const float *dout) {
  if (backward && !a->probs) return -1;
  size_t n = tp_cpu_attention_workspace(a, backward);
  void *ws = n ? malloc(n) : NULL;
  if (n && !ws) return -1;
  tp_status_t st = backward ? tp_cpu_attention_backward(NULL, a, dq, dk, dv, dout, ws, n)
                            : tp_cpu_attention_forward(NULL, a, ws, n);
  free(ws);
  return st == TP_SUCCESS ? 0 : -1;
}
int tp_legacy_attention_forward(const tp_attention_args *a) { return attention(a, 0, NULL, NULL, NULL, NULL); }
int tp_legacy_attention_backward(const tp_attention_args *a, float *dq, float *dk, float *dv, const float *dout) {
  return attention(a, 1, dq, dk, dv, dout);
}
void tp_legacy_adamw_step(float *p, const float *g, float *m, float *v, int64_t n, float lr, float beta1, float beta2,
                          float eps, float weight_decay, int64_t step) {
  tp_cpu_adamw_step(NULL, p, g, m, v, n, lr, beta1, beta2, eps, weight_decay, step);
}
void tp_legacy_sgd_step(float *p, const float *g, float *buf, int64_t n, float lr, float momentum, float weight_decay,
                        int first) {
  tp_cpu_sgd_step(NULL, p, g, buf, n, lr, momentum, weight_decay, first);
}
