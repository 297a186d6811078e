/* Argument checks shared by the public kernels (api_impl.h). */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "../devices/device_impl.h"
#include "api_impl.h"

static void shape_str(char *buf, size_t n, int ndim, const int64_t *shape, int wild) {
  size_t at = 0;
  at += (size_t)snprintf(buf + at, n - at, "(");
  for (int i = 0; i < ndim && at < n; i++) {
    if (wild && shape[i] == TP_ANY) at += (size_t)snprintf(buf + at, n - at, "%s*", i ? ", " : "");
    else at += (size_t)snprintf(buf + at, n - at, "%s%lld", i ? ", " : "", (long long)shape[i]);
  }
  if (at < n) snprintf(buf + at, n - at, ndim == 1 ? ",)" : ")");
}

static tp_status_t fix_device(tp_kcall *c, const char *name, tp_device_t d, int id) {
  if (c->have) return TP_SUCCESS;
  if ((unsigned)d >= TP_NUM_DEVICE_TYPES)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s has device %d, which is not a tp_device_t", c->op, name,
                        (int)d);
  if (!tp_device_available(d)) {
    /* the device registry's own sentence: no support compiled in, or no device found */
    tp_device_sync(d, id, NULL);
    const char *why = tp_last_error(), *colon = strstr(why, ": ");
    char buf[200];
    snprintf(buf, sizeof buf, "%s", colon ? colon + 2 : why);
    return tp_set_error(TP_ERR_UNSUPPORTED, "%s: %s is %s memory, but %s", c->op, name, tp_device_name(d), buf);
  }
  if (!tp_kernels_of(d))
    return tp_set_error(TP_ERR_UNSUPPORTED, "%s: %s is %s memory, but this build of tpcore has no %s kernels", c->op,
                        name, tp_device_name(d), tp_device_name(d));
  c->dev = d, c->id = id, c->have = 1;
  return TP_SUCCESS;
}

static tp_status_t common(tp_kcall *c, const char *name, const tp_tensor *t, tp_dtype_t dt, int ndim,
                          const int64_t *shape) {
  if (t->dtype != dt)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s must be %s, got %s", c->op, name, tp_dtype_name(dt),
                        tp_dtype_name(t->dtype));
  if (t->ndim != ndim)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s must have %d dimension%s, got %d", c->op, name, ndim,
                        ndim == 1 ? "" : "s", t->ndim);
  for (int i = 0; i < ndim; i++)
    if (t->shape[i] < 0)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s has a negative dimension (%lld)", c->op, name,
                          (long long)t->shape[i]);
  for (int i = 0; i < ndim; i++)
    if (shape[i] != TP_ANY && t->shape[i] != shape[i]) {
      char want[128], got[128];
      shape_str(want, sizeof want, ndim, shape, 1);
      shape_str(got, sizeof got, ndim, t->shape, 0);
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s has shape %s but must be %s", c->op, name, got, want);
    }
  int64_t n = tp_tensor_numel(t);
  if (n < 0 || n > TP_MAX_NUMEL)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s has too many elements (at most 2^40)", c->op, name);
  if (n > 0 && !t->data) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s has no data (NULL)", c->op, name);
  TP_CHECK(fix_device(c, name, t->device, t->device_id));
  return tp_check_device(c->op, name, t, c->dev, c->id);
}

tp_status_t tp_karg(tp_kcall *c, const char *name, const tp_tensor *t, int optional, tp_dtype_t dt, int ndim,
                    const int64_t *shape) {
  if (!t) return optional ? TP_SUCCESS : tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s is NULL", c->op, name);
  TP_CHECK(common(c, name, t, dt, ndim, shape));
  if (!tp_tensor_is_contiguous(t)) {
    char st[128];
    shape_str(st, sizeof st, t->ndim, t->strides, 0);
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s must be contiguous (C order), got strides %s", c->op, name,
                        st);
  }
  return TP_SUCCESS;
}

tp_status_t tp_karg_rows(tp_kcall *c, const char *name, const tp_tensor *t, tp_dtype_t dt, int64_t rows, int64_t cols) {
  if (!t) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s is NULL", c->op, name);
  const int64_t shape[2] = {rows, cols};
  TP_CHECK(common(c, name, t, dt, 2, shape));
  if ((t->shape[1] > 1 && t->strides[1] != 1) || (t->shape[0] > 1 && t->strides[0] < t->shape[1]))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: %s must have contiguous rows (strides (ld >= %lld, 1)), got "
                        "strides (%lld, %lld)",
                        c->op, name, (long long)t->shape[1], (long long)t->strides[0], (long long)t->strides[1]);
  int64_t span; /* (rows - 1) x row stride + cols: the elements the rows reach, as the kernel indexes them */
  if (t->shape[0] > 1 &&
      (!tp_mul_count(t->shape[0] - 1, t->strides[0], &span) || !tp_add_count(span, t->shape[1], &span)))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s's %lld rows of stride %lld elements reach past 2^63", c->op,
                        name, (long long)t->shape[0], (long long)t->strides[0]);
  return TP_SUCCESS;
}

tp_status_t tp_kdevice(tp_kcall *c, const char *name, tp_device_t device, int device_id) {
  TP_CHECK(fix_device(c, name, device, device_id));
  tp_tensor t = tp_tensor_1d(NULL, TP_UINT8, 0);
  t.device = device, t.device_id = device_id;
  return tp_check_device(c->op, name, &t, c->dev, c->id);
}

tp_status_t tp_kworkspace(tp_kcall *c, const tp_tensor *ws, size_t need, void **ptr, size_t *nbytes) {
  *ptr = NULL, *nbytes = 0;
  if (!ws) {
    if (!need) return TP_SUCCESS;
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: workspace is NULL but the call needs %zu bytes", c->op, need);
  }
  if (ws->ndim < 0 || ws->ndim > TP_MAX_DIMS)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: workspace has %d dimensions (0 to %d)", c->op, ws->ndim,
                        TP_MAX_DIMS);
  int64_t n = tp_tensor_numel(ws);
  size_t es = tp_dtype_size(ws->dtype), bytes;
  if (n < 0 || !es || !tp_mul_size((size_t)n, es, &bytes))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: workspace has an invalid dtype or shape", c->op);
  if (!tp_tensor_is_contiguous(ws))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: workspace must be contiguous", c->op);
  if (bytes && !ws->data) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: workspace has no data (NULL)", c->op);
  TP_CHECK(fix_device(c, "workspace", ws->device, ws->device_id));
  TP_CHECK(tp_check_device(c->op, "workspace", ws, c->dev, c->id));
  if (bytes < need)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: workspace has %zu bytes but the call needs %zu", c->op, bytes,
                        need);
  *ptr = ws->data, *nbytes = bytes;
  return TP_SUCCESS;
}

tp_status_t tp_kops(tp_kcall *c, tp_stream_t stream, const tp_kernel_ops **ops) {
  if (!c->have) TP_CHECK(fix_device(c, "the call", TP_DEVICE_CPU, 0));
  TP_CHECK(tp_check_stream(c->op, c->dev, stream));
  *ops = tp_kernels_of(c->dev);
  if (!*ops) return tp_set_error(TP_ERR_UNSUPPORTED, "%s: no %s kernels in this build", c->op, tp_device_name(c->dev));
  return TP_SUCCESS;
}

tp_status_t tp_kblas_dim(tp_kcall *c, const char *what, int64_t n) {
  if (n > INT_MAX)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s = %lld is above %d (BLAS uses 32-bit dimensions)", c->op, what,
                        (long long)n, INT_MAX);
  return TP_SUCCESS;
}
