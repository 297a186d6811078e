/*
 * devarray_dlpack.c: tpcore.DeviceArray as a DLPack producer.  __dlpack__(stream=,
 * max_version=, dl_device=, copy=) as the Python array API says: a versioned capsule when
 * max_version >= (1, 0) is asked, a legacy one otherwise (a read-only array then refuses:
 * only the versioned form can say read-only); on CUDA the data is made ready on the
 * consumer's stream (tp_device_stream_wait: the consumer's stream waits for tpcore's, the
 * legacy default stream).  Exported capsules hold a reference to the array, so memory goes
 * when the last array reference and the last capsule are gone.
 */
#include "devarray_impl.h"

#include <stdlib.h>

typedef struct {
  union {
    DLManagedTensorVersioned v;
    DLManagedTensor l;
  } m; /* first: the deleter's argument is this struct */
  int64_t shape[TP_MAX_DIMS], strides[TP_MAX_DIMS];
  PyObject *owner;
} export_t;

static void export_free(export_t *e) {
  if (!e) return;
  if (e->owner) {
    PyGILState_STATE g = PyGILState_Ensure();
    Py_DECREF(e->owner);
    PyGILState_Release(g);
  }
  free(e);
}
static void del_versioned(DLManagedTensorVersioned *m) { export_free((export_t *)m); }
static void del_legacy(DLManagedTensor *m) { export_free((export_t *)m); }

static void capsule_destructor(PyObject *cap) {
  /* a capsule a consumer took is named used_...: its consumer calls the deleter */
  if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (m && m->deleter) m->deleter(m);
  } else if (PyCapsule_IsValid(cap, "dltensor")) {
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m && m->deleter) m->deleter(m);
  }
  PyErr_Clear();
}

/* The consumer's stream value of the array API -> tp_stream_t; -1: no wait asked. */
static int consumer_stream(DevArray *a, PyObject *stream, int *skip, tp_stream_t *out) {
  *skip = 1;
  *out = NULL;
  if (stream == Py_None) return 0;
  long long v = PyLong_AsLongLong(stream);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "DeviceArray.__dlpack__: stream must be None or an int, got %s",
                 Py_TYPE(stream)->tp_name);
    return -1;
  }
  if (a->t.device == TP_DEVICE_CPU) {
    if (v == -1) return 0;
    PyErr_Format(PyExc_ValueError, "DeviceArray.__dlpack__: a CPU array takes stream=None, got %lld", v);
    return -1;
  }
  if (v == 0) {
    PyErr_SetString(PyExc_ValueError,
                    "DeviceArray.__dlpack__: stream=0 is ambiguous for CUDA and disallowed by the "
                    "array API; pass 1 (legacy default), 2 (per-thread default) or a cudaStream_t");
    return -1;
  }
  if (v == -1 || v == 1) return 0; /* no sync asked / tpcore's own stream (legacy default) */
  if (v < -1) {
    PyErr_Format(PyExc_ValueError, "DeviceArray.__dlpack__: stream %lld is not a valid CUDA stream", v);
    return -1;
  }
  *skip = 0;
  *out = (tp_stream_t)(uintptr_t)v; /* 2 = cudaStreamPerThread */
  return 0;
}

