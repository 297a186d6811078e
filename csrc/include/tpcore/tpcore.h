/*
 * tpcore public C API: status codes, dtypes, tensor view, version.
 *
 * This header (and the others in include/tpcore/) never includes Python or CUDA
 * headers: a C program can link the core with nothing else.
 *
 * Conventions (after NCCL): every public call returns a tp_status_t; outputs go
 * through pointers.  On failure the calling thread's last-error buffer holds one
 * sentence naming the operation, the argument or rank involved, and the cause
 * (tp_last_error()).  Library code never exits or aborts the process.
 */
#ifndef TPCORE_TPCORE_H
#define TPCORE_TPCORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define TP_API __attribute__((visibility("default")))
#else
#define TP_API
#endif

#define TP_VERSION_MAJOR 0
#define TP_VERSION_MINOR 1
#define TP_VERSION_PATCH 0
#define TP_VERSION (TP_VERSION_MAJOR * 10000 + TP_VERSION_MINOR * 100 + TP_VERSION_PATCH)

/* Closed set of results; values are append-only. */
typedef enum {
  TP_SUCCESS = 0,
  TP_ERR_INVALID_ARGUMENT = 1, /* a bad pointer, size, dtype, op, root, peer ...        */
  TP_ERR_INVALID_USAGE = 2,    /* a call that is wrong in this state (closed comm, ...)  */
  TP_ERR_SYSTEM = 3,           /* an OS call failed (shm_open, mmap, ...)               */
  TP_ERR_TIMEOUT = 4,          /* a wait ran past the communicator's timeout            */
  TP_ERR_REMOTE = 5,           /* another rank failed, aborted or died                  */
  TP_ERR_MISMATCH = 6,         /* ranks called different collectives / counts / dtypes  */
  TP_ERR_ABORTED = 7,          /* this communicator was aborted earlier                 */
  TP_ERR_NOMEM = 8,            /* an allocation failed                                  */
  TP_ERR_UNSUPPORTED = 9,      /* not available in this build or on this backend       */
  TP_ERR_INTERNAL = 10,        /* a bug in tpcore: please report it                     */
  TP_IN_PROGRESS = 11          /* an asynchronous operation has not finished yet         */
} tp_status_t;

TP_API const char *tp_status_name(tp_status_t status);
/* The sentence that describes the calling thread's last failure ("" if none). */
TP_API const char *tp_last_error(void);
/* The status recorded with that sentence. */
TP_API tp_status_t tp_last_status(void);

/* Element types; values are append-only. float16/bfloat16 are reduced in float32. */
typedef enum {
  TP_FLOAT32 = 0,
  TP_FLOAT64 = 1,
  TP_FLOAT16 = 2,
  TP_BFLOAT16 = 3,
  TP_INT8 = 4,
  TP_UINT8 = 5,
  TP_INT32 = 6,
  TP_INT64 = 7,
  TP_NUM_DTYPES = 8,
  /* Weight-only storage formats (a layer's weight_dtype; never a tensor's or a collective's
   * dtype): llama.cpp's GGUF block formats, bit for bit.  A row of n elements is n / block
   * blocks (tp_weight_format); activations and arithmetic stay float32.  TP_INT8 as a
   * weight_dtype is int8 with one float32 scale per output row (see tp_weight_format). */
  TP_Q8_0 = 16, /* 32 elements: float16 d, int8 q[32]; x = d q                            */
  TP_Q4_0 = 17, /* 32 elements: float16 d, 16 bytes of nibbles; x = d (q - 8)              */
  TP_Q4_1 = 18, /* 32 elements: float16 d, float16 m, 16 bytes of nibbles; x = d q + m     */
  TP_Q4_K = 19, /* 256 elements: 8 sub-blocks of 32 with 6-bit scales and mins, 4-bit q     */
  TP_Q5_K = 20, /* 256 elements: as Q4_K with a fifth bit per element                       */
  TP_Q6_K = 21, /* 256 elements: 16 sub-blocks of 16 with int8 scales, 6-bit q              */
  TP_WEIGHT_FORMAT_END = 22
} tp_dtype_t;

