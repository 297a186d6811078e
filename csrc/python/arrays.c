/*
 * arrays.c: NumPy arrays in and out of the extension.  In: get_host_buf checks that
 * an argument is a NumPy array the core can use (dtype, C-contiguity, alignment,
 * writability) and names the op and the argument when it is not; get_buf takes a
 * tpcore.DeviceArray of any device as well (the collectives: the C dispatcher stages
 * device memory a backend cannot take); get_tensor adds a tp_tensor view for the C
 * API's tensor calls; matrix_arg and tokens_arg check the (host) shapes the layers take.  Out: owned_view hands out a view of
 * C-owned memory that keeps its owner alive.
 */
#include "ext.h"

/* ml_dtypes' bfloat16 (and any other extension dtype of that name). */
static int is_bfloat16(PyArray_Descr *d) {
  if (PyDataType_ELSIZE(d) != 2 || !d->typeobj) return 0;
  const char *name = d->typeobj->tp_name, *dot = strrchr(name, '.');
  return strcmp(dot ? dot + 1 : name, "bfloat16") == 0;
}

int descr_dtype(PyArray_Descr *d, tp_dtype_t *out) {
  char kind = d->kind;
  int size = (int)PyDataType_ELSIZE(d);
  if (d->byteorder == '>') return 0;
  if (kind == 'f' && size == 4) *out = TP_FLOAT32;
  else if (kind == 'f' && size == 8) *out = TP_FLOAT64;
  else if (kind == 'f' && size == 2) *out = TP_FLOAT16;
  else if (kind == 'i' && size == 1) *out = TP_INT8;
  else if (kind == 'u' && size == 1) *out = TP_UINT8;
  else if (kind == 'i' && size == 4) *out = TP_INT32;
  else if (kind == 'i' && size == 8) *out = TP_INT64;
  else if (is_bfloat16(d)) *out = TP_BFLOAT16;
  else return 0;
  return 1;
}

/* The read-only refusal, worded the same for NumPy arrays and DeviceArrays; -1. */
int buf_readonly_error(const char *op, const char *arg) {
  if (strcmp(arg, "x") == 0)
    PyErr_Format(PyExc_ValueError,
                 "%s: x is read-only, but the in-place operation writes into it; pass out= to get "
                 "the result elsewhere",
                 op);
  else PyErr_Format(PyExc_ValueError, "%s: %s is read-only but the operation writes into it", op, arg);
  return -1;
}

/* Checks that obj is a NumPy array this op can use; fills b (device CPU).  `writable`:
 * the op writes into it.  Errors name the op and the argument. */
int get_host_buf(PyObject *obj, const char *op, const char *arg, int writable, buf_t *b) {
  if (!PyArray_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be a NumPy array (or a CPU tensor with __dlpack__), got %s", op, arg,
                 Py_TYPE(obj)->tp_name);
    return -1;
  }
  PyArrayObject *a = (PyArrayObject *)obj;
  PyArray_Descr *d = PyArray_DESCR(a);
  if (!descr_dtype(d, &b->dtype)) {
    PyObject *s = PyObject_Str((PyObject *)d);
    PyErr_Format(PyExc_TypeError,
                 "%s: %s has dtype %s; expected one of float32, float64, float16, bfloat16, int8, "
                 "uint8, int32, int64 (native byte order)",
                 op, arg, s ? PyUnicode_AsUTF8(s) : "?");
    Py_XDECREF(s);
    return -1;
  }
  if (!PyArray_IS_C_CONTIGUOUS(a)) {
    PyObject *strides = PyObject_GetAttrString(obj, "strides");
    PyObject *shape = PyObject_GetAttrString(obj, "shape");
    PyObject *s1 = strides ? PyObject_Str(strides) : NULL, *s2 = shape ? PyObject_Str(shape) : NULL;
    PyErr_Format(PyExc_ValueError,
                 "%s: %s must be C-contiguous, got shape %s with strides %s; pass "
                 "numpy.ascontiguousarray(%s)",
                 op, arg, s2 ? PyUnicode_AsUTF8(s2) : "?", s1 ? PyUnicode_AsUTF8(s1) : "?", arg);
    Py_XDECREF(strides);
    Py_XDECREF(shape);
    Py_XDECREF(s1);
    Py_XDECREF(s2);
    return -1;
  }
  if (!PyArray_ISALIGNED(a)) {
    PyErr_Format(PyExc_ValueError, "%s: %s is not aligned to its element size", op, arg);
    return -1;
  }
  if (writable && !PyArray_ISWRITEABLE(a)) return buf_readonly_error(op, arg);
  b->data = PyArray_DATA(a);
  b->count = (size_t)PyArray_SIZE(a);
  b->device = TP_DEVICE_CPU;
  b->device_id = 0;
  return 0;
}

/* A DeviceArray's buffer (1 when obj is not one; -1 with an exception). */
static int devarray_buf(PyObject *obj, const char *op, const char *arg, int writable, buf_t *b) {
  int readonly;
  const tp_tensor *t = devarray_peek(obj, &readonly);
  if (!t) return 1;
  if (writable && readonly) return buf_readonly_error(op, arg);
  static char empty[16] __attribute__((aligned(16))); /* an empty array's data: never read */
  int64_t n = tp_tensor_numel(t);
  b->data = t->data ? t->data : (void *)empty;
  b->count = n > 0 ? (size_t)n : 0;
  b->dtype = t->dtype;
  b->device = t->device;
  b->device_id = t->device_id;
  return 0;
}

