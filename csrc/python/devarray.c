/*
 * devarray.c: tpcore.DeviceArray, an n-dimensional C-contiguous array in the memory
 * of one device (the CPU or a CUDA GPU), and tpcore's DLPack producer.
 *
 * A DeviceArray either owns its bytes (tp_device_alloc on (device, id), freed in
 * dealloc) or views bytes owned elsewhere (`base`: a DLPack hold, whose release calls
 * the producer's deleter once).  Exported capsules hold a reference to the array, so
 * memory goes when the last array reference and the last capsule are gone.
 *
 * __dlpack__(stream=, max_version=, dl_device=, copy=) as the Python array API says:
 * a versioned capsule when max_version >= (1, 0) is asked, a legacy one otherwise (a
 * read-only array then refuses: only the versioned form can say read-only); on CUDA
 * the data is made ready on the consumer's stream (tp_device_stream_wait: the
 * consumer's stream waits for tpcore's, the legacy default stream).
 * Module functions: parse_device, from_dlpack (a zero-copy view of any producer),
 * asarray (to a device, copy=True/False/None).  The export (__dlpack__,
 * __dlpack_device__) is devarray_dlpack.c; devarray_impl.h is what the two share.
 */
#include "devarray_impl.h"

#include <stdlib.h>

#include "../core/core_impl.h"

static PyObject *device_str(tp_device_t t, int id) { return PyUnicode_FromFormat("%s:%d", tp_device_name(t), id); }

static PyObject *m_from_dlpack(PyObject *m, PyObject *args, PyObject *kw);

/* ------------------------------------------------------------ construction */

/* A new owning array, contents undefined.  A new reference, or NULL. */
static PyObject *devarray_alloc(PyTypeObject *type, tp_device_t dev, int id, tp_dtype_t dt, int ndim,
                                const int64_t *shape) {
  size_t numel = 1, nbytes;
  for (int i = 0; i < ndim; i++)
    if (shape[i] < 0 || !tp_mul_size(numel, (size_t)shape[i], &numel)) {
      PyErr_SetString(PyExc_ValueError, "DeviceArray: the shape is negative or its size overflows");
      return NULL;
    }
  if (!tp_mul_size(numel, tp_dtype_size(dt), &nbytes) || nbytes > (size_t)PTRDIFF_MAX) {
    PyErr_SetString(PyExc_ValueError, "DeviceArray: the byte size overflows");
    return NULL;
  }
  DevArray *a = (DevArray *)type->tp_alloc(type, 0);
  if (!a) return NULL;
  void *p = NULL;
  if (nbytes > 0) {
    tp_status_t s = tp_device_alloc(dev, id, nbytes, &p);
    if (s != TP_SUCCESS) {
      Py_DECREF(a);
      PyErr_Format(s == TP_ERR_NOMEM ? PyExc_MemoryError : PyExc_RuntimeError,
                   "DeviceArray: allocating %zu bytes on %s:%d failed: %s", nbytes, tp_device_name(dev), id,
                   tp_last_error());
      return NULL;
    }
  }
  a->t = tp_tensor_nd(p, dt, ndim, shape);
  a->t.device = dev;
  a->t.device_id = id;
  a->nbytes = nbytes;
  a->alloc = p;
  return (PyObject *)a;
}

/* A view of t (memory kept alive by base, a new reference taken). */
static PyObject *devarray_view(PyTypeObject *type, const tp_tensor *t, PyObject *base, int readonly) {
  DevArray *a = (DevArray *)type->tp_alloc(type, 0);
  if (!a) return NULL;
  a->t = *t;
  int64_t n = tp_tensor_numel(t);
  a->nbytes = n > 0 ? (size_t)n * tp_dtype_size(t->dtype) : 0;
  a->base = Py_XNewRef(base);
  a->readonly = readonly;
  return (PyObject *)a;
}

