/*
 * dlpack.c: the DLPack consumer of the extension (specification v1.x, structures in
 * dlpack_abi.h).  dlpack_import turns any producer (a NumPy array, a PyTorch, CuPy or
 * JAX tensor, a tpcore.DeviceArray, or a bare capsule) into a tp_tensor view plus a
 * "hold" object whose release calls the producer's deleter exactly once.
 *
 * The protocol, as the Python array API states it:
 *   - the device is read first (__dlpack_device__): CPU, CUDA-pinned host and CUDA
 *     memory are accepted, a CUDA tensor only when this process can use CUDA;
 *   - __dlpack__(stream=S, max_version=(1, 1)) is asked, then __dlpack__(stream=S)
 *     for producers that do not take max_version.  S is the consumer's stream: None
 *     on the CPU, 1 (the legacy default stream, tpcore's) for CUDA, so the producer
 *     makes the data ready on it;
 *   - a "dltensor_versioned" capsule (major version 1) or a legacy "dltensor" one;
 *     it is renamed "used_..." when taken, after which its own destructor does nothing;
 *   - checks on the tensor: device, dtype (one lane; float32/64/16, bfloat16, int8,
 *     uint8, int32, int64), ndim <= TP_MAX_DIMS, C-contiguous strides, element
 *     alignment, byte_offset added, read-only flag refused for outputs.
 * Every refusal names the op and the argument; a tensor taken and refused has its
 * deleter called before the error is raised.
 *
 * Also here: parse_device (device strings: 'cpu', 'cuda', 'cuda:N'), and the module
 * functions device_count and cuda_status (listed in devarray.c's method table).
 */
#include "ext.h"
#include "dlpack_abi.h"
#include "../core/core_impl.h"

#include <stdlib.h>

/* 1 when CUDA tensors can be used here; loads the CUDA plugin on first use. */
int dlpack_cuda_usable(void) {
  (void)tp_cuda_load(NULL); /* once per process; later calls return the first result */
  return tp_device_available(TP_DEVICE_CUDA);
}

const char *dlpack_cuda_status(void) {
  if (dlpack_cuda_usable()) return "available";
  return tp_cuda_status();
}

/* ------------------------------------------------------------ devices */

/* "cpu", "cpu:0", "cuda", "cuda:N".  Plain "cuda" is the rank's GPU: device 0 when
 * CUDA_VISIBLE_DEVICES names a single device (tpcore.launch --gpus binds one per rank),
 * else LOCAL_RANK (torchrun's convention), else 0.  Checks that the device exists. */
int parse_device(PyObject *o, const char *op, tp_device_t *type, int *id) {
  if (o == Py_None) {
    *type = TP_DEVICE_CPU;
    *id = 0;
    return 0;
  }
  const char *s = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
  if (!s) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s: device must be a string such as 'cpu', 'cuda' or 'cuda:1', got %s", op,
                 Py_TYPE(o)->tp_name);
    return -1;
  }
  const char *colon = strchr(s, ':');
  size_t n = colon ? (size_t)(colon - s) : strlen(s);
  long idx = -1;
  if (colon) {
    char *end = NULL;
    idx = strtol(colon + 1, &end, 10);
    if (!colon[1] || *end || idx < 0 || idx > 4096) {
      PyErr_Format(PyExc_ValueError, "%s: device '%s': the index after ':' must be an integer in 0..4096", op, s);
      return -1;
    }
  }
  if (n == 3 && strncmp(s, "cpu", 3) == 0) {
    if (idx > 0) {
      PyErr_Format(PyExc_ValueError, "%s: device '%s': the CPU is device 0 only", op, s);
      return -1;
    }
    *type = TP_DEVICE_CPU;
    *id = 0;
    return 0;
  }
  if (!(n == 4 && strncmp(s, "cuda", 4) == 0)) {
    PyErr_Format(PyExc_ValueError, "%s: device '%s' is not known; expected 'cpu', 'cuda' or 'cuda:N'", op, s);
    return -1;
  }
  if (idx < 0) {
    const char *vis = getenv("CUDA_VISIBLE_DEVICES"), *lr = getenv("LOCAL_RANK");
    if (vis && *vis && !strchr(vis, ',')) idx = 0;
    else if (lr && *lr) {
      char *end = NULL;
      idx = strtol(lr, &end, 10);
      if (*end || idx < 0 || idx > 4096) {
        PyErr_Format(PyExc_ValueError,
                     "%s: device 'cuda' takes its index from LOCAL_RANK, which is '%s' (not an "
                     "integer in 0..4096)",
                     op, lr);
        return -1;
      }
    } else idx = 0;
  }
  if (!dlpack_cuda_usable()) {
    PyErr_Format(PyExc_RuntimeError,
                 "%s: device 'cuda:%ld' was asked for but CUDA is not available in this "
                 "process: %s",
                 op, idx, dlpack_cuda_status());
    return -1;
  }
  const tp_device_ops *ops = tp_device_ops_of(TP_DEVICE_CUDA);
  int count = ops && ops->count ? ops->count() : 0;
  if (idx >= count) {
    PyErr_Format(PyExc_ValueError, "%s: device 'cuda:%ld' does not exist: this process sees %d CUDA device%s", op, idx,
                 count, count == 1 ? "" : "s");
    return -1;
  }
  *type = TP_DEVICE_CUDA;
  *id = (int)idx;
  return 0;
}