PyObject *da_dlpack(PyObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
  PyObject *stream = Py_None, *maxv = Py_None, *dldev = Py_None, *copy = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOO:__dlpack__", kwlist, &stream, &maxv, &dldev, &copy)) return NULL;
  DevArray *a = (DevArray *)self;
  int versioned = 0;
  if (maxv != Py_None) {
    long major = -1;
    if (PyTuple_Check(maxv) && PyTuple_GET_SIZE(maxv) == 2) major = PyLong_AsLong(PyTuple_GET_ITEM(maxv, 0));
    if (major == -1 && PyErr_Occurred()) PyErr_Clear();
    if (!PyTuple_Check(maxv) || PyTuple_GET_SIZE(maxv) != 2) {
      PyErr_SetString(PyExc_TypeError, "DeviceArray.__dlpack__: max_version must be None or a (major, minor) tuple");
      return NULL;
    }
    versioned = major >= 1;
  }
  int want_copy = 0;
  if (copy != Py_None) {
    int c = PyObject_IsTrue(copy);
    if (c < 0) return NULL;
    want_copy = c;
  }
  tp_device_t to_dev = a->t.device;
  int to_id = a->t.device_id;
  if (dldev != Py_None) {
    long dt = -1, di = -1;
    if (PyTuple_Check(dldev) && PyTuple_GET_SIZE(dldev) == 2) {
      dt = PyLong_AsLong(PyTuple_GET_ITEM(dldev, 0));
      di = PyLong_AsLong(PyTuple_GET_ITEM(dldev, 1));
    }
    if (PyErr_Occurred() || dt < 0) {
      PyErr_Clear();
      PyErr_SetString(PyExc_TypeError, "DeviceArray.__dlpack__: dl_device must be a (device_type, device_id) tuple");
      return NULL;
    }
    if (dt == TP_kDLCPU) to_dev = TP_DEVICE_CPU, to_id = 0;
    else if (dt == TP_kDLCUDA) to_dev = TP_DEVICE_CUDA, to_id = (int)di;
    else {
      PyErr_Format(PyExc_BufferError, "DeviceArray.__dlpack__: cannot export to DLPack device type %ld", dt);
      return NULL;
    }
    if (to_dev != a->t.device || to_id != a->t.device_id) {
      if (copy != Py_None && !want_copy) {
        PyErr_Format(PyExc_BufferError,
                     "DeviceArray.__dlpack__: the array is on %s:%d; exporting it to %s:%d needs a "
                     "copy, and copy=False was asked",
                     tp_device_name(a->t.device), a->t.device_id, tp_device_name(to_dev), to_id);
        return NULL;
      }
      want_copy = 1;
    }
  }
  if (want_copy) {
    if (to_dev != TP_DEVICE_CPU && to_dev == a->t.device && to_id != a->t.device_id) { /* checked below by alloc */
    }
    PyObject *c = devarray_copy_to(a, to_dev, to_id);
    if (!c) return NULL;
    PyObject *kw2 = Py_BuildValue("{s:O,s:O}", "stream", stream, "max_version", maxv);
    PyObject *empty = PyTuple_New(0), *r = NULL;
    if (kw2 && empty) r = da_dlpack(c, empty, kw2);
    Py_XDECREF(kw2);
    Py_XDECREF(empty);
    Py_DECREF(c);
    if (r && versioned) { /* mark IS_COPIED */
      DLManagedTensorVersioned *m = PyCapsule_GetPointer(r, "dltensor_versioned");
      if (m) m->flags |= TP_DLPACK_FLAG_IS_COPIED;
      else PyErr_Clear();
    }
    return r;
  }
  if (a->readonly && !versioned) {
    PyErr_SetString(PyExc_BufferError,
                    "DeviceArray.__dlpack__: the array is read-only and a legacy (unversioned) "
                    "DLPack capsule cannot say so; ask with max_version=(1, 0) or later");
    return NULL;
  }
  int skip;
  tp_stream_t cs;
  if (consumer_stream(a, stream, &skip, &cs) < 0) return NULL;
  if (!skip) {
    tp_status_t s;
    Py_BEGIN_ALLOW_THREADS s = tp_device_stream_wait(a->t.device, a->t.device_id, cs, NULL);
    Py_END_ALLOW_THREADS if (s != TP_SUCCESS) {
      PyErr_Format(PyExc_RuntimeError,
                   "DeviceArray.__dlpack__: making the data ready on the consumer's stream "
                   "failed: %s",
                   tp_last_error());
      return NULL;
    }
  }
  export_t *e = calloc(1, sizeof *e);
  if (!e) return PyErr_NoMemory();
  DLTensor *d = versioned ? &e->m.v.dl_tensor : &e->m.l.dl_tensor;
  d->data = a->t.data;
  d->device.device_type = a->t.device == TP_DEVICE_CUDA ? TP_kDLCUDA : TP_kDLCPU;
  d->device.device_id = a->t.device_id;
  d->ndim = a->t.ndim;
  d->dtype = dlpack_dtype_of(a->t.dtype);
  for (int i = 0; i < a->t.ndim; i++) {
    e->shape[i] = a->t.shape[i];
    e->strides[i] = a->t.strides[i];
  }
  d->shape = e->shape;
  d->strides = e->strides;
  d->byte_offset = 0;
  e->owner = Py_NewRef(self);
  if (versioned) {
    e->m.v.version.major = TP_DLPACK_MAJOR;
    e->m.v.version.minor = TP_DLPACK_MINOR;
    e->m.v.manager_ctx = e;
    e->m.v.deleter = del_versioned;
    e->m.v.flags = a->readonly ? TP_DLPACK_FLAG_READ_ONLY : 0;
  } else {
    e->m.l.manager_ctx = e;
    e->m.l.deleter = del_legacy;
  }
  PyObject *cap = PyCapsule_New(e, versioned ? "dltensor_versioned" : "dltensor", capsule_destructor);
  if (!cap) {
    Py_DECREF(e->owner);
    free(e);
  }
  return cap;
}

PyObject *da_dlpack_device(PyObject *self, PyObject *unused) {
  DevArray *a = (DevArray *)self;
  return Py_BuildValue("(ii)", a->t.device == TP_DEVICE_CUDA ? TP_kDLCUDA : TP_kDLCPU, a->t.device_id);
}