/* A copy of a on (dev, id), synchronised (the host can read it at once). */
PyObject *devarray_copy_to(DevArray *a, tp_device_t dev, int id) {
  PyObject *o = devarray_alloc(Py_TYPE(a), dev, id, a->t.dtype, a->t.ndim, a->t.shape);
  if (!o || a->nbytes == 0) return o;
  DevArray *b = (DevArray *)o;
  tp_status_t s = tp_device_copy(dev, b->t.data, a->t.device, a->t.data, a->nbytes, NULL);
  if (s == TP_SUCCESS && a->t.device != TP_DEVICE_CPU) s = tp_device_sync(a->t.device, a->t.device_id, NULL);
  if (s == TP_SUCCESS && dev != TP_DEVICE_CPU) s = tp_device_sync(dev, id, NULL);
  if (s != TP_SUCCESS) {
    Py_DECREF(o);
    PyErr_Format(PyExc_RuntimeError, "DeviceArray: copying %zu bytes from %s:%d to %s:%d failed: %s", a->nbytes,
                 tp_device_name(a->t.device), a->t.device_id, tp_device_name(dev), id, tp_last_error());
    return NULL;
  }
  return o;
}

static int parse_shape(PyObject *o, int *ndim, int64_t *shape) {
  if (PyLong_Check(o)) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *ndim = 1;
    shape[0] = v;
  } else {
    PyObject *seq = PySequence_Fast(o, "DeviceArray: shape must be an int or a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > TP_MAX_DIMS) {
      Py_DECREF(seq);
      PyErr_Format(PyExc_ValueError, "DeviceArray: %zd dimensions; at most %d are supported", n, TP_MAX_DIMS);
      return -1;
    }
    *ndim = (int)n;
    for (Py_ssize_t i = 0; i < n; i++) {
      long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
      if (v == -1 && PyErr_Occurred()) {
        Py_DECREF(seq);
        return -1;
      }
      shape[i] = v;
    }
    Py_DECREF(seq);
  }
  for (int i = 0; i < *ndim; i++)
    if (shape[i] < 0) {
      PyErr_Format(PyExc_ValueError, "DeviceArray: shape has a negative dimension (%lld)", (long long)shape[i]);
      return -1;
    }
  return 0;
}

/* DeviceArray(shape, dtype="float32", device="cpu"): zero-filled. */
static PyObject *da_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"shape", "dtype", "device", NULL};
  PyObject *shape_o, *dev_o = Py_None;
  const char *dtn = "float32";
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|sO:DeviceArray", kwlist, &shape_o, &dtn, &dev_o)) return NULL;
  int ndim;
  int64_t shape[TP_MAX_DIMS];
  tp_dtype_t dt;
  tp_device_t dev;
  int id;
  if (parse_shape(shape_o, &ndim, shape) < 0) return NULL;
  if (!tp_dtype_from_name(dtn, &dt) || !tp_dtype_size(dt)) { /* (the weight formats, q8_0 ...: not tensor dtypes) */
    PyErr_Format(PyExc_ValueError,
                 "DeviceArray: dtype '%s' is not known; expected one of float32, float64, "
                 "float16, bfloat16, int8, uint8, int32, int64",
                 dtn);
    return NULL;
  }
  if (parse_device(dev_o, "DeviceArray", &dev, &id) < 0) return NULL;
  PyObject *o = devarray_alloc(type, dev, id, dt, ndim, shape);
  DevArray *a = (DevArray *)o;
  if (o && a->nbytes) {
    tp_status_t s = tp_device_memset(dev, a->t.data, 0, a->nbytes, NULL);
    if (s == TP_SUCCESS && dev != TP_DEVICE_CPU) s = tp_device_sync(dev, id, NULL);
    if (s != TP_SUCCESS) {
      Py_DECREF(o);
      PyErr_Format(PyExc_RuntimeError, "DeviceArray: zero-filling failed: %s", tp_last_error());
      return NULL;
    }
  }
  return o;
}

