// The cuBLAS the emulated entries see (run.sh): tp_cublas_get hands out a table whose GemmEx
// is a plain column-major GEMM on the host, in double, that honours transa / transb, m, n, k,
// lda / ldb / ldc, alpha / beta (beta = 0: C is not read) and widens bfloat16 / float16 /
// float32 operands (core/dtype.c, not lowp.cu's own conversions).  It refuses what real
// cuBLAS refuses (a leading dimension below the rows it covers, a negative size, an unknown
// type, operation or compute type) with CUBLAS_STATUS_INVALID_VALUE / NOT_SUPPORTED, so an
// entry's argument plumbing is checked, not only its numbers.  The other functions of the
// table are absent (NULL): no emulated entry calls them.
#include <algorithm>

#include "cublas_api.emu.h"
#include "cuda_impl.h"

namespace {
enum { INVALID_VALUE = 7, NOT_SUPPORTED = 15 };
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

cublasStatus_t gemm_ex(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                       const void *alpha, const void *A, int at, int lda, const void *B, int bt, int ldb,
                       const void *beta, void *C, int ct, int ldc, int compute, int algo) {
  if (h != fake_handle) return 1; /* CUBLAS_STATUS_NOT_INITIALIZED */
  if ((ta != TP_CUBLAS_OP_N && ta != TP_CUBLAS_OP_T) || (tb != TP_CUBLAS_OP_N && tb != TP_CUBLAS_OP_T) || m < 0 ||
      n < 0 || k < 0 || lda < std::max(1, ta ? k : m) || ldb < std::max(1, tb ? n : k) || ldc < std::max(1, m) ||
      !alpha || !beta)
    return INVALID_VALUE;
  /* float32 compute with float32 scalars: A and B of one type, C float32 (the pairs the
   * low-precision entries use; cuBLAS has more) */
  if (!known_type(at) || at != bt || ct != TP_CUDA_R_32F || compute != TP_CUBLAS_COMPUTE_32F ||
      algo != TP_CUBLAS_GEMM_DEFAULT)
    return NOT_SUPPORTED;
  if (m == 0 || n == 0) return 0;
  double a = *(const float *)alpha, b = *(const float *)beta;
  float *c = (float *)C;
  for (int j = 0; j < n; j++)
    for (int i = 0; i < m; i++) {
      double s = 0;
      for (int l = 0; l < k; l++)
        s += widen(A, at, ta ? l + (int64_t)i * lda : i + (int64_t)l * lda) *
             widen(B, bt, tb ? j + (int64_t)l * ldb : l + (int64_t)j * ldb);
      float *cij = c + i + (int64_t)j * ldc;
      *cij = (float)(a * s + (b == 0 ? 0.0 : b * *cij));
    }
  return 0;
}

const char *status_string(cublasStatus_t st) { return st == INVALID_VALUE ? "emulated invalid value" : "emulated"; }

tp_cublas_api emu_api() {
  tp_cublas_api a = {};
  a.GetStatusString = status_string;
  a.GemmEx = gemm_ex;
  return a;
}
}  // namespace

extern "C" tp_status_t tp_cublas_get(const char *op, tp_stream_t s, const tp_cublas_api **api,
                                     cublasHandle_t *handle) {
  static const tp_cublas_api a = emu_api();
  (void)op, (void)s;
  *api = &a;
  *handle = fake_handle;
  return TP_SUCCESS;
}

extern "C" tp_status_t tp_cublas_error(const char *op, const char *fn, cublasStatus_t st) {
  return tp_set_error(TP_ERR_SYSTEM, "%s: %s failed: %s (cuBLAS status %d)", op, fn, status_string(st), (int)st);
}
