/* Argument checks of the public tensor API (api.c): one context per kernel call that
 * collects the device of its tensors and names the kernel in every error. */
#ifndef TPCORE_KERNELS_API_IMPL_H
#define TPCORE_KERNELS_API_IMPL_H

#include "kernels_impl.h"

typedef struct {
  const char *op;  /* the kernel, as errors name it: "linear_forward" */
  tp_device_t dev; /* the device of the first tensor checked */
  int id, have;    /* its id; whether a tensor fixed the device yet */
} tp_kcall;

#define TP_ANY (-1) /* a dimension the check does not fix */

/* t (NULL: an error unless optional) has dtype dt, ndim dimensions of shape[] (TP_ANY:
 * any size >= 0), C-contiguous, data for its elements, and lives on the call's device. */
tp_status_t tp_karg(tp_kcall *c, const char *name, const tp_tensor *t, int optional, tp_dtype_t dt, int ndim,
                    const int64_t *shape);
/* As tp_karg, but only the last dimension must be contiguous (rows may be strided). */
tp_status_t tp_karg_rows(tp_kcall *c, const char *name, const tp_tensor *t, tp_dtype_t dt, int64_t rows, int64_t cols);
/* The device of raw pointers (attention): fixes the call's device. */
tp_status_t tp_kdevice(tp_kcall *c, const char *name, tp_device_t device, int device_id);
/* A workspace tensor (may be NULL when need is 0): contiguous, on the device, >= need bytes. */
tp_status_t tp_kworkspace(tp_kcall *c, const tp_tensor *ws, size_t need, void **ptr, size_t *nbytes);
/* The kernel table of the call's device (CPU when no tensor fixed it). */
tp_status_t tp_kops(tp_kcall *c, tp_stream_t stream, const tp_kernel_ops **ops);
/* n <= INT_MAX (BLAS dimensions), else an error naming the dimension. */
tp_status_t tp_kblas_dim(tp_kcall *c, const char *what, int64_t n);

#endif