static void da_dealloc(PyObject *self) {
  DevArray *a = (DevArray *)self;
  PyTypeObject *tp = Py_TYPE(self);
  if (a->alloc) tp_device_free(a->t.device, a->t.device_id, a->alloc);
  a->alloc = NULL;
  Py_CLEAR(a->base);
  tp->tp_free(self);
  Py_DECREF(tp);
}

/* ------------------------------------------------------------ to NumPy */

PyArray_Descr *numpy_descr(tp_dtype_t dt) {
  int npy;
  switch (dt) {
    case TP_FLOAT32: npy = NPY_FLOAT32; break;
    case TP_FLOAT64: npy = NPY_FLOAT64; break;
    case TP_FLOAT16: npy = NPY_FLOAT16; break;
    case TP_INT8: npy = NPY_INT8; break;
    case TP_UINT8: npy = NPY_UINT8; break;
    case TP_INT32: npy = NPY_INT32; break;
    case TP_INT64: npy = NPY_INT64; break;
    case TP_BFLOAT16: {
      PyObject *m = PyImport_ImportModule("ml_dtypes");
      if (!m) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError,
                        "DeviceArray.to_numpy: a bfloat16 array needs the ml_dtypes package for "
                        "its NumPy dtype (pip install ml_dtypes)");
        return NULL;
      }
      PyObject *bf = PyObject_GetAttrString(m, "bfloat16");
      Py_DECREF(m);
      if (!bf) return NULL;
      PyArray_Descr *d = NULL;
      int ok = PyArray_DescrConverter(bf, &d);
      Py_DECREF(bf);
      return ok ? d : NULL;
    }
    default: PyErr_SetString(PyExc_TypeError, "DeviceArray.to_numpy: invalid dtype"); return NULL;
  }
  return PyArray_DescrFromType(npy);
}

/* CPU: a NumPy view sharing the memory (kept alive by the array); CUDA: a host copy. */
static PyObject *da_to_numpy(PyObject *self, PyObject *unused) {
  DevArray *a = (DevArray *)self;
  PyObject *src = self;
  if (a->t.device != TP_DEVICE_CPU) {
    src = devarray_copy_to(a, TP_DEVICE_CPU, 0);
    if (!src) return NULL;
  } else {
    Py_INCREF(src);
  }
  DevArray *h = (DevArray *)src;
  PyArray_Descr *d = numpy_descr(h->t.dtype);
  if (!d) {
    Py_DECREF(src);
    return NULL;
  }
  npy_intp dims[TP_MAX_DIMS];
  for (int i = 0; i < h->t.ndim; i++) dims[i] = (npy_intp)h->t.shape[i];
  static char dummy[16] __attribute__((aligned(16)));
  void *data = h->t.data ? h->t.data : dummy;
  PyObject *arr =
      PyArray_NewFromDescr(&PyArray_Type, d, h->t.ndim, dims, NULL, data, h->readonly ? 0 : NPY_ARRAY_WRITEABLE, NULL);
  if (!arr) {
    Py_DECREF(src);
    return NULL;
  }
  if (PyArray_SetBaseObject((PyArrayObject *)arr, src) < 0) { /* steals src */
    Py_DECREF(arr);
    return NULL;
  }
  return arr;
}

static PyObject *da_copy(PyObject *self, PyObject *unused) {
  DevArray *a = (DevArray *)self;
  return devarray_copy_to(a, a->t.device, a->t.device_id);
}

static PyObject *da_to(PyObject *self, PyObject *dev_o) {
  tp_device_t dev;
  int id;
  if (parse_device(dev_o, "DeviceArray.to", &dev, &id) < 0) return NULL;
  DevArray *a = (DevArray *)self;
  if (dev == a->t.device && id == a->t.device_id) return Py_NewRef(self);
  return devarray_copy_to(a, dev, id);
}