/* device_count('cuda'): devices of that type this process can use (0 without CUDA). */
PyObject *m_device_count(PyObject *m, PyObject *o) {
  const char *s = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
  if (!s) {
    PyErr_Clear();
    PyErr_SetString(PyExc_TypeError, "device_count: give a device type name ('cpu' or 'cuda')");
    return NULL;
  }
  for (int i = 0; i < TP_NUM_DEVICE_TYPES; i++)
    if (strcmp(s, tp_device_name((tp_device_t)i)) == 0) {
      int usable = i == TP_DEVICE_CUDA ? dlpack_cuda_usable() : tp_device_available((tp_device_t)i);
      const tp_device_ops *ops = usable ? tp_device_ops_of((tp_device_t)i) : NULL;
      return PyLong_FromLong(ops && ops->count ? ops->count() : 0);
    }
  PyErr_Format(PyExc_ValueError, "device_count: device type '%s' is not known; expected 'cpu' or 'cuda'", s);
  return NULL;
}

/* cuda_status(): one line on why CUDA is or is not usable here. */
PyObject *m_cuda_status(PyObject *m, PyObject *unused) { return PyUnicode_FromString(dlpack_cuda_status()); }

/* ---------------------------------------------------------------- the hold */

typedef struct {
  void *managed;
  int versioned;
} hold_t;

#define HOLD_NAME "tpcore.dlpack_hold"

static void call_deleter(void *managed, int versioned) {
  if (!managed) return;
  if (versioned) {
    DLManagedTensorVersioned *m = managed;
    if (m->deleter) m->deleter(m);
  } else {
    DLManagedTensor *m = managed;
    if (m->deleter) m->deleter(m);
  }
}

static void hold_destructor(PyObject *cap) {
  hold_t *h = PyCapsule_GetPointer(cap, HOLD_NAME);
  if (!h) {
    PyErr_Clear();
    return;
  }
  /* the deleter may run Python code (a ctypes or cffi producer): keep a pending
   * exception (a refusal being raised) out of its way */
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  call_deleter(h->managed, h->versioned);
  PyMem_RawFree(h);
  PyErr_Restore(et, ev, tb);
}

/* Takes `managed` from the producer's capsule `cap`: the owner (a capsule whose
 * release calls the deleter once) is made first, then cap is renamed `used` so its
 * own destructor leaves the tensor alone (NumPy's order).  On failure the producer
 * still owns it.  A new reference, or NULL. */
static PyObject *make_hold(PyObject *cap, const char *used, void *managed, int versioned) {
  hold_t *h = PyMem_RawMalloc(sizeof *h);
  if (!h) return PyErr_NoMemory();
  h->managed = managed;
  h->versioned = versioned;
  PyObject *hc = PyCapsule_New(h, HOLD_NAME, NULL); /* no destructor until it owns the tensor */
  if (!hc) {
    PyMem_RawFree(h);
    return NULL;
  }
  if (PyCapsule_SetName(cap, used) < 0) {
    Py_DECREF(hc);
    PyMem_RawFree(h);
    return NULL;
  }
  (void)PyCapsule_SetDestructor(hc, hold_destructor); /* cannot fail on a valid capsule */
  return hc;
}

/* ------------------------------------------------------------------ dtypes */

int dlpack_dtype_to_tp(DLDataType d, tp_dtype_t *out) {
  if (d.lanes != 1) return 0;
  switch (d.code) {
    case TP_kDLFloat:
      if (d.bits == 32) *out = TP_FLOAT32;
      else if (d.bits == 64) *out = TP_FLOAT64;
      else if (d.bits == 16) *out = TP_FLOAT16;
      else return 0;
      return 1;
    case TP_kDLBfloat:
      if (d.bits != 16) return 0;
      *out = TP_BFLOAT16;
      return 1;
    case TP_kDLInt:
      if (d.bits == 8) *out = TP_INT8;
      else if (d.bits == 32) *out = TP_INT32;
      else if (d.bits == 64) *out = TP_INT64;
      else return 0;
      return 1;
    case TP_kDLUInt:
      if (d.bits != 8) return 0;
      *out = TP_UINT8;
      return 1;
    default: return 0;
  }
}