/* get_host_buf, and a tpcore.DeviceArray of any device (devarray_buf: its data
 * pointer, element count, dtype and device; its read-only flag refused for a
 * written argument with NumPy's wording).  NumPy first: its cost is unchanged. */
int get_buf(PyObject *obj, const char *op, const char *arg, int writable, buf_t *b) {
  if (PyArray_Check(obj)) return get_host_buf(obj, op, arg, writable, b);
  int r = devarray_buf(obj, op, arg, writable, b);
  if (r <= 0) return r;
  PyErr_Format(PyExc_TypeError,
               "%s: %s must be a NumPy array or a tpcore.DeviceArray (or a tensor with "
               "__dlpack__), got %s",
               op, arg, Py_TYPE(obj)->tp_name);
  return -1;
}

int get_tensor(PyObject *obj, const char *op, const char *arg, int writable, tp_tensor *t) {
  buf_t b;
  if (!PyArray_Check(obj)) { /* a DeviceArray: its own tensor view (any device) */
    int r = devarray_buf(obj, op, arg, writable, &b);
    if (r == 0) {
      int ro;
      *t = *devarray_peek(obj, &ro);
      return 0;
    }
    if (r < 0) return -1;
  }
  if (get_host_buf(obj, op, arg, writable, &b) < 0) return -1;
  if (PyArray_NDIM((PyArrayObject *)obj) > TP_MAX_DIMS) {
    PyErr_Format(PyExc_ValueError, "%s: %s has %d dimensions; at most %d are supported", op, arg,
                 PyArray_NDIM((PyArrayObject *)obj), TP_MAX_DIMS);
    return -1;
  }
  *t = array_tensor(obj, &b);
  return 0;
}

/* x as a float32 2-D C-contiguous array with `cols` columns; rows out. */
int matrix_arg(PyObject *x, const char *op, const char *arg, int64_t cols, int64_t *rows) {
  buf_t b;
  if (get_host_buf(x, op, arg, 0, &b) < 0) return -1;
  PyArrayObject *a = (PyArrayObject *)x;
  if (b.dtype != TP_FLOAT32) {
    PyErr_Format(PyExc_TypeError, "%s: %s has dtype %s; expected float32", op, arg, tp_dtype_name(b.dtype));
    return -1;
  }
  if (PyArray_NDIM(a) != 2 || PyArray_DIM(a, 1) != cols) {
    PyErr_Format(PyExc_ValueError, "%s: %s must have shape (rows, %lld), got %d dimensions with last %lld", op, arg,
                 (long long)cols, PyArray_NDIM(a),
                 PyArray_NDIM(a) ? (long long)PyArray_DIM(a, PyArray_NDIM(a) - 1) : 0LL);
    return -1;
  }
  *rows = PyArray_DIM(a, 0);
  return 0;
}

/* tokens: a 1-D C-contiguous int64 array; its length out. */
int tokens_arg(PyObject *t, const char *op, const char *arg, int64_t *n) {
  buf_t b;
  if (get_host_buf(t, op, arg, 0, &b) < 0) return -1;
  if (b.dtype != TP_INT64 || PyArray_NDIM((PyArrayObject *)t) != 1) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be a 1-D int64 array", op, arg);
    return -1;
  }
  *n = (int64_t)b.count;
  return 0;
}

/* A NumPy view of a C-owned array that keeps its owner (a layer object) alive. */
PyObject *owned_view(PyObject *self, float *p, int nd, int64_t d0, int64_t d1) {
  return owned_view_dt(self, p, TP_FLOAT32, nd, d0, d1);
}

PyObject *owned_view_dt(PyObject *self, void *p, tp_dtype_t dt, int nd, int64_t d0, int64_t d1) {
  if (!p) Py_RETURN_NONE;
  size_t rb;
  if (tp_weight_is_quantized(dt) && nd == 2 && tp_weight_row_bytes(dt, d1, &rb)) /* raw rows: uint8 [d0, bytes] */
    dt = TP_UINT8, d1 = (int64_t)rb;
  npy_intp dims[2] = {(npy_intp)d0, (npy_intp)d1};
  PyArray_Descr *descr = numpy_descr(dt); /* a new reference, stolen below */
  if (!descr) return NULL;
  PyObject *a = PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims, NULL, p, NPY_ARRAY_CARRAY, NULL);
  if (!a) return NULL;
  Py_INCREF(self);
  if (PyArray_SetBaseObject((PyArrayObject *)a, self) < 0) {
    Py_DECREF(a);
    return NULL;
  }
  return a;
}

int parse_weight_dtype(PyObject *o, const char *op, tp_dtype_t *dt) {
  *dt = TP_FLOAT32;
  if (!o || o == Py_None) return 0;
  const char *name = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
  tp_dtype_t f;
  if (name && tp_dtype_from_name(name, &f) && tp_weight_format(f, NULL, NULL, NULL)) return *dt = f, 0;
  PyErr_Clear();
  PyErr_Format(PyExc_ValueError,
               "%s: weight_dtype must be 'float32', 'bfloat16', 'float16', 'int8', 'q8_0', 'q4_0', "
               "'q4_1', 'q4_k', 'q5_k' or 'q6_k', got %R",
               op, o);
  return -1;
}