/* reshape(shape): a view with another shape of the same size (the array is contiguous). */
static PyObject *da_reshape(PyObject *self, PyObject *shape_o) {
  DevArray *a = (DevArray *)self;
  int ndim;
  int64_t shape[TP_MAX_DIMS];
  if (parse_shape(shape_o, &ndim, shape) < 0) return NULL;
  tp_tensor t = tp_tensor_nd(a->t.data, a->t.dtype, ndim, shape);
  t.device = a->t.device;
  t.device_id = a->t.device_id;
  if (tp_tensor_numel(&t) != tp_tensor_numel(&a->t)) {
    PyErr_Format(PyExc_ValueError, "DeviceArray.reshape: %lld elements cannot take a shape of %lld",
                 (long long)tp_tensor_numel(&a->t), (long long)tp_tensor_numel(&t));
    return NULL;
  }
  return devarray_view(Py_TYPE(self), &t, self, a->readonly);
}

/* copy_from(src): src's bytes into this array (same dtype and size; any device). */
static PyObject *da_copy_from(PyObject *self, PyObject *src_o) {
  DevArray *a = (DevArray *)self;
  module_state *st = state_of_type(Py_TYPE(self));
  if (a->readonly) {
    PyErr_SetString(PyExc_ValueError, "DeviceArray.copy_from: the array is read-only");
    return NULL;
  }
  PyObject *args = PyTuple_Pack(1, src_o),
           *kw = Py_BuildValue("{s:s,s:s}", "op", "DeviceArray.copy_from", "name", "src");
  PyObject *mod = PyType_GetModule(Py_TYPE(self)); /* borrowed */
  PyObject *src = args && kw && mod ? m_from_dlpack(mod, args, kw) : NULL;
  Py_XDECREF(args);
  Py_XDECREF(kw);
  if (!src) return NULL;
  (void)st;
  DevArray *b = (DevArray *)src;
  if (b->t.dtype != a->t.dtype || tp_tensor_numel(&b->t) != tp_tensor_numel(&a->t)) {
    PyErr_Format(PyExc_ValueError,
                 "DeviceArray.copy_from: src has dtype %s and %lld elements; this array has dtype "
                 "%s and %lld",
                 tp_dtype_name(b->t.dtype), (long long)tp_tensor_numel(&b->t), tp_dtype_name(a->t.dtype),
                 (long long)tp_tensor_numel(&a->t));
    Py_DECREF(src);
    return NULL;
  }
  tp_status_t s = TP_SUCCESS;
  if (a->nbytes) {
    Py_BEGIN_ALLOW_THREADS s = tp_device_copy(a->t.device, a->t.data, b->t.device, b->t.data, a->nbytes, NULL);
    if (s == TP_SUCCESS && a->t.device != TP_DEVICE_CPU) s = tp_device_sync(a->t.device, a->t.device_id, NULL);
    if (s == TP_SUCCESS && b->t.device != TP_DEVICE_CPU) s = tp_device_sync(b->t.device, b->t.device_id, NULL);
    Py_END_ALLOW_THREADS
  }
  Py_DECREF(src);
  if (s != TP_SUCCESS) {
    PyErr_Format(PyExc_RuntimeError, "DeviceArray.copy_from: the copy failed: %s", tp_last_error());
    return NULL;
  }
  Py_RETURN_NONE;
}

/* a[i0:i1] = value: rows i0..i1 of the first axis (a step-1 slice) from the host, one
 * copy of just those rows (streaming checkpoint loads fill a GPU weight chunk by chunk
 * through a bounded host buffer). */
