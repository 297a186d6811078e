/* The GEMMs and the linear layer on CUDA: every product through cuBLAS (row-major
 * operands passed to column-major cuBLAS swapped: C^T = op(B)^T op(A)^T), the bias as
 * a row broadcast into y before a beta = 1 GEMM, its gradient as a deterministic
 * column sum (colsum.cuh).  Sizes past cuBLAS's int are split: rows of y / dx in
 * chunks of at most INT_MAX, dw's reduction over M in chunks accumulated with beta = 1.
 *
 * Launch shapes: bias_rows / add_bias 1-D grid-stride over M x N (256 threads, at most
 * 2^20 blocks); bias_grad the column sum (32 x 32 threads, one block per 32 columns);
 * scale_rows (gemm with K = 0) 1-D over M x N. */
#include <limits.h>

#include "colsum.cuh"
#include "common.cuh"
#include "cublas_api.h"

/* y[m, n] = (x ? x[m, n] : 0) + b[n]. */
__global__ void tpk_bias_rows(float *y, const float *x, const float *b, int64_t M, int64_t N) {
  TPK_GRID_STRIDE(i, M * N) {
    int64_t n = i % N;
    y[i] = x ? x[i] + b[n] : b[n];
  }
}

/* C[m, n] = beta == 0 ? 0 : beta * C[m, n] (row stride ldc). */
__global__ void tpk_scale_rows(float *C, int64_t ldc, int64_t M, int64_t N, float beta) {
  TPK_GRID_STRIDE(i, M * N) {
    int64_t m = i / N, n = i % N;
    float *c = C + m * ldc + n;
    *c = beta == 0.0f ? 0.0f : beta * *c;
  }
}

struct tpk_dy_term {
  const float *dy;
  int64_t N;
  __device__ float2 operator()(int64_t m, int64_t n) const { return make_float2(dy[m * N + n], 0.0f); }
};

static tp_status_t int_range(const char *op, const char *what, int64_t v) {
  if (v > INT_MAX)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s = %lld is past cuBLAS's int range", op, what, (long long)v);
  return TP_SUCCESS;
}