DLDataType dlpack_dtype_of(tp_dtype_t t) {
  DLDataType d = {TP_kDLFloat, 32, 1};
  switch (t) {
    case TP_FLOAT32: break;
    case TP_FLOAT64: d.bits = 64; break;
    case TP_FLOAT16: d.bits = 16; break;
    case TP_BFLOAT16:
      d.code = TP_kDLBfloat;
      d.bits = 16;
      break;
    case TP_INT8:
      d.code = TP_kDLInt;
      d.bits = 8;
      break;
    case TP_UINT8:
      d.code = TP_kDLUInt;
      d.bits = 8;
      break;
    case TP_INT32:
      d.code = TP_kDLInt;
      d.bits = 32;
      break;
    case TP_INT64:
      d.code = TP_kDLInt;
      d.bits = 64;
      break;
    default: break;
  }
  return d;
}

/* "int16", "complex64", "float8", "bool8", "float32x4", "dtype code 9 (8 bits)" */
static void dtype_text(DLDataType d, char *buf, size_t n) {
  static const char *codes[] = {"int", "uint", "float", "opaque handle", "bfloat", "complex", "bool"};
  if (d.code < sizeof codes / sizeof codes[0]) snprintf(buf, n, "%s%u", codes[d.code], (unsigned)d.bits);
  else snprintf(buf, n, "dtype code %u (%u bits)", (unsigned)d.code, (unsigned)d.bits);
  if (d.lanes != 1) {
    size_t l = strlen(buf);
    snprintf(buf + l, n - l, "x%u", (unsigned)d.lanes);
  }
}

/* ------------------------------------------------------------ the checks */

static const char *device_type_text(int32_t t) {
  switch (t) {
    case TP_kDLCPU: return "cpu";
    case TP_kDLCUDA: return "cuda";
    case TP_kDLCUDAHost: return "cuda_host";
    case TP_kDLROCM: return "rocm";
    case TP_kDLROCMHost: return "rocm_host";
    case TP_kDLCUDAManaged: return "cuda_managed";
    default: return NULL;
  }
}

