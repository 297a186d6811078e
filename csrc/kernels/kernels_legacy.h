/* Transitional (issue 9): the float* CPU kernels under their old signatures, for the
 * code that has not moved to the kernel table yet (csrc/layers before the rewrite that
 * routes them through tp_kernels_of; csrc/python through the block in
 * tpcore/kernels.h).  Each calls the CPU table's entry; attention and the bias+act
 * backward allocate their workspace per call as the old kernels did.  Delete this file
 * and cpu/legacy.c once nothing includes it. */
#ifndef TPCORE_KERNELS_LEGACY_H
#define TPCORE_KERNELS_LEGACY_H

#include "tpcore/kernels.h"

void tp_legacy_linear_forward(float *y, const float *x, const float *w, const float *b, int64_t M, int64_t K,
                              int64_t N);
void tp_legacy_linear_backward(float *dx, float *dw, float *db, const float *dy, const float *x, const float *w,
                               int64_t M, int64_t K, int64_t N, int accumulate_dx);
void tp_legacy_act_forward(float *out, const float *h, int64_t M, int64_t F, tp_activation_t act);
void tp_legacy_act_backward(float *dh, const float *h, const float *dout, int64_t M, int64_t F, tp_activation_t act);
void tp_legacy_bias_act_forward(float *out, float *h, const float *b, int64_t M, int64_t F, tp_activation_t act);
/* 0, or -1 when out of memory (nothing done) */
int tp_legacy_bias_act_backward(float *dh, float *db, const float *h, const float *dout, int64_t M, int64_t F,
                                tp_activation_t act);
void tp_legacy_embedding_forward(float *out, const int64_t *tokens, const float *table, int64_t M, int64_t lo,
                                 int64_t V, int64_t C);
void tp_legacy_embedding_backward(float *dtable, const int64_t *tokens, const float *dout, int64_t M, int64_t lo,
                                  int64_t V, int64_t C);
void tp_legacy_xent_row_max(float *rowmax, const float *logits, int64_t M, int64_t V);
void tp_legacy_xent_row_sums(float *sums, const float *logits, const float *gmax, const int64_t *targets, int64_t M,
                             int64_t lo, int64_t V);
void tp_legacy_xent_backward(float *dlogits, const float *logits, const float *gmax, const float *sumexp,
                             const int64_t *targets, const float *row_scale, float scale, int64_t M, int64_t lo,
                             int64_t V);
void tp_legacy_layernorm_forward(float *y, float *mean, float *rstd, const float *x, const float *w, const float *b,
                                 int64_t M, int64_t C, float eps);
void tp_legacy_layernorm_backward(float *dx, float *dw, float *db, const float *dy, const float *x, const float *w,
                                  const float *mean, const float *rstd, int64_t M, int64_t C);
void tp_legacy_rmsnorm_forward(float *y, float *rstd, const float *x, const float *w, int64_t M, int64_t C, float eps);
void tp_legacy_rmsnorm_backward(float *dx, float *dw, const float *dy, const float *x, const float *w,
                                const float *rstd, int64_t M, int64_t C);
void tp_legacy_rope_apply(float *x, int64_t rows, int64_t ld, int64_t heads, int64_t D, const int64_t *pos,
                          float theta, int inverse);
/* 0, or -1 (out of memory; backward: also no probs) */
int tp_legacy_attention_forward(const tp_attention_args *args);
int tp_legacy_attention_backward(const tp_attention_args *args, float *dq, float *dk, float *dv, const float *dout);
void tp_legacy_adamw_step(float *p, const float *g, float *m, float *v, int64_t n, float lr, float beta1, float beta2,
                          float eps, float weight_decay, int64_t step);
void tp_legacy_sgd_step(float *p, const float *g, float *buf, int64_t n, float lr, float momentum, float weight_decay,
                        int first);

#endif
