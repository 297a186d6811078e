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
PyObject *device_layer_call(module_state *st, CommObject *co, const char *op, const char *arg, tp_device_t dev,
                            int id, int64_t in_cols, int64_t out_cols, PyObject *x, PyObject *out,
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
