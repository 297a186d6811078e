/* Linear layer kernels on a local shard: the GEMMs go through BLAS; the bias and
 * its gradient are simple loops the compiler vectorizes. */
#include <stdio.h>
#include <string.h>

#include "../blas_impl.h"
#include "cpu_impl.h"

const char *tp_blas_info(void) {
#if defined(TP_BLAS_SCIPY_OPENBLAS)
  static char buf[256];
  if (!buf[0]) {
    const char *cfg = TP_BLAS(openblas_get_config)();
    const char *core = TP_BLAS(openblas_get_corename)();
    snprintf(buf, sizeof buf, "scipy-openblas32 (vendored; %s; core %s)", cfg, core);
  }
  return buf;
#elif defined(TP_BLAS_IS_OPENBLAS)
  return "system OpenBLAS (pkg-config)";
#else
  return "system CBLAS (pkg-config)";
#endif
}

static int default_threads = -1;

void tp_set_num_threads(int n) {
#if defined(TP_BLAS_IS_OPENBLAS)
  if (default_threads < 0) default_threads = TP_BLAS(openblas_get_num_threads)();
  TP_BLAS(openblas_set_num_threads)(n < 1 ? default_threads : n);
#else
  (void)n;
#endif
}

int tp_blas_single_thread_begin(void) {
#if defined(TP_BLAS_IS_OPENBLAS)
  int prev = TP_BLAS(openblas_get_num_threads)();
  if (prev > 1) TP_BLAS(openblas_set_num_threads)(1);
  return prev;
#else
  return 1;
#endif
}

void tp_blas_single_thread_end(int prev) {
#if defined(TP_BLAS_IS_OPENBLAS)
  if (prev > 1) TP_BLAS(openblas_set_num_threads)(prev);
#else
  (void)prev;
#endif
}

int tp_get_num_threads(void) {
#if defined(TP_BLAS_IS_OPENBLAS)
  return TP_BLAS(openblas_get_num_threads)();
#else
  return 1;
#endif
}

tp_status_t tp_cpu_linear_forward(tp_stream_t s, float *y, const float *x, const float *w, const float *b, int64_t M,
                                  int64_t K, int64_t N) {
  (void)s;
  if (M == 0 || N == 0) return TP_SUCCESS;
  float beta = 0.0f;
  if (b) {
    for (int64_t m = 0; m < M; m++) memcpy(y + m * N, b, (size_t)N * sizeof(float));
    beta = 1.0f;
  }
  if (K == 0) {
    if (!b) memset(y, 0, (size_t)(M * N) * sizeof(float));
    return TP_SUCCESS;
  }
  if (M <= 2) {
    /* One or two rows (decoding): GEMV reads W once per row; GEMM would first pack all of W
     * (measured 2.5-3x slower for a 768 x 2304 weight at M = 1). */
    for (int64_t m = 0; m < M; m++)
      TP_BLAS(cblas_sgemv)(CblasRowMajor, CblasNoTrans, (tp_blasint)N, (tp_blasint)K, 1.0f, w, (tp_blasint)K, x + m * K,
                           1, beta, y + m * N, 1);
    return TP_SUCCESS;
  }
  TP_BLAS(cblas_sgemm)(CblasRowMajor, CblasNoTrans, CblasTrans, (tp_blasint)M, (tp_blasint)N, (tp_blasint)K, 1.0f, x,
                       (tp_blasint)K, w, (tp_blasint)K, beta, y, (tp_blasint)N);
  return TP_SUCCESS;
}

tp_status_t tp_cpu_linear_backward(tp_stream_t s, float *dx, float *dw, float *db, const float *dy, const float *x,
                                   const float *w, int64_t M, int64_t K, int64_t N, int accumulate_dx) {
  (void)s;
  if (dx && M && K) {
    if (N == 0) {
      if (!accumulate_dx) memset(dx, 0, (size_t)(M * K) * sizeof(float));
    } else {
      TP_BLAS(cblas_sgemm)(CblasRowMajor, CblasNoTrans, CblasNoTrans, (tp_blasint)M, (tp_blasint)K, (tp_blasint)N, 1.0f,
                           dy, (tp_blasint)N, w, (tp_blasint)K, accumulate_dx ? 1.0f : 0.0f, dx, (tp_blasint)K);
    }
  }
  if (dw && N && K && M)
    TP_BLAS(cblas_sgemm)(CblasRowMajor, CblasTrans, CblasNoTrans, (tp_blasint)N, (tp_blasint)K, (tp_blasint)M, 1.0f, dy,
                         (tp_blasint)N, x, (tp_blasint)K, 1.0f, dw, (tp_blasint)K);
  if (db) tp_cpu_bias_grad(s, db, dy, M, N);
  return TP_SUCCESS;
}

tp_status_t tp_cpu_gemm(tp_stream_t s, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                        const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  (void)s;
  if (M == 0 || N == 0) return TP_SUCCESS;
  if (K == 0) { /* C = beta C (BLAS would do the same; spelled out for K = 0 with lda = 0) */
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < N; n++) C[m * ldc + n] = beta == 0.0f ? 0.0f : beta * C[m * ldc + n];
    return TP_SUCCESS;
  }
  TP_BLAS(cblas_sgemm)(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                       (tp_blasint)M, (tp_blasint)N, (tp_blasint)K, alpha, A, (tp_blasint)lda, B, (tp_blasint)ldb, beta,
                       C, (tp_blasint)ldc);
  return TP_SUCCESS;
}
