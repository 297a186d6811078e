/* Our own minimal declarations of the cuBLAS functions, enums and handle types the
 * CUDA kernel table uses (private).  The toolkit that builds tpcore need not have
 * cuBLAS (cublas_v2.h): the library is opened at run time (cublas.cu) and these are
 * the C ABI of libcublas.so.12 / .13 as documented by NVIDIA (enums are C ints).
 * Only the _v2 entry points, whose signatures have been stable since CUDA 4. */
#ifndef TPCORE_KERNELS_CUDA_CUBLAS_API_H
#define TPCORE_KERNELS_CUDA_CUBLAS_API_H

#include <cuda_runtime.h>

#include "tpcore/tpcore.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cublasContext *cublasHandle_t;
typedef int cublasStatus_t;    /* cublasStatus_t: 0 = CUBLAS_STATUS_SUCCESS */
typedef int cublasOperation_t; /* CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 */
#define TP_CUBLAS_STATUS_SUCCESS 0
#define TP_CUBLAS_OP_N 0
#define TP_CUBLAS_OP_T 1
/* libraryPropertyType (library_types.h) */
#define TP_CUDA_LIB_MAJOR_VERSION 0
#define TP_CUDA_LIB_MINOR_VERSION 1
#define TP_CUDA_LIB_PATCH_LEVEL 2
/* cudaDataType_t (library_types.h), cublasComputeType_t and cublasGemmAlgo_t (cublas_api.h),
 * for cublasGemmEx: the 16-bit operands of the low-precision linear entries (lowp.cu) with
 * float32 output and float32 compute (products and sums in float32 on the tensor cores). */
#define TP_CUDA_R_32F 0
#define TP_CUDA_R_16F 2
#define TP_CUDA_R_16BF 14
#define TP_CUBLAS_COMPUTE_32F 68
#define TP_CUBLAS_GEMM_DEFAULT (-1)

/* The oldest cuBLAS this build accepts (the sonames searched are .13, .12, .so). */
#define TP_CUBLAS_MIN_MAJOR 12

typedef struct tp_cublas_api {
  cublasStatus_t (*Create)(cublasHandle_t *handle);                        /* cublasCreate_v2 */
  cublasStatus_t (*Destroy)(cublasHandle_t handle);                        /* cublasDestroy_v2 */
  cublasStatus_t (*SetStream)(cublasHandle_t handle, cudaStream_t stream); /* cublasSetStream_v2 */
  cublasStatus_t (*GetProperty)(int type, int *value);                     /* cublasGetProperty */
  const char *(*GetStatusString)(cublasStatus_t status);                   /* cublasGetStatusString (may be NULL) */
  cublasStatus_t (*Sgemm)(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                          int k, const float *alpha, const float *A, int lda, const float *B, int ldb,
                          const float *beta, float *C, int ldc); /* cublasSgemm_v2 (column-major) */
  cublasStatus_t (*Sgemv)(cublasHandle_t handle, cublasOperation_t trans, int m, int n, const float *alpha,
                          const float *A, int lda, const float *x, int incx, const float *beta, float *y,
                          int incy); /* cublasSgemv_v2 */
  /* cublasGemmEx (column-major; Atype, Btype, Ctype: cudaDataType_t; computeType:
   * cublasComputeType_t; algo: cublasGemmAlgo_t, all C ints) */
  cublasStatus_t (*GemmEx)(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                           int k, const void *alpha, const void *A, int Atype, int lda, const void *B, int Btype,
                           int ldb, const void *beta, void *C, int Ctype, int ldc, int computeType, int algo);
} tp_cublas_api;

/* The cuBLAS functions and this thread's handle for the current device, bound to
 * stream s (cublasSetStream per call).  Opens cuBLAS on first use (tp_dynlib_open
 * "cuBLAS", TPCORE_CUBLAS_LIBRARY, libcublas.so.13 / .12 / .so) and checks its version;
 * on failure sets the error, prefixed by `op`, and returns it. */
tp_status_t tp_cublas_get(const char *op, tp_stream_t s, const tp_cublas_api **api, cublasHandle_t *handle);
/* A failed cuBLAS call as this thread's error: "<op>: <fn> failed: <status string> (<code>)". */
tp_status_t tp_cublas_error(const char *op, const char *fn, cublasStatus_t st);

#ifdef __cplusplus
}
#endif
#endif