static int da_set_rows(DevArray *a, PyObject *key, PyObject *value) {
  if (a->readonly) {
    PyErr_SetString(PyExc_ValueError, "DeviceArray: the array is read-only");
    return -1;
  }
  Py_ssize_t n0 = (Py_ssize_t)a->t.shape[0], start, stop, step, len;
  if (PySlice_GetIndicesEx(key, n0, &start, &stop, &step, &len) < 0) return -1;
  if (step != 1) {
    PyErr_SetString(PyExc_TypeError, "DeviceArray: a[i:j] = value takes a slice of step 1 (rows i to j)");
    return -1;
  }
  PyArray_Descr *d = numpy_descr(a->t.dtype);
  if (!d) return -1;
  npy_intp dims[TP_MAX_DIMS];
  dims[0] = (npy_intp)len;
  for (int i = 1; i < a->t.ndim; i++) dims[i] = (npy_intp)a->t.shape[i];
  PyObject *tmp = PyArray_Empty(a->t.ndim, dims, d, 0); /* steals d */
  if (!tmp) return -1;
  PyObject *src = PyArray_FROM_O(value);
  int r = src ? PyArray_CopyInto((PyArrayObject *)tmp, (PyArrayObject *)src) : -1;
  Py_XDECREF(src);
  size_t row = n0 ? a->nbytes / (size_t)n0 : 0, nb = row * (size_t)len;
  if (r == 0 && nb) {
    tp_status_t s;
    char *dst = (char *)a->t.data + row * (size_t)start;
    const void *hs = PyArray_DATA((PyArrayObject *)tmp);
    Py_BEGIN_ALLOW_THREADS s = tp_device_copy(a->t.device, dst, TP_DEVICE_CPU, hs, nb, NULL);
    if (s == TP_SUCCESS && a->t.device != TP_DEVICE_CPU) s = tp_device_sync(a->t.device, a->t.device_id, NULL);
    Py_END_ALLOW_THREADS if (s != TP_SUCCESS) {
      PyErr_Format(PyExc_RuntimeError, "DeviceArray: the copy of rows %zd:%zd failed: %s", start, stop,
                   tp_last_error());
      r = -1;
    }
  }
  Py_DECREF(tmp);
  return r;
}

/* a[...] = value (also a[:]): value (anything NumPy takes, broadcast to the shape and
 * converted to the dtype on the host) copied into the array, on any device; a[i:j] =
 * value: rows i..j of the first axis (da_set_rows). */
static int da_setitem(PyObject *self, PyObject *key, PyObject *value) {
  DevArray *a = (DevArray *)self;
  int whole = key == Py_Ellipsis;
  if (!whole && PySlice_Check(key)) {
    PySliceObject *sl = (PySliceObject *)key;
    whole = sl->start == Py_None && sl->stop == Py_None && sl->step == Py_None;
    if (!whole && value && a->t.ndim >= 1) return da_set_rows(a, key, value);
  }
  if (!value || !whole) {
    PyErr_SetString(PyExc_TypeError,
                    "DeviceArray: only a[...] = value (the whole array) or a[i:j] = value (rows "
                    "i to j) can be assigned; index on the host (to_numpy()) or in the producing library");
    return -1;
  }
  PyArray_Descr *d = numpy_descr(a->t.dtype);
  if (!d) return -1;
  npy_intp dims[TP_MAX_DIMS];
  for (int i = 0; i < a->t.ndim; i++) dims[i] = (npy_intp)a->t.shape[i];
  PyObject *tmp = PyArray_Empty(a->t.ndim, dims, d, 0); /* steals d */
  if (!tmp) return -1;
  PyObject *src = PyArray_FROM_O(value);
  int r = src ? PyArray_CopyInto((PyArrayObject *)tmp, (PyArrayObject *)src) : -1;
  Py_XDECREF(src);
  if (r == 0) {
    PyObject *res = da_copy_from(self, tmp);
    r = res ? 0 : -1;
    Py_XDECREF(res);
  }
  Py_DECREF(tmp);
  return r;
}