TP_API size_t tp_dtype_size(tp_dtype_t dtype);                      /* 0 for an invalid dtype        */
TP_API const char *tp_dtype_name(tp_dtype_t dtype);                 /* "float32", ..., "invalid"     */
TP_API int tp_dtype_from_name(const char *name, tp_dtype_t *dtype); /* 1 if known      */
/* A weight storage format (weight_dtype): 1 when f is one (float32, bfloat16, float16,
 * int8 or a TP_Q* block format), with the elements and bytes of its block and the bytes of
 * the header that starts every row (int8: its float32 scale; 0 otherwise).  A row of n
 * elements takes header + n / block * block_bytes bytes; n must be a multiple of block. */
TP_API int tp_weight_format(tp_dtype_t f, int64_t *block, size_t *block_bytes, size_t *row_header);
/* Bytes of a row of n elements of format f: 1 on success, 0 when f is no weight format, n < 0,
 * n is not a multiple of the block, or the size overflows. */
TP_API int tp_weight_row_bytes(tp_dtype_t f, int64_t n, size_t *bytes);
/* Block formats (TP_Q*, int8 rows): quantized, frozen (no weight gradient) in the layers. */
TP_API int tp_weight_is_quantized(tp_dtype_t f);

/* float16 / bfloat16 <-> float32 conversions (round to nearest even). */
TP_API float tp_half_to_float(uint16_t h);
TP_API uint16_t tp_float_to_half(float f);
TP_API float tp_bf16_to_float(uint16_t b);
TP_API uint16_t tp_float_to_bf16(float f);

/* Where memory lives.  Values are append-only; TP_NUM_DEVICE_TYPES bounds the device table. */
typedef enum { TP_DEVICE_CPU = 0, TP_DEVICE_CUDA = 1, TP_NUM_DEVICE_TYPES = 2 } tp_device_t;

TP_API const char *tp_device_name(tp_device_t device); /* "cpu", "cuda", "invalid" */

/* An ordered queue of work on one device (a cudaStream_t on CUDA), after NCCL's
 * ncclAllReduce(..., stream).  Every collective, kernel and layer call takes one.
 * NULL is the device's default stream; on the CPU every call is synchronous and
 * NULL is the only stream (another is refused, naming the call): the call has finished
 * when it returns. */
typedef struct tp_stream *tp_stream_t;

#define TP_MAX_DIMS 8

/* A strided view of memory owned elsewhere: the currency between the extension,
 * layers, kernels and communicators.  Strides are in elements. */
typedef struct {
  void *data;
  tp_dtype_t dtype;
  int ndim;
  int64_t shape[TP_MAX_DIMS];
  int64_t strides[TP_MAX_DIMS];
  tp_device_t device;
  int device_id;
} tp_tensor;

/* -1: ndim outside [0, TP_MAX_DIMS], a negative dimension, or past int64 */
TP_API int64_t tp_tensor_numel(const tp_tensor *t);
TP_API int tp_tensor_is_contiguous(const tp_tensor *t); /* 0 also for ndim outside [0, TP_MAX_DIMS] */

/* A C-contiguous view of host memory: tp_tensor_2d(x, TP_FLOAT32, M, K). */
static inline tp_tensor tp_tensor_nd(void *data, tp_dtype_t dtype, int ndim, const int64_t *shape) {
  tp_tensor t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = ndim < 0 ? 0 : (ndim > TP_MAX_DIMS ? TP_MAX_DIMS : ndim);
  t.device = TP_DEVICE_CPU;
  t.device_id = 0;
  int64_t stride = 1;
  for (int i = TP_MAX_DIMS - 1; i >= 0; i--) {
    t.shape[i] = i < t.ndim ? shape[i] : 0;
    t.strides[i] = i < t.ndim ? stride : 0;
    if (i < t.ndim) { /* saturates past int64 (no signed overflow): tp_tensor_numel then says -1 */
      int64_t d = shape[i] > 0 ? shape[i] : 1;
      stride = stride > INT64_MAX / d ? INT64_MAX : stride * d;
    }
  }
  return t;
}
static inline tp_tensor tp_tensor_1d(void *data, tp_dtype_t dtype, int64_t n) {
  return tp_tensor_nd(data, dtype, 1, &n);
}
static inline tp_tensor tp_tensor_2d(void *data, tp_dtype_t dtype, int64_t rows, int64_t cols) {
  int64_t shape[2] = {rows, cols};
  return tp_tensor_nd(data, dtype, 2, shape);
}

/* Monotonic clock in seconds. */
TP_API double tp_now(void);

#ifdef __cplusplus
}
#endif
#endif /* TPCORE_TPCORE_H */