/* Checks t (the tensor of a taken capsule) and fills out.  -1 with an exception. */
static int check_tensor(const DLTensor *d, uint64_t flags, const char *op, const char *arg, int writable,
                        tp_tensor *out, int *readonly) {
  const char *dev = device_type_text(d->device.device_type);
  char dname[48];
  if (dev) snprintf(dname, sizeof dname, "%s:%d", dev, (int)d->device.device_id);
  else snprintf(dname, sizeof dname, "DLPack device type %d:%d", (int)d->device.device_type, (int)d->device.device_id);
  tp_device_t device;
  switch (d->device.device_type) {
    case TP_kDLCPU:
    case TP_kDLCUDAHost:
    case TP_kDLCUDAManaged: device = TP_DEVICE_CPU; break;
    case TP_kDLCUDA: device = TP_DEVICE_CUDA; break;
    default:
      PyErr_Format(PyExc_TypeError, "%s: %s lives on %s; tpcore takes CPU, CUDA-host and CUDA tensors", op, arg, dname);
      return -1;
  }
  if (device == TP_DEVICE_CUDA && !dlpack_cuda_usable()) {
    PyErr_Format(PyExc_RuntimeError, "%s: %s is a CUDA tensor (%s) but CUDA is not available in this process: %s", op,
                 arg, dname, dlpack_cuda_status());
    return -1;
  }
  if (d->device.device_id < 0) {
    PyErr_Format(PyExc_ValueError, "%s: %s has a negative device id (%s)", op, arg, dname);
    return -1;
  }
  tp_dtype_t dt;
  if (!dlpack_dtype_to_tp(d->dtype, &dt)) {
    char name[48];
    dtype_text(d->dtype, name, sizeof name);
    PyErr_Format(PyExc_TypeError,
                 "%s: %s has dtype %s, which tpcore does not take; expected one of float32, float64, float16, "
                 "bfloat16, int8, uint8, int32, int64",
                 op, arg, name);
    return -1;
  }
  if (d->ndim < 0 || d->ndim > TP_MAX_DIMS) {
    PyErr_Format(PyExc_ValueError, "%s: %s has %d dimensions; at most %d are supported", op, arg, (int)d->ndim,
                 TP_MAX_DIMS);
    return -1;
  }
  if (d->ndim > 0 && !d->shape) {
    PyErr_Format(PyExc_ValueError, "%s: %s has %d dimensions but no shape", op, arg, (int)d->ndim);
    return -1;
  }
  size_t esize = tp_dtype_size(dt), numel = 1;
  int empty = 0;
  for (int i = 0; i < d->ndim; i++) {
    if (d->shape[i] < 0) {
      PyErr_Format(PyExc_ValueError, "%s: %s has a negative dimension (%lld at axis %d)", op, arg,
                   (long long)d->shape[i], i);
      return -1;
    }
    if (d->shape[i] == 0) empty = 1;
    else if (!tp_mul_size(numel, (size_t)d->shape[i], &numel)) goto too_big;
  }
  size_t nbytes;
  if (!tp_mul_size(numel, esize, &nbytes) || nbytes > (size_t)PTRDIFF_MAX) goto too_big;
  if (d->strides && !empty) { /* compact row-major; a dimension of size 1 may have any stride */
    int64_t want = 1;
    for (int i = d->ndim - 1; i >= 0; i--) {
      if (d->shape[i] != 1 && d->strides[i] != want) {
        char sh[160] = "", sd[160] = "";
        for (int k = 0; k < d->ndim; k++) {
          size_t a = strlen(sh), b = strlen(sd);
          snprintf(sh + a, sizeof sh - a, "%s%lld", k ? ", " : "", (long long)d->shape[k]);
          snprintf(sd + b, sizeof sd - b, "%s%lld", k ? ", " : "", (long long)d->strides[k]);
        }
        PyErr_Format(PyExc_ValueError,
                     "%s: %s must be C-contiguous, got shape (%s) with strides (%s) in elements; make it "
                     "contiguous first (.contiguous(), numpy.ascontiguousarray)",
                     op, arg, sh, sd);
        return -1;
      }
      want *= d->shape[i];
    }
  }
  if (d->byte_offset > (uint64_t)PTRDIFF_MAX) goto too_big;
  char *data = d->data ? (char *)d->data + d->byte_offset : NULL;
  if (!data && !empty && numel > 0) {
    PyErr_Format(PyExc_ValueError, "%s: %s has a NULL data pointer", op, arg);
    return -1;
  }
  if (data && ((uintptr_t)data % esize) != 0) {
    PyErr_Format(PyExc_ValueError, "%s: %s (data + byte_offset %llu) is not aligned to its element size %zu", op, arg,
                 (unsigned long long)d->byte_offset, esize);
    return -1;
  }
  *readonly = (flags & TP_DLPACK_FLAG_READ_ONLY) != 0;
  if (writable && *readonly) {
    PyErr_Format(PyExc_ValueError,
                 "%s: %s is read-only (its DLPack producer exported it with the read-only flag) "
                 "but the operation writes into it",
                 op, arg);
    return -1;
  }
  int64_t shape[TP_MAX_DIMS];
  for (int i = 0; i < d->ndim; i++) shape[i] = d->shape[i];
  *out = tp_tensor_nd(data, dt, d->ndim, shape);
  out->device = device;
  out->device_id = device == TP_DEVICE_CUDA ? (int)d->device.device_id : 0;
  return 0;
too_big:
  PyErr_Format(PyExc_ValueError, "%s: %s is too large (its byte size overflows)", op, arg);
  return -1;
}

/* Takes a DLPack capsule: checks its name and version, renames it "used_..." and
 * wraps the managed tensor in a hold.  Then checks the tensor. */
static int take_capsule(PyObject *cap, const char *op, const char *arg, int writable, tp_tensor *t, PyObject **hold,
                        int *readonly) {
  int versioned;
  void *p;
  if (PyCapsule_IsValid(cap, "dltensor_versioned")) versioned = 1;
  else if (PyCapsule_IsValid(cap, "dltensor")) versioned = 0;
  else {
    const char *name = PyCapsule_GetName(cap);
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError,
                 "%s: %s: the DLPack capsule is named '%s'; expected 'dltensor_versioned' or "
                 "'dltensor' (a capsule already consumed is named 'used_...')",
                 op, arg, name ? name : "(none)");
    return -1;
  }
  p = PyCapsule_GetPointer(cap, versioned ? "dltensor_versioned" : "dltensor");
  if (!p) return -1;
  if (versioned) {
    DLManagedTensorVersioned *m = p;
    if (m->version.major != TP_DLPACK_MAJOR) { /* the producer's destructor still owns it */
      PyErr_Format(PyExc_BufferError, "%s: %s: DLPack version %u.%u is not supported (tpcore reads %d.x)", op, arg,
                   (unsigned)m->version.major, (unsigned)m->version.minor, TP_DLPACK_MAJOR);
      return -1;
    }
  }
  PyObject *h = make_hold(cap, versioned ? "used_dltensor_versioned" : "used_dltensor", p, versioned);
  if (!h) return -1;
  const DLTensor *d = versioned ? &((DLManagedTensorVersioned *)p)->dl_tensor : &((DLManagedTensor *)p)->dl_tensor;
  uint64_t flags = versioned ? ((DLManagedTensorVersioned *)p)->flags : 0;
  if (check_tensor(d, flags, op, arg, writable, t, readonly) < 0) {
    Py_DECREF(h); /* the deleter, once */
    return -1;
  }
  *hold = h;
  return 0;
}