static PyObject *da_repr(PyObject *self) {
  DevArray *a = (DevArray *)self;
  char sh[200] = "";
  for (int i = 0; i < a->t.ndim; i++) {
    size_t l = strlen(sh);
    snprintf(sh + l, sizeof sh - l, "%s%lld", i ? ", " : "", (long long)a->t.shape[i]);
  }
  return PyUnicode_FromFormat("DeviceArray(shape=(%s%s), dtype=%s, device='%s:%d'%s)", sh, a->t.ndim == 1 ? "," : "",
                              tp_dtype_name(a->t.dtype), tp_device_name(a->t.device), a->t.device_id,
                              a->readonly ? ", readonly" : "");
}

static PyObject *get_shape(PyObject *self, void *c) {
  DevArray *a = (DevArray *)self;
  PyObject *t = PyTuple_New(a->t.ndim);
  for (int i = 0; t && i < a->t.ndim; i++) {
    PyObject *v = PyLong_FromLongLong(a->t.shape[i]);
    if (!v) {
      Py_CLEAR(t);
      break;
    }
    PyTuple_SET_ITEM(t, i, v);
  }
  return t;
}
static PyObject *get_dtype(PyObject *self, void *c) {
  return PyUnicode_FromString(tp_dtype_name(((DevArray *)self)->t.dtype));
}
static PyObject *get_device(PyObject *self, void *c) {
  DevArray *a = (DevArray *)self;
  return device_str(a->t.device, a->t.device_id);
}
static PyObject *get_ndim(PyObject *self, void *c) { return PyLong_FromLong(((DevArray *)self)->t.ndim); }
static PyObject *get_size(PyObject *self, void *c) {
  int64_t n = tp_tensor_numel(&((DevArray *)self)->t);
  return PyLong_FromLongLong(n < 0 ? 0 : n);
}
static PyObject *get_nbytes(PyObject *self, void *c) { return PyLong_FromSize_t(((DevArray *)self)->nbytes); }
static PyObject *get_readonly(PyObject *self, void *c) { return PyBool_FromLong(((DevArray *)self)->readonly); }
static PyObject *get_ptr(PyObject *self, void *c) { return PyLong_FromVoidPtr(((DevArray *)self)->t.data); }
static PyObject *get_owns(PyObject *self, void *c) { return PyBool_FromLong(((DevArray *)self)->alloc != NULL); }

