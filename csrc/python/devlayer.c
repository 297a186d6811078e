/*
 * devlayer.c: one forward or backward call of a layer that lives on a GPU, shared by
 * the layer types (linear.c, mlp.c).  The input (and out) are tensors on the layer's
 * device, a tpcore.DeviceArray or any DLPack tensor (device_input: another device is
 * an error naming the call, the argument and both devices); the output is a new
 * DeviceArray on that device unless out is given.  The C layer runs with the GIL
 * released, on the device's legacy default stream (DLPack stream 1).
 */
#include "ext.h"

/* One call of a layer on a GPU (see ext.h). */
PyObject *device_layer_call(module_state *st, CommObject *co, const char *op, const char *arg, tp_device_t dev, int id,
                            int64_t in_cols, int64_t out_cols, PyObject *x, PyObject *out,
                            tp_status_t (*fn)(void *layer, const tp_tensor *y, const tp_tensor *x), void *layer,
                            int backward) {
  tp_tensor tx, ty;
  PyObject *kx = NULL, *ky = NULL;
  if (device_input(st, x, op, arg, 0, dev, id, &tx, &kx) < 0) return NULL;
  if (tx.ndim != 2 || tx.shape[1] != in_cols) {
    PyErr_Format(PyExc_ValueError, "%s: %s must have shape (rows, %lld), got %d dimensions with last %lld", op, arg,
                 (long long)in_cols, tx.ndim, tx.ndim ? (long long)tx.shape[tx.ndim - 1] : 0LL);
    Py_DECREF(kx);
    return NULL;
  }
  int64_t M = tx.shape[0], shape[2] = {M, out_cols};
  if (out != Py_None) {
    if (device_input(st, out, op, "out", 1, dev, id, &ty, &ky) < 0) {
      Py_DECREF(kx);
      return NULL;
    }
    if (ty.ndim != 2 || ty.shape[0] != M || ty.shape[1] != out_cols || ty.dtype != tx.dtype) {
      PyErr_Format(PyExc_ValueError, "%s: out must be a %s array of shape (%lld, %lld)", op, tp_dtype_name(tx.dtype),
                   (long long)M, (long long)out_cols);
      Py_DECREF(kx);
      Py_DECREF(ky);
      return NULL;
    }
  } else {
    ky = devarray_empty(st, dev, id, tx.dtype, 2, shape);
    if (!ky) {
      Py_DECREF(kx);
      return NULL;
    }
    ty = *devarray_tensor(st, ky);
  }
  tp_status_t s;
  COMM_CALL(co, s, ((void)c_, fn(layer, &ty, &tx)));
  Py_DECREF(kx);
  if (s != TP_SUCCESS) {
    Py_DECREF(ky);
    return layer_error(co, s, op, backward);
  }
  if (out != Py_None) {
    Py_DECREF(ky);
    return Py_NewRef(out);
  }
  return ky;
}

/* x's tensor checked: dtype dt, ndim dimensions, and shape[i] where shape[i] >= 0 (a
 * ValueError / TypeError naming the call and the argument). */
int device_check(const tp_tensor *t, const char *op, const char *arg, tp_dtype_t dt, int ndim, const int64_t *shape) {
  if (t->dtype != dt) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be %s, got %s", op, arg, tp_dtype_name(dt), tp_dtype_name(t->dtype));
    return -1;
  }
  int ok = t->ndim == ndim;
  for (int i = 0; ok && shape && i < ndim; i++) ok = shape[i] < 0 || t->shape[i] == shape[i];
  if (!ok) {
    char want[160] = "", have[160] = "";
    for (int i = 0; i < ndim; i++) {
      size_t l = strlen(want);
      if (shape && shape[i] >= 0) snprintf(want + l, sizeof want - l, "%s%lld", i ? ", " : "", (long long)shape[i]);
      else snprintf(want + l, sizeof want - l, "%s_", i ? ", " : "");
    }
    for (int i = 0; i < t->ndim && i < TP_MAX_DIMS; i++) {
      size_t l = strlen(have);
      snprintf(have + l, sizeof have - l, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    }
    PyErr_Format(PyExc_ValueError, "%s: %s must have shape (%s), got (%s)", op, arg, want, have);
    return -1;
  }
  return 0;
}

/* out (a writable tensor on (dev, id) of dtype dt and this shape) or, for None, a new
 * DeviceArray there: *t its tensor, *keep a new reference (the array to return). */
int device_output(module_state *st, PyObject *out, const char *op, tp_device_t dev, int id, tp_dtype_t dt, int ndim,
                  const int64_t *shape, tp_tensor *t, PyObject **keep) {
  if (out == Py_None) {
    *keep = devarray_empty(st, dev, id, dt, ndim, shape);
    if (!*keep) return -1;
    *t = *devarray_tensor(st, *keep);
    return 0;
  }
  if (device_input(st, out, op, "out", 1, dev, id, t, keep) < 0) return -1;
  if (device_check(t, op, "out", dt, ndim, shape) < 0) {
    Py_CLEAR(*keep);
    return -1;
  }
  return 0;
}

/* A parameter of a GPU layer (float32, 1-D of d0 or 2-D d0 x d1): a DeviceArray view
 * of the layer's memory, kept alive by owner; None for NULL. */
PyObject *device_param_view(module_state *st, PyObject *owner, float *p, int nd, int64_t d0, int64_t d1,
                            tp_device_t dev, int id) {
  return device_param_view_dt(st, owner, p, TP_FLOAT32, nd, d0, d1, dev, id);
}

PyObject *device_param_view_dt(module_state *st, PyObject *owner, void *p, tp_dtype_t dt, int nd, int64_t d0,
                               int64_t d1, tp_device_t dev, int id) {
  if (!p) Py_RETURN_NONE;
  size_t rb;
  if (tp_weight_is_quantized(dt) && nd == 2 && tp_weight_row_bytes(dt, d1, &rb)) /* raw rows: uint8 [d0, bytes] */
    dt = TP_UINT8, d1 = (int64_t)rb;
  int64_t shape[2] = {d0, d1};
  tp_tensor t = tp_tensor_nd(p, dt, nd, shape);
  t.device = dev;
  t.device_id = id;
  return devarray_wrap(st, &t, owner, 0);
}