/* __dlpack_device__() as (type, id); 0 when the object has none. */
static int producer_device(PyObject *obj, const char *op, const char *arg, int *type, int *id) {
  PyObject *r = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
  if (!r) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyErr_Clear();
      return 0;
    }
    return -1;
  }
  int ok = PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2;
  long a = ok ? PyLong_AsLong(PyTuple_GET_ITEM(r, 0)) : -1, b = ok ? PyLong_AsLong(PyTuple_GET_ITEM(r, 1)) : -1;
  Py_DECREF(r);
  if (!ok || PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s: %s.__dlpack_device__() must return a (device_type, device_id) tuple of ints", op,
                 arg);
    return -1;
  }
  *type = (int)a;
  *id = (int)b;
  return 1;
}

int dlpack_import(PyObject *obj, const char *op, const char *arg, int writable, tp_tensor *t, PyObject **hold,
                  int *readonly) {
  *hold = NULL;
  if (PyCapsule_CheckExact(obj)) return take_capsule(obj, op, arg, writable, t, hold, readonly);
  int dtype_ = 0, did = 0, got = producer_device(obj, op, arg, &dtype_, &did);
  if (got < 0) return -1;
  if (got && dtype_ == TP_kDLCUDA && !dlpack_cuda_usable()) {
    PyErr_Format(PyExc_RuntimeError,
                 "%s: %s is a CUDA tensor (cuda:%d) but CUDA is not available in this process: "
                 "%s",
                 op, arg, did, dlpack_cuda_status());
    return -1;
  }
  if (got && !device_type_text(dtype_)) {
    PyErr_Format(PyExc_TypeError,
                 "%s: %s lives on DLPack device type %d:%d; tpcore takes CPU, CUDA-host and CUDA "
                 "tensors",
                 op, arg, dtype_, did);
    return -1;
  }
  PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__");
  if (!meth) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError,
                 "%s: %s must be an array with __dlpack__ (NumPy, PyTorch, CuPy, JAX, "
                 "tpcore.DeviceArray), got %s",
                 op, arg, Py_TYPE(obj)->tp_name);
    return -1;
  }
  /* the consumer's stream: tpcore works on the legacy default stream (1) of CUDA */
  PyObject *stream = (got && dtype_ == TP_kDLCUDA) ? PyLong_FromLong(1) : Py_NewRef(Py_None);
  PyObject *kw = Py_BuildValue("{s:O,s:(ii)}", "stream", stream, "max_version", TP_DLPACK_MAJOR, TP_DLPACK_MINOR);
  PyObject *empty = PyTuple_New(0), *cap = NULL;
  if (kw && empty) {
    cap = PyObject_Call(meth, empty, kw);
    if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) { /* a producer older than max_version */
      PyErr_Clear();
      Py_DECREF(kw);
      kw = stream == Py_None ? PyDict_New() : Py_BuildValue("{s:O}", "stream", stream);
      if (kw) cap = PyObject_Call(meth, empty, kw);
    }
  }
  Py_XDECREF(kw);
  Py_XDECREF(empty);
  Py_DECREF(stream);
  Py_DECREF(meth);
  if (!cap) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *s = ev ? PyObject_Str(ev) : NULL;
    PyErr_Format(PyExc_TypeError, "%s: %s could not be exported through DLPack: %s: %s", op, arg,
                 et ? ((PyTypeObject *)et)->tp_name : "error", s ? PyUnicode_AsUTF8(s) : "?");
    Py_XDECREF(s);
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
    return -1;
  }
  if (!PyCapsule_CheckExact(cap)) {
    PyErr_Format(PyExc_TypeError, "%s: %s.__dlpack__() returned %s, not a capsule", op, arg, Py_TYPE(cap)->tp_name);
    Py_DECREF(cap);
    return -1;
  }
  int r = take_capsule(cap, op, arg, writable, t, hold, readonly);
  Py_DECREF(cap);
  return r;
}