static PyGetSetDef da_getset[] = {
    {"shape", get_shape, NULL, "shape (a tuple)", NULL},
    {"dtype", get_dtype, NULL, "dtype name ('float32', 'bfloat16', ...)", NULL},
    {"device", get_device, NULL, "'cpu:0' or 'cuda:N'", NULL},
    {"ndim", get_ndim, NULL, "number of dimensions", NULL},
    {"size", get_size, NULL, "number of elements", NULL},
    {"nbytes", get_nbytes, NULL, "bytes of data", NULL},
    {"readonly", get_readonly, NULL, "True when writing into it is refused", NULL},
    {"data_ptr", get_ptr, NULL, "address of the first element (device memory on CUDA)", NULL},
    {"owns_memory", get_owns, NULL, "True when the array allocated its memory (False: a view)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef da_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))da_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None): a DLPack capsule"},
    {"__dlpack_device__", da_dlpack_device, METH_NOARGS, "(device_type, device_id) of DLPack"},
    {"to_numpy", da_to_numpy, METH_NOARGS, "a NumPy array: a view on the CPU, a host copy from a GPU"},
    {"numpy", da_to_numpy, METH_NOARGS, "same as to_numpy()"},
    {"copy", da_copy, METH_NOARGS, "a copy on the same device"},
    {"reshape", da_reshape, METH_O, "reshape(shape): a view with another shape of the same size"},
    {"copy_from", da_copy_from, METH_O, "copy_from(src): src's values (same dtype and size, any device) into it"},
    {"to", da_to, METH_O, "to(device): this array on device (itself when already there, else a copy)"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot da_slots[] = {
    {Py_tp_new, da_new},
    {Py_tp_dealloc, da_dealloc},
    {Py_tp_repr, da_repr},
    {Py_mp_ass_subscript, da_setitem},
    {Py_tp_methods, da_methods},
    {Py_tp_getset, da_getset},
    {Py_tp_doc,
     "DeviceArray(shape, dtype='float32', device='cpu'): a zero-filled C-contiguous array in the memory "
     "of one device, exchanged with other libraries through DLPack."},
    {0, NULL},
};

PyType_Spec devarray_spec = {"tpcore.DeviceArray", sizeof(DevArray), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
                             da_slots};

/* ------------------------------------------------------------ module functions */

/* from_dlpack(x, writable=False): a DeviceArray viewing x's memory (no copy). */
static PyObject *m_from_dlpack(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"x", "writable", "op", "name", NULL};
  PyObject *x;
  int writable = 0;
  const char *op = "from_dlpack", *name = "x";
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|pss:from_dlpack", kwlist, &x, &writable, &op, &name)) return NULL;
  module_state *st = PyModule_GetState(m);
  if (Py_IS_TYPE(x, st->DeviceArrayType)) {
    if (writable && ((DevArray *)x)->readonly) {
      PyErr_Format(PyExc_ValueError, "%s: %s is read-only but the operation writes into it", op, name);
      return NULL;
    }
    return Py_NewRef(x);
  }
  tp_tensor t;
  PyObject *hold;
  int ro = 0;
  if (PyArray_Check(x)) { /* NumPy directly: it cannot export bfloat16 (ml_dtypes) through DLPack */
    buf_t b;
    if (get_tensor(x, op, name, writable, &t) < 0 || get_buf(x, op, name, writable, &b) < 0) return NULL;
    return devarray_view(st->DeviceArrayType, &t, x, !PyArray_ISWRITEABLE((PyArrayObject *)x));
  }
  if (dlpack_import(x, op, name, writable, &t, &hold, &ro) < 0) return NULL;
  PyObject *r = devarray_view(st->DeviceArrayType, &t, hold, ro);
  Py_DECREF(hold);
  return r;
}

/* asarray(x, device=None, copy=None): x (a DLPack producer) as a DeviceArray on device. */
static PyObject *m_asarray(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"x", "device", "copy", NULL};
  PyObject *x, *dev_o = Py_None, *copy = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OO:asarray", kwlist, &x, &dev_o, &copy)) return NULL;
  module_state *st = PyModule_GetState(m);
  int want = -1;
  if (copy != Py_None && (want = PyObject_IsTrue(copy)) < 0) return NULL;
  PyObject *src;
  if (Py_IS_TYPE(x, st->DeviceArrayType)) src = Py_NewRef(x);
  else {
    PyObject *a2 = PyTuple_Pack(1, x);
    if (!a2) return NULL;
    PyObject *kw2 = Py_BuildValue("{s:s}", "op", "asarray");
    src = kw2 ? m_from_dlpack(m, a2, kw2) : NULL;
    Py_DECREF(a2);
    Py_XDECREF(kw2);
    if (!src) return NULL;
  }
  DevArray *a = (DevArray *)src;
  tp_device_t dev = a->t.device;
  int id = a->t.device_id;
  if (dev_o != Py_None && parse_device(dev_o, "asarray", &dev, &id) < 0) {
    Py_DECREF(src);
    return NULL;
  }
  int same = dev == a->t.device && id == a->t.device_id;
  if (same && want != 1) return src;
  if (!same && want == 0) {
    PyErr_Format(PyExc_ValueError,
                 "asarray: x is on %s:%d; moving it to %s:%d needs a copy, and copy=False was "
                 "asked",
                 tp_device_name(a->t.device), a->t.device_id, tp_device_name(dev), id);
    Py_DECREF(src);
    return NULL;
  }
  PyObject *r = devarray_copy_to(a, dev, id);
  Py_DECREF(src);
  return r;
}

static PyObject *m_parse_device(PyObject *m, PyObject *o) {
  tp_device_t dev;
  int id;
  if (parse_device(o, "parse_device", &dev, &id) < 0) return NULL;
  return Py_BuildValue("(si)", tp_device_name(dev), id);
}

