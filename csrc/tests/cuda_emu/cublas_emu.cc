// The cuBLAS the emulated entries see (run.sh): tp_cublas_get hands out a table of the three
// functions the kernel table calls, each a plain column-major product on the host in double:
//   Sgemm   C = alpha op(A) op(B) + beta C, float32 (linear.cu: gemm, linear_forward / backward)
//   Sgemv   y = alpha op(A) x + beta y, float32, strides incx / incy (linear_forward, M = 1)
//   GemmEx  as Sgemm with bfloat16 / float16 / float32 operands widened (core/dtype.c, not
//           lowp.cu's own conversions), float32 C, CUBLAS_COMPUTE_32F (lowp.cu)
// Each honours transa / transb, m, n, k, the leading dimensions, alpha / beta (beta = 0: C or y
// is not read) and refuses what real cuBLAS refuses (a leading dimension below the rows it
// covers, a negative size, a zero stride, an unknown type, operation or compute type, a NULL
// scalar) with CUBLAS_STATUS_INVALID_VALUE / NOT_SUPPORTED, so an entry's argument plumbing is
// checked, not only its numbers.  Create / Destroy / SetStream / GetProperty are absent (NULL):
// they belong to cublas.cu, which the emulator replaces with this file.
#include <algorithm>
#include <vector>

#include "cublas_api.emu.h"
#include "cuda_impl.h"

namespace {
enum { NOT_INITIALIZED = 1, INVALID_VALUE = 7, NOT_SUPPORTED = 15 };
char handle_storage;
cublasContext *const fake_handle = reinterpret_cast<cublasContext *>(&handle_storage);

double widen(const void *p, int type, int64_t i) {
  switch (type) {
    case TP_CUDA_R_32F: return ((const float *)p)[i];
    case TP_CUDA_R_16BF: return tp_bf16_to_float(((const uint16_t *)p)[i]);
    default: return tp_half_to_float(((const uint16_t *)p)[i]);
  }
}

bool known_type(int t) { return t == TP_CUDA_R_32F || t == TP_CUDA_R_16F || t == TP_CUDA_R_16BF; }
bool known_op(cublasOperation_t o) { return o == TP_CUBLAS_OP_N || o == TP_CUBLAS_OP_T; }

// op(X) of a column-major X with leading dimension ld, rows x cols after op, widened to double
// and stored row-major (element (i, l) at i * cols + l).
std::vector<double> take(const void *X, int type, cublasOperation_t op, int rows, int cols, int ld) {
  std::vector<double> r((size_t)rows * cols);
  for (int i = 0; i < rows; i++)
    for (int l = 0; l < cols; l++)
      r[(size_t)i * cols + l] = widen(X, type, op ? l + (int64_t)i * ld : i + (int64_t)l * ld);
  return r;
}

// C (m x n, ldc, float32) = alpha op(A) op(B) + beta C, the arguments already checked
void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, double alpha, const void *A, int at, int lda,
          const void *B, int bt, int ldb, double beta, float *C, int ldc) {
  if (m == 0 || n == 0) return;
  std::vector<double> a = take(A, at, ta, m, k, lda), bT = take(B, bt, tb ? TP_CUBLAS_OP_N : TP_CUBLAS_OP_T, n, k, ldb);
  for (int j = 0; j < n; j++)
    for (int i = 0; i < m; i++) {
      double s = 0;
      const double *ai = a.data() + (size_t)i * k, *bj = bT.data() + (size_t)j * k;
      for (int l = 0; l < k; l++) s += ai[l] * bj[l];
      float *cij = C + i + (int64_t)j * ldc;
      *cij = (float)(alpha * s + (beta == 0 ? 0.0 : beta * *cij));
    }
}

