/*
 * tpcore CPU kernels on local shards, float32 compute.  Shape letters (llm.c
 * style): M rows (tokens: batch x time flattened), K input features, N output
 * features.  Weights follow PyTorch's nn.Linear: W has shape (N, K) and
 * y = x W^T + b.  Kernels come in <op>_forward / <op>_backward pairs, output
 * arguments first; backward kernels accumulate into parameter gradients.
 * GEMMs go through BLAS (see tp_blas_info).
 */
#ifndef TPCORE_KERNELS_H
#define TPCORE_KERNELS_H

#include "tpcore/tpcore.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which BLAS this build linked ("scipy-openblas 0.3.x ..." or the system one). */
TP_API const char *tp_blas_info(void);
/* BLAS threads of this process (OpenBLAS builds); n < 1 restores the default. */
TP_API void tp_set_num_threads(int n);
TP_API int tp_get_num_threads(void);

/* y[M,N] = x[M,K] W[N,K]^T (+ b[N] if b), overwriting y. */
TP_API void tp_linear_forward(float *y, const float *x, const float *w, const float *b, int64_t M,
                              int64_t K, int64_t N);
/* dx[M,K] = dy[M,N] W[N,K] (added to dx if accumulate_dx; skipped if dx is NULL);
 * dw[N,K] += dy^T x; db[N] += sum over rows of dy (if db). */
TP_API void tp_linear_backward(float *dx, float *dw, float *db, const float *dy, const float *x,
                               const float *w, int64_t M, int64_t K, int64_t N, int accumulate_dx);

#ifdef __cplusplus
}
#endif
#endif