extern "C" tp_status_t tp_cuda_add_bias(tp_stream_t s, float *y, const float *x, const float *b, int64_t M, int64_t N) {
  if (M == 0 || N == 0) return TP_SUCCESS;
  tpk_bias_rows<<<tpk_grid(M * N, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(y, x, b, M, N);
  return tpk_launched("add_bias");
}

extern "C" tp_status_t tp_cuda_bias_grad(tp_stream_t s, float *db, const float *dy, int64_t M, int64_t N) {
  if (M == 0 || N == 0) return TP_SUCCESS;
  tpk_dy_term t = {dy, N};
  return tpk_colsum(s, "bias_grad", db, NULL, M, N, t);
}

extern "C" tp_status_t tp_cuda_gemm(tp_stream_t s, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                                    float alpha, const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                                    float *C, int64_t ldc) {
  if (M == 0 || N == 0) return TP_SUCCESS;
  if (K == 0) {
    tpk_scale_rows<<<tpk_grid(M * N, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(C, ldc, M, N, beta);
    return tpk_launched("gemm (K = 0)");
  }
  TP_CHECK(int_range("gemm", "M", M));
  TP_CHECK(int_range("gemm", "N", N));
  TP_CHECK(int_range("gemm", "K", K));
  TP_CHECK(int_range("gemm", "lda", lda));
  TP_CHECK(int_range("gemm", "ldb", ldb));
  TP_CHECK(int_range("gemm", "ldc", ldc));
  const tp_cublas_api *api;
  cublasHandle_t h;
  TP_CHECK(tp_cublas_get("gemm", s, &api, &h));
  cublasStatus_t st =
      api->Sgemm(h, trans_b ? TP_CUBLAS_OP_T : TP_CUBLAS_OP_N, trans_a ? TP_CUBLAS_OP_T : TP_CUBLAS_OP_N, (int)N,
                 (int)M, (int)K, &alpha, B, (int)ldb, A, (int)lda, &beta, C, (int)ldc);
  if (st != TP_CUBLAS_STATUS_SUCCESS) return tp_cublas_error("gemm", "cublasSgemm_v2", st);
  return TP_SUCCESS;
}

extern "C" tp_status_t tp_cuda_linear_forward(tp_stream_t s, float *y, const float *x, const float *w, const float *b,
                                              int64_t M, int64_t K, int64_t N) {
  if (M == 0 || N == 0) return TP_SUCCESS;
  float one = 1.0f, beta = 0.0f;
  if (b) {
    tpk_bias_rows<<<tpk_grid(M * N, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(y, NULL, b, M, N);
    TP_CHECK(tpk_launched("linear_forward (bias rows)"));
    beta = 1.0f;
  }
  if (K == 0) {
    if (!b) {
      cudaError_t e = cudaMemsetAsync(y, 0, (size_t)(M * N) * sizeof(float), tpk_stream(s));
      if (e != cudaSuccess)
        return tp_set_error(TP_ERR_SYSTEM, "cuda linear_forward: cudaMemsetAsync: %s", cudaGetErrorString(e));
    }
    return TP_SUCCESS;
  }
  TP_CHECK(int_range("linear_forward", "K", K));
  TP_CHECK(int_range("linear_forward", "N", N));
  const tp_cublas_api *api;
  cublasHandle_t h;
  TP_CHECK(tp_cublas_get("linear_forward", s, &api, &h));
  cublasStatus_t st;
  if (M == 1) { /* decoding: y^T = W x, W[N, K] row-major is a K x N column-major matrix: op T */
    st = api->Sgemv(h, TP_CUBLAS_OP_T, (int)K, (int)N, &one, w, (int)K, x, 1, &beta, y, 1);
    if (st != TP_CUBLAS_STATUS_SUCCESS) return tp_cublas_error("linear_forward", "cublasSgemv_v2", st);
    return TP_SUCCESS;
  }
  for (int64_t m0 = 0; m0 < M; m0 += INT_MAX) { /* y[m0:, :]^T = W x[m0:, :]^T */
    int64_t mc = M - m0 < INT_MAX ? M - m0 : INT_MAX;
    st = api->Sgemm(h, TP_CUBLAS_OP_T, TP_CUBLAS_OP_N, (int)N, (int)mc, (int)K, &one, w, (int)K, x + m0 * K, (int)K,
                    &beta, y + m0 * N, (int)N);
    if (st != TP_CUBLAS_STATUS_SUCCESS) return tp_cublas_error("linear_forward", "cublasSgemm_v2", st);
  }
  return TP_SUCCESS;
}

extern "C" tp_status_t tp_cuda_linear_backward(tp_stream_t s, float *dx, float *dw, float *db, const float *dy,
                                               const float *x, const float *w, int64_t M, int64_t K, int64_t N,
                                               int accumulate_dx) {
  float one = 1.0f, bx = accumulate_dx ? 1.0f : 0.0f;
  int need_blas = (dx && M && K && N) || (dw && N && K && M);
  const tp_cublas_api *api = NULL;
  cublasHandle_t h = NULL;
  cublasStatus_t st;
  if (need_blas) {
    TP_CHECK(int_range("linear_backward", "K", K));
    TP_CHECK(int_range("linear_backward", "N", N));
    TP_CHECK(tp_cublas_get("linear_backward", s, &api, &h));
  }
  if (dx && M && K) {
    if (N == 0) {
      if (!accumulate_dx) {
        cudaError_t e = cudaMemsetAsync(dx, 0, (size_t)(M * K) * sizeof(float), tpk_stream(s));
        if (e != cudaSuccess)
          return tp_set_error(TP_ERR_SYSTEM, "cuda linear_backward: cudaMemsetAsync: %s", cudaGetErrorString(e));
      }
    } else {
      for (int64_t m0 = 0; m0 < M; m0 += INT_MAX) { /* dx[m0:]^T = W^T dy[m0:]^T */
        int64_t mc = M - m0 < INT_MAX ? M - m0 : INT_MAX;
        st = api->Sgemm(h, TP_CUBLAS_OP_N, TP_CUBLAS_OP_N, (int)K, (int)mc, (int)N, &one, w, (int)K, dy + m0 * N,
                        (int)N, &bx, dx + m0 * K, (int)K);
        if (st != TP_CUBLAS_STATUS_SUCCESS) return tp_cublas_error("linear_backward (dx)", "cublasSgemm_v2", st);
      }
    }
  }
  if (dw && N && K && M) {
    for (int64_t m0 = 0; m0 < M; m0 += INT_MAX) { /* dw^T += x[m0:]^T dy[m0:] (column-major K x N) */
      int64_t mc = M - m0 < INT_MAX ? M - m0 : INT_MAX;
      st = api->Sgemm(h, TP_CUBLAS_OP_N, TP_CUBLAS_OP_T, (int)K, (int)N, (int)mc, &one, x + m0 * K, (int)K, dy + m0 * N,
                      (int)N, &one, dw, (int)K);
      if (st != TP_CUBLAS_STATUS_SUCCESS) return tp_cublas_error("linear_backward (dw)", "cublasSgemm_v2", st);
    }
  }
  if (db) return tp_cuda_bias_grad(s, db, dy, M, N);
  return TP_SUCCESS;
}