bool bad_gemm_args(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, int lda, int ldb, int ldc,
                   const void *alpha, const void *beta) {
  return !known_op(ta) || !known_op(tb) || m < 0 || n < 0 || k < 0 || lda < std::max(1, ta ? k : m) ||
         ldb < std::max(1, tb ? n : k) || ldc < std::max(1, m) || !alpha || !beta;
}

cublasStatus_t sgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                     const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta, float *C,
                     int ldc) {
  if (h != fake_handle) return NOT_INITIALIZED;
  if (bad_gemm_args(ta, tb, m, n, k, lda, ldb, ldc, alpha, beta)) return INVALID_VALUE;
  gemm(ta, tb, m, n, k, *alpha, A, TP_CUDA_R_32F, lda, B, TP_CUDA_R_32F, ldb, *beta, C, ldc);
  return 0;
}

cublasStatus_t sgemv(cublasHandle_t h, cublasOperation_t t, int m, int n, const float *alpha, const float *A, int lda,
                     const float *x, int incx, const float *beta, float *y, int incy) {
  if (h != fake_handle) return NOT_INITIALIZED;
  if (!known_op(t) || m < 0 || n < 0 || lda < std::max(1, m) || incx == 0 || incy == 0 || !alpha || !beta)
    return INVALID_VALUE;
  int ny = t ? n : m, nx = t ? m : n; /* op(A) is ny x nx */
  if (ny == 0) return 0;
  /* BLAS: a negative stride walks the vector from its end */
  for (int i = 0; i < ny; i++) {
    double s = 0;
    for (int l = 0; l < nx; l++) {
      double a = t ? A[l + (int64_t)i * lda] : A[i + (int64_t)l * lda];
      s += a * x[(incx > 0 ? l : l - (nx - 1)) * (int64_t)incx];
    }
    float *yi = y + (incy > 0 ? i : i - (ny - 1)) * (int64_t)incy;
    *yi = (float)(*alpha * s + (*beta == 0 ? 0.0 : (double)*beta * *yi));
  }
  return 0;
}

cublasStatus_t gemm_ex(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                       const void *alpha, const void *A, int at, int lda, const void *B, int bt, int ldb,
                       const void *beta, void *C, int ct, int ldc, int compute, int algo) {
  if (h != fake_handle) return NOT_INITIALIZED;
  if (bad_gemm_args(ta, tb, m, n, k, lda, ldb, ldc, alpha, beta)) return INVALID_VALUE;
  /* float32 compute with float32 scalars: A and B of one type, C float32 (the pairs the
   * low-precision entries use; cuBLAS has more) */
  if (!known_type(at) || at != bt || ct != TP_CUDA_R_32F || compute != TP_CUBLAS_COMPUTE_32F ||
      algo != TP_CUBLAS_GEMM_DEFAULT)
    return NOT_SUPPORTED;
  gemm(ta, tb, m, n, k, *(const float *)alpha, A, at, lda, B, bt, ldb, *(const float *)beta, (float *)C, ldc);
  return 0;
}

const char *status_string(cublasStatus_t st) {
  return st == INVALID_VALUE ? "emulated invalid value" : st == NOT_SUPPORTED ? "emulated not supported" : "emulated";
}

tp_cublas_api emu_api() {
  tp_cublas_api a = {};
  a.GetStatusString = status_string;
  a.Sgemm = sgemm;
  a.Sgemv = sgemv;
  a.GemmEx = gemm_ex;
  return a;
}
} // namespace

extern "C" tp_status_t tp_cublas_get(const char *op, tp_stream_t s, const tp_cublas_api **api, cublasHandle_t *handle) {
  static const tp_cublas_api a = emu_api();
  (void)op, (void)s;
  *api = &a;
  *handle = fake_handle;
  return TP_SUCCESS;
}

extern "C" tp_status_t tp_cublas_error(const char *op, const char *fn, cublasStatus_t st) {
  return tp_set_error(TP_ERR_SYSTEM, "%s: %s failed: %s (cuBLAS status %d)", op, fn, status_string(st), (int)st);
}