/* For the layers' outputs: a DeviceArray view of a tensor kept alive by base. */
PyObject *devarray_wrap(module_state *st, const tp_tensor *t, PyObject *base, int readonly) {
  return devarray_view(st->DeviceArrayType, t, base, readonly);
}

/* A new zero-free array on (dev, id) for a layer's output. */
PyObject *devarray_empty(module_state *st, tp_device_t dev, int id, tp_dtype_t dt, int ndim, const int64_t *shape) {
  return devarray_alloc(st->DeviceArrayType, dev, id, dt, ndim, shape);
}

/* x (a DeviceArray or any DLPack tensor) as a tensor on the layer's device (dev, id);
 * *keep holds its memory.  A tensor elsewhere is a TypeError naming who, the argument
 * and both devices. */
int device_input(module_state *st, PyObject *x, const char *who, const char *arg, int writable, tp_device_t dev, int id,
                 tp_tensor *t, PyObject **keep) {
  PyObject *args = PyTuple_Pack(1, x);
  PyObject *kw = Py_BuildValue("{s:i,s:s,s:s}", "writable", writable, "op", who, "name", arg);
  PyObject *mod = PyType_GetModule(st->DeviceArrayType); /* borrowed */
  PyObject *a = args && kw && mod ? m_from_dlpack(mod, args, kw) : NULL;
  Py_XDECREF(args);
  Py_XDECREF(kw);
  if (!a) return -1;
  DevArray *d = (DevArray *)a;
  if (d->t.device != dev || d->t.device_id != id) {
    PyErr_Format(PyExc_TypeError,
                 "%s: %s is on %s:%d but the layer is on %s:%d; move it first (tpcore.asarray(%s, "
                 "device='%s:%d'))",
                 who, arg, tp_device_name(d->t.device), d->t.device_id, tp_device_name(dev), id, arg,
                 tp_device_name(dev), id);
    Py_DECREF(a);
    return -1;
  }
  *t = d->t;
  *keep = a;
  return 0;
}

/* The tensor of a DeviceArray (NULL with TypeError if o is not one). */
const tp_tensor *devarray_tensor(module_state *st, PyObject *o) {
  if (!Py_IS_TYPE(o, st->DeviceArrayType)) {
    PyErr_Format(PyExc_TypeError, "expected a tpcore.DeviceArray, got %s", Py_TYPE(o)->tp_name);
    return NULL;
  }
  return &((DevArray *)o)->t;
}

/* Any module instance's DeviceArray type: they share da_dealloc (the type is final). */
const tp_tensor *devarray_peek(PyObject *o, int *readonly) {
  if (Py_TYPE(o)->tp_dealloc != da_dealloc) return NULL;
  *readonly = ((DevArray *)o)->readonly;
  return &((DevArray *)o)->t;
}

/* dlpack.c */
PyObject *m_device_count(PyObject *m, PyObject *o);
PyObject *m_cuda_status(PyObject *m, PyObject *unused);

PyMethodDef devarray_methods[] = {
    {"device_count", m_device_count, METH_O, "device_count('cuda'): devices of that type usable here"},
    {"cuda_status", m_cuda_status, METH_NOARGS, "why CUDA is or is not usable in this process"},
    {"from_dlpack", (PyCFunction)(void (*)(void))m_from_dlpack, METH_VARARGS | METH_KEYWORDS,
     "from_dlpack(x, writable=False): a tpcore.DeviceArray viewing x's memory through DLPack (no copy)"},
    {"asarray", (PyCFunction)(void (*)(void))m_asarray, METH_VARARGS | METH_KEYWORDS,
     "asarray(x, device=None, copy=None): x as a DeviceArray on device"},
    {"parse_device", m_parse_device, METH_O, "parse_device('cuda:1') -> ('cuda', 1); checks the device exists"},
    {NULL, NULL, 0, NULL},
};
