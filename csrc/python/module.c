/*
 * tpcore._C: the thin CPython face of the C core.  Argument parsing, NumPy
 * array checks (dtype, contiguity, alignment, writability, sizes), status ->
 * exception mapping, and the GIL released around every blocking call.  No math
 * and no communication logic live here.  The only files of the project that
 * include Python.h or NumPy headers are in this folder.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#define NPY_NO_DEPRECATED_API NPY_1_20_API_VERSION
#include <numpy/arrayobject.h>

#include <limits.h>
#include <string.h>

#include "tpcore/comm.h"
#include "tpcore/kernels.h"
#include "tpcore/layers.h"

/* ------------------------------------------------------------ module state */

typedef struct {
  PyObject *CommError;
  PyObject *CommTimeout;
  PyTypeObject *CommType;
  PyTypeObject *SharedBufferType;
  PyTypeObject *LinearType;
  PyTypeObject *MLPType;
  PyTypeObject *EmbeddingType;
  PyTypeObject *XentType;
  PyTypeObject *BlockType;
} module_state;

static struct PyModuleDef tpcore_module;

static module_state *state_of_type(PyTypeObject *t) {
  PyObject *m = PyType_GetModuleByDef(t, &tpcore_module);
  return m ? (module_state *)PyModule_GetState(m) : NULL;
}

/* Raise the exception that matches a tp_status_t, with the core's sentence. */
static PyObject *raise_status(module_state *st, tp_status_t s, const char *op) {
  const char *msg = tp_last_error();
  if (!msg || !*msg) msg = tp_status_name(s);
  PyObject *type;
  switch (s) {
    case TP_ERR_INVALID_ARGUMENT: type = PyExc_ValueError; break;
    case TP_ERR_NOMEM: type = PyExc_MemoryError; break;
    case TP_ERR_TIMEOUT: type = st->CommTimeout; break;
    default: type = st->CommError; break;
  }
  PyObject *text = PyUnicode_FromString(msg);
  if (!text) return NULL;
  PyObject *exc = PyObject_CallOneArg(type, text);
  Py_DECREF(text);
  if (!exc) return NULL;
  if (PyObject_IsSubclass(type, st->CommError) == 1) {
    PyObject *code = PyUnicode_FromString(tp_status_name(s));
    PyObject *remote = PyBool_FromLong(s == TP_ERR_REMOTE);
    if (!code || !remote || PyObject_SetAttrString(exc, "code", code) < 0 ||
        PyObject_SetAttrString(exc, "peer_failure", remote) < 0) {
      Py_XDECREF(code);
      Py_XDECREF(remote);
      Py_DECREF(exc);
      return NULL;
    }
    Py_DECREF(code);
    Py_DECREF(remote);
  }
  (void)op;
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
  return NULL;
}

/* ------------------------------------------------------------------ arrays */

/* ml_dtypes' bfloat16 (and any other extension dtype of that name). */
static int is_bfloat16(PyArray_Descr *d) {
  if (PyDataType_ELSIZE(d) != 2 || !d->typeobj) return 0;
  const char *name = d->typeobj->tp_name, *dot = strrchr(name, '.');
  return strcmp(dot ? dot + 1 : name, "bfloat16") == 0;
}

static int dtype_of(PyArray_Descr *d, tp_dtype_t *out) {
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

typedef struct {
  void *data;
  size_t count;
  tp_dtype_t dtype;
} buf_t;

/* Checks that obj is a NumPy array this op can use; fills b.  `writable`: the
 * op writes into it.  Errors name the op and the argument. */
static int get_buf(PyObject *obj, const char *op, const char *arg, int writable, buf_t *b) {
  if (!PyArray_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be a NumPy array (or a CPU tensor with __dlpack__), got %s",
                 op, arg, Py_TYPE(obj)->tp_name);
    return -1;
  }
  PyArrayObject *a = (PyArrayObject *)obj;
  PyArray_Descr *d = PyArray_DESCR(a);
  if (!dtype_of(d, &b->dtype)) {
    PyObject *s = PyObject_Str((PyObject *)d);
    PyErr_Format(PyExc_TypeError,
                 "%s: %s has dtype %s; expected one of float32, float64, float16, bfloat16, int8, "
                 "uint8, int32, int64 (native byte order)", op, arg, s ? PyUnicode_AsUTF8(s) : "?");
    Py_XDECREF(s);
    return -1;
  }
  if (!PyArray_IS_C_CONTIGUOUS(a)) {
    PyObject *strides = PyObject_GetAttrString(obj, "strides");
    PyObject *shape = PyObject_GetAttrString(obj, "shape");
    PyObject *s1 = strides ? PyObject_Str(strides) : NULL, *s2 = shape ? PyObject_Str(shape) : NULL;
    PyErr_Format(PyExc_ValueError,
                 "%s: %s must be C-contiguous, got shape %s with strides %s; pass "
                 "numpy.ascontiguousarray(%s)", op, arg, s2 ? PyUnicode_AsUTF8(s2) : "?",
                 s1 ? PyUnicode_AsUTF8(s1) : "?", arg);
    Py_XDECREF(strides); Py_XDECREF(shape); Py_XDECREF(s1); Py_XDECREF(s2);
    return -1;
  }
  if (!PyArray_ISALIGNED(a)) {
    PyErr_Format(PyExc_ValueError, "%s: %s is not aligned to its element size", op, arg);
    return -1;
  }
  if (writable && !PyArray_ISWRITEABLE(a)) {
    if (strcmp(arg, "x") == 0)
      PyErr_Format(PyExc_ValueError,
                   "%s: x is read-only, but the in-place operation writes into it; pass out= to get "
                   "the result elsewhere", op);
    else
      PyErr_Format(PyExc_ValueError, "%s: %s is read-only but the operation writes into it", op, arg);
    return -1;
  }
  b->data = PyArray_DATA(a);
  b->count = (size_t)PyArray_SIZE(a);
  return 0;
}

static int same_dtype(const char *op, const char *a, const buf_t *x, const char *b, const buf_t *y) {
  if (x->dtype != y->dtype) {
    PyErr_Format(PyExc_TypeError, "%s: %s has dtype %s but %s has dtype %s; they must match", op, b,
                 tp_dtype_name(y->dtype), a, tp_dtype_name(x->dtype));
    return -1;
  }
  return 0;
}

static int parse_op(PyObject *o, const char *op, tp_redop_t *out) {
  static const char *names[] = {"sum", "prod", "min", "max", "avg"};
  if (PyUnicode_Check(o)) {
    const char *s = PyUnicode_AsUTF8(o);
    if (!s) return -1;
    for (int i = 0; i < TP_NUM_REDOPS; i++)
      if (strcmp(s, names[i]) == 0) {
        *out = (tp_redop_t)i;
        return 0;
      }
    if (strcmp(s, "mean") == 0) { *out = TP_AVG; return 0; }
    PyErr_Format(PyExc_ValueError, "%s: op must be one of 'sum', 'prod', 'min', 'max', 'avg', got '%s'", op, s);
    return -1;
  }
  PyErr_Format(PyExc_TypeError, "%s: op must be a string ('sum', 'prod', 'min', 'max', 'avg'), got %s", op,
               Py_TYPE(o)->tp_name);
  return -1;
}

/* ------------------------------------------------------------ SharedBuffer */

typedef struct {
  PyObject_HEAD
  tp_mem_t mem;
  void *ptr;
  Py_ssize_t nbytes;
  Py_ssize_t exports;
} SharedBuffer;

static int sb_getbuffer(PyObject *self, Py_buffer *view, int flags) {
  SharedBuffer *b = (SharedBuffer *)self;
  if (!b->mem) {
    PyErr_SetString(PyExc_ValueError, "shared buffer was released");
    return -1;
  }
  if (PyBuffer_FillInfo(view, self, b->ptr, b->nbytes, 0, flags) < 0) return -1;
  b->exports++;
  return 0;
}

static void sb_releasebuffer(PyObject *self, Py_buffer *view) {
  (void)view;
  ((SharedBuffer *)self)->exports--;
}

static void sb_dealloc(PyObject *self) {
  SharedBuffer *b = (SharedBuffer *)self;
  PyTypeObject *tp = Py_TYPE(self);
  if (b->mem) tp_mem_release(b->mem);
  tp->tp_free(self);
  Py_DECREF(tp);
}

static PyObject *sb_address(PyObject *self, void *closure) {
  (void)closure;
  return PyLong_FromVoidPtr(((SharedBuffer *)self)->ptr);
}

static PyGetSetDef sb_getset[] = {
    {"address", sb_address, NULL, "address of this rank's buffer", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot sb_slots[] = {
    {Py_tp_dealloc, sb_dealloc},
    {Py_tp_getset, sb_getset},
    {Py_bf_getbuffer, sb_getbuffer},
    {Py_bf_releasebuffer, sb_releasebuffer},
    {Py_tp_doc, "Memory shared with the peers of a communicator (registered); "
                "exposes the buffer protocol."},
    {0, NULL},
};

static PyType_Spec sb_spec = {
    .name = "tpcore._C.SharedBuffer",
    .basicsize = sizeof(SharedBuffer),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = sb_slots,
};

/* -------------------------------------------------------------------- Comm */

typedef struct {
  PyObject_HEAD
  tp_comm_t comm;
  Py_ssize_t inflight; /* calls running with the GIL released (counted under the GIL) */
  tp_comm_t closing;   /* closed by one thread while another's call was running */
} CommObject;

static module_state *cstate(PyObject *self) { return state_of_type(Py_TYPE(self)); }

static int live(CommObject *self, const char *op) {
  if (!self->comm) {
    module_state *st = cstate((PyObject *)self);
    PyErr_Format(st ? st->CommError : PyExc_RuntimeError, "%s: the communicator is closed", op);
    return 0;
  }
  return 1;
}

#define CALL_NOGIL(st, expr)       \
  do {                             \
    Py_BEGIN_ALLOW_THREADS st = (expr); \
    Py_END_ALLOW_THREADS           \
  } while (0)

/* A call on the communicator with the GIL released.  close() from another thread
 * meanwhile aborts the call and the communicator is destroyed when the last
 * running call has returned (never under it). */
static void comm_leave(CommObject *self) {
  if (--self->inflight == 0 && self->closing) {
    tp_comm_t z = self->closing;
    self->closing = NULL;
    Py_BEGIN_ALLOW_THREADS tp_comm_destroy(z);
    Py_END_ALLOW_THREADS
  }
}

#define COMM_CALL(self, st, expr)           \
  do {                                      \
    tp_comm_t c_ = (self)->comm;            \
    (self)->inflight++;                     \
    Py_BEGIN_ALLOW_THREADS st = (expr);     \
    Py_END_ALLOW_THREADS                    \
    comm_leave(self);                       \
  } while (0)

static PyObject *comm_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"world_size", "rank", "job_id", "timeout", "backend", "spin_us", NULL};
  int world, rank, spin_us = -1;
  const char *job, *backend = "shm";
  double timeout = -1;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "iis|dsi:Comm", kwlist, &world, &rank, &job, &timeout,
                                   &backend, &spin_us))
    return NULL;
  module_state *st = state_of_type(type);
  if (!st) return NULL;
  CommObject *self = (CommObject *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  tp_comm_config_t cfg = TP_COMM_CONFIG_INITIALIZER;
  cfg.job_id = job;
  cfg.timeout_s = timeout;
  cfg.backend = backend;
  cfg.spin_us = spin_us;
  tp_status_t s;
  CALL_NOGIL(s, tp_comm_init_rank(&self->comm, world, rank, &cfg));
  if (s != TP_SUCCESS) {
    Py_DECREF(self);
    return raise_status(st, s, "init");
  }
  return (PyObject *)self;
}

static void comm_dealloc(PyObject *o) {
  CommObject *self = (CommObject *)o;
  PyTypeObject *tp = Py_TYPE(o);
  if (self->closing) {
    tp_comm_destroy(self->closing);
    self->closing = NULL;
  }
  if (self->comm) {
    tp_comm_t c = self->comm;
    self->comm = NULL;
    tp_comm_destroy(c);
  }
  tp->tp_free(o);
  Py_DECREF(tp);
}

static PyObject *comm_close(PyObject *o, PyObject *unused) {
  CommObject *self = (CommObject *)o;
  if (self->comm) {
    tp_comm_t c = self->comm;
    self->comm = NULL;
    if (self->inflight) {
      /* another thread is inside a call: fail it; the last one out destroys */
      tp_comm_abort(c, "the communicator was closed by another thread during a call");
      self->closing = c;
    } else {
      Py_BEGIN_ALLOW_THREADS tp_comm_destroy(c);
      Py_END_ALLOW_THREADS
    }
  }
  Py_RETURN_NONE;
}

static PyObject *comm_abort(PyObject *o, PyObject *args) {
  CommObject *self = (CommObject *)o;
  const char *reason = "";
  if (!PyArg_ParseTuple(args, "|s:abort", &reason)) return NULL;
  if (self->comm) tp_comm_abort(self->comm, reason);
  Py_RETURN_NONE;
}

/* all_reduce(x, out, op) */
static PyObject *comm_all_reduce(PyObject *o, PyObject *const *args, Py_ssize_t n) {
  CommObject *self = (CommObject *)o;
  PyObject *x, *out, *opo;
  if (n != 3) {
    PyErr_SetString(PyExc_TypeError, "all_reduce(x, out, op) takes 3 positional arguments");
    return NULL;
  }
  x = args[0]; out = args[1]; opo = args[2];
  if (!live(self, "all_reduce")) return NULL;
  buf_t bx, bo;
  tp_redop_t op;
  if (get_buf(x, "all_reduce", "x", 0, &bx) < 0 || get_buf(out, "all_reduce", out == x ? "x" : "out", 1, &bo) < 0 ||
      same_dtype("all_reduce", "x", &bx, "out", &bo) < 0 || parse_op(opo, "all_reduce", &op) < 0)
    return NULL;
  if (bx.count != bo.count) {
    PyErr_Format(PyExc_ValueError, "all_reduce: out has %zu elements but x has %zu; they must match",
                 bo.count, bx.count);
    return NULL;
  }
  tp_status_t s;
  COMM_CALL(self, s, tp_all_reduce(bx.data, bo.data, bx.count, bx.dtype, op, c_, NULL));
  if (s != TP_SUCCESS) return raise_status(cstate(o), s, "all_reduce");
  Py_INCREF(out);
  return out;
}

/* Reads an optional per-rank count sequence into counts (size entries). */
static int parse_counts(PyObject *obj, int size, size_t *counts, const char *op) {
  PyObject *seq = PySequence_Fast(obj, "counts must be a sequence of ints");
  if (!seq) return -1;
  if (PySequence_Fast_GET_SIZE(seq) != size) {
    PyErr_Format(PyExc_ValueError, "%s: counts has %zd entries, expected one per rank (%d)", op,
                 PySequence_Fast_GET_SIZE(seq), size);
    Py_DECREF(seq);
    return -1;
  }
  for (int i = 0; i < size; i++) {
    long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(seq);
      return -1;
    }
    if (v < 0) {
      PyErr_Format(PyExc_ValueError, "%s: counts[%d] is negative (%lld)", op, i, v);
      Py_DECREF(seq);
      return -1;
    }
    counts[i] = (size_t)v;
  }
  Py_DECREF(seq);
  return 0;
}

/* all_gather(x, out, counts=None) and reduce_scatter(x, out, op, counts=None) */
static PyObject *gather_scatter(PyObject *o, PyObject *args, int scatter) {
  CommObject *self = (CommObject *)o;
  const char *name = scatter ? "reduce_scatter" : "all_gather";
  PyObject *x, *out, *opo = NULL, *counts_obj = Py_None;
  if (scatter ? !PyArg_ParseTuple(args, "OOO|O:reduce_scatter", &x, &out, &opo, &counts_obj)
              : !PyArg_ParseTuple(args, "OO|O:all_gather", &x, &out, &counts_obj))
    return NULL;
  if (!live(self, name)) return NULL;
  int size, rank;
  tp_comm_size(self->comm, &size);
  tp_comm_rank(self->comm, &rank);
  PyObject *made = NULL; /* out=None with equal counts: a new array, (size * n, ...) or (n / size, ...) */
  if (out == Py_None) {
    if (counts_obj != Py_None || !PyArray_Check(x) || PyArray_NDIM((PyArrayObject *)x) < 1) {
      PyErr_Format(PyExc_ValueError, "%s: out=None needs an array x of at least one dimension and no counts", name);
      return NULL;
    }
    PyArrayObject *xa = (PyArrayObject *)x;
    npy_intp dims[NPY_MAXDIMS];
    int nd = PyArray_NDIM(xa);
    memcpy(dims, PyArray_DIMS(xa), sizeof(npy_intp) * (size_t)nd);
    if (scatter) {
      if (dims[0] % size) {
        PyErr_Format(PyExc_ValueError, "reduce_scatter: x has length %zd along axis 0, which does not split "
                     "evenly over %d ranks", (Py_ssize_t)dims[0], size);
        return NULL;
      }
      dims[0] /= size;
    } else if (__builtin_mul_overflow(dims[0], (npy_intp)size, &dims[0])) {
      PyErr_Format(PyExc_ValueError, "all_gather: x has length %zd along axis 0; %d ranks of it overflow a size",
                   (Py_ssize_t)PyArray_DIM(xa, 0), size);
      return NULL;
    }
    PyArray_Descr *d = PyArray_DESCR(xa);
    Py_INCREF(d);
    made = PyArray_NewFromDescr(&PyArray_Type, d, nd, dims, NULL, NULL, 0, NULL);
    if (!made) return NULL;
    out = made;
  }
  buf_t bx, bo;
  tp_redop_t op = TP_SUM;
  if (get_buf(x, name, "x", 0, &bx) < 0 || get_buf(out, name, "out", 1, &bo) < 0 ||
      same_dtype(name, "x", &bx, "out", &bo) < 0 || (opo && parse_op(opo, name, &op) < 0)) {
    Py_XDECREF(made);
    return NULL;
  }
  size_t *counts = PyMem_Malloc(sizeof(size_t) * (size_t)size);
  if (!counts) {
    Py_XDECREF(made);
    return PyErr_NoMemory();
  }
  size_t total = 0;
  if (counts_obj != Py_None) {
    if (parse_counts(counts_obj, size, counts, name) < 0) goto fail;
  } else {
    size_t whole = scatter ? bx.count : bo.count, part = scatter ? bo.count : bx.count;
    (void)whole;
    for (int p = 0; p < size; p++) counts[p] = part;
  }
  for (int p = 0; p < size; p++)
    if (__builtin_add_overflow(total, counts[p], &total)) {
      PyErr_Format(PyExc_ValueError, "%s: counts add up past 2**64 elements", name);
      goto fail;
    }
  if (!scatter) {
    if (bx.count != counts[rank]) {
      PyErr_Format(PyExc_ValueError, "all_gather: x has %zu elements but counts[%d] is %zu", bx.count,
                   rank, counts[rank]);
      goto fail;
    }
    if (bo.count != total) {
      PyErr_Format(PyExc_ValueError,
                   "all_gather: out has %zu elements, expected %zu (the ranks' parts together)",
                   bo.count, total);
      goto fail;
    }
  } else {
    if (bx.count != total) {
      PyErr_Format(PyExc_ValueError,
                   "reduce_scatter: x has %zu elements, expected %zu (the ranks' parts together)",
                   bx.count, total);
      goto fail;
    }
    if (bo.count != counts[rank]) {
      PyErr_Format(PyExc_ValueError, "reduce_scatter: out has %zu elements but this rank's part is %zu",
                   bo.count, counts[rank]);
      goto fail;
    }
  }
  tp_status_t s;
  if (scatter)
    COMM_CALL(self, s, tp_reduce_scatter_v(bx.data, bo.data, counts, bx.dtype, op, c_, NULL));
  else
    COMM_CALL(self, s, tp_all_gather_v(bx.data, bo.data, counts, bx.dtype, c_, NULL));
  PyMem_Free(counts);
  if (s != TP_SUCCESS) {
    Py_XDECREF(made);
    return raise_status(cstate(o), s, name);
  }
  if (!made) Py_INCREF(out);
  return out;
fail:
  PyMem_Free(counts);
  Py_XDECREF(made);
  return NULL;
}

static PyObject *comm_all_gather(PyObject *o, PyObject *args) { return gather_scatter(o, args, 0); }
static PyObject *comm_reduce_scatter(PyObject *o, PyObject *args) { return gather_scatter(o, args, 1); }

/* broadcast(x, out, root) */
static PyObject *comm_broadcast(PyObject *o, PyObject *args) {
  CommObject *self = (CommObject *)o;
  PyObject *x, *out;
  int root;
  if (!PyArg_ParseTuple(args, "OOi:broadcast", &x, &out, &root)) return NULL;
  if (!live(self, "broadcast")) return NULL;
  buf_t bx, bo;
  if (get_buf(x, "broadcast", "x", 0, &bx) < 0 || get_buf(out, "broadcast", out == x ? "x" : "out", 1, &bo) < 0 ||
      same_dtype("broadcast", "x", &bx, "out", &bo) < 0)
    return NULL;
  if (bx.count != bo.count) {
    PyErr_Format(PyExc_ValueError, "broadcast: out has %zu elements but x has %zu", bo.count, bx.count);
    return NULL;
  }
  tp_status_t s;
  COMM_CALL(self, s, tp_broadcast(bx.data, bo.data, bx.count, bx.dtype, root, c_, NULL));
  if (s != TP_SUCCESS) return raise_status(cstate(o), s, "broadcast");
  Py_INCREF(out);
  return out;
}

/* reduce(x, out, op, root) */
static PyObject *comm_reduce(PyObject *o, PyObject *args) {
  CommObject *self = (CommObject *)o;
  PyObject *x, *out, *opo;
  int root;
  if (!PyArg_ParseTuple(args, "OOOi:reduce", &x, &out, &opo, &root)) return NULL;
  if (!live(self, "reduce")) return NULL;
  buf_t bx, bo;
  tp_redop_t op;
  if (get_buf(x, "reduce", "x", 0, &bx) < 0 || get_buf(out, "reduce", out == x ? "x" : "out", 1, &bo) < 0 ||
      same_dtype("reduce", "x", &bx, "out", &bo) < 0 || parse_op(opo, "reduce", &op) < 0)
    return NULL;
  if (bx.count != bo.count) {
    PyErr_Format(PyExc_ValueError, "reduce: out has %zu elements but x has %zu", bo.count, bx.count);
    return NULL;
  }
  tp_status_t s;
  COMM_CALL(self, s, tp_reduce(bx.data, bo.data, bx.count, bx.dtype, op, root, c_, NULL));
  if (s != TP_SUCCESS) return raise_status(cstate(o), s, "reduce");
  Py_INCREF(out);
  return out;
}

static PyObject *comm_send(PyObject *o, PyObject *args) {
  CommObject *self = (CommObject *)o;
  PyObject *x;
  int peer;
  if (!PyArg_ParseTuple(args, "Oi:send", &x, &peer)) return NULL;
  if (!live(self, "send")) return NULL;
  buf_t b;
  if (get_buf(x, "send", "x", 0, &b) < 0) return NULL;
  tp_status_t s;
  COMM_CALL(self, s, tp_send(b.data, b.count, b.dtype, peer, c_, NULL));
  if (s != TP_SUCCESS) return raise_status(cstate(o), s, "send");
  Py_RETURN_NONE;
}

static PyObject *comm_recv(PyObject *o, PyObject *args) {
  CommObject *self = (CommObject *)o;
  PyObject *x;
  int peer;
  if (!PyArg_ParseTuple(args, "Oi:recv", &x, &peer)) return NULL;
  if (!live(self, "recv")) return NULL;
  buf_t b;
  if (get_buf(x, "recv", "x", 1, &b) < 0) return NULL;
  tp_status_t s;
  COMM_CALL(self, s, tp_recv(b.data, b.count, b.dtype, peer, c_, NULL));
  if (s != TP_SUCCESS) return raise_status(cstate(o), s, "recv");
  Py_INCREF(x);
  return x;
}

static PyObject *comm_sendrecv(PyObject *o, PyObject *args) {
  CommObject *self = (CommObject *)o;
  PyObject *x, *out;
  int dst, src;
  if (!PyArg_ParseTuple(args, "OiOi:sendrecv", &x, &dst, &out, &src)) return NULL;
  if (!live(self, "sendrecv")) return NULL;
  buf_t bx, bo;
  if (get_buf(x, "sendrecv", "x", 0, &bx) < 0 || get_buf(out, "sendrecv", "out", 1, &bo) < 0 ||
      same_dtype("sendrecv", "x", &bx, "out", &bo) < 0)
    return NULL;
  tp_status_t s;
  COMM_CALL(self, s, tp_sendrecv(bx.data, bx.count, dst, bo.data, bo.count, src, bx.dtype, c_, NULL));
  if (s != TP_SUCCESS) return raise_status(cstate(o), s, "sendrecv");
  Py_INCREF(out);
  return out;
}

static PyObject *comm_barrier(PyObject *o, PyObject *unused) {
  CommObject *self = (CommObject *)o;
  if (!live(self, "barrier")) return NULL;
  tp_status_t s;
  COMM_CALL(self, s, tp_barrier(c_, NULL));
  if (s != TP_SUCCESS) return raise_status(cstate(o), s, "barrier");
  Py_RETURN_NONE;
}

static PyObject *comm_split(PyObject *o, PyObject *args) {
  CommObject *self = (CommObject *)o;
  int color, key;
  if (!PyArg_ParseTuple(args, "ii:split", &color, &key)) return NULL;
  if (!live(self, "split")) return NULL;
  module_state *st = cstate(o);
  tp_comm_t nc = NULL;
  tp_status_t s;
  COMM_CALL(self, s, tp_comm_split(c_, color, key, &nc));
  if (s != TP_SUCCESS) return raise_status(st, s, "split");
  if (!nc) Py_RETURN_NONE;
  CommObject *res = (CommObject *)st->CommType->tp_alloc(st->CommType, 0);
  if (!res) {
    tp_comm_destroy(nc);
    return NULL;
  }
  res->comm = nc;
  return (PyObject *)res;
}

static PyObject *comm_alloc(PyObject *o, PyObject *args) {
  CommObject *self = (CommObject *)o;
  Py_ssize_t nbytes;
  if (!PyArg_ParseTuple(args, "n:alloc", &nbytes)) return NULL;
  if (!live(self, "alloc")) return NULL;
  if (nbytes < 0) {
    PyErr_Format(PyExc_ValueError, "alloc: nbytes must be >= 0, got %zd", nbytes);
    return NULL;
  }
  module_state *st = cstate(o);
  void *ptr;
  tp_mem_t mem;
  tp_status_t s;
  COMM_CALL(self, s, tp_comm_mem_alloc(c_, (size_t)nbytes, &ptr, &mem));
  if (s != TP_SUCCESS) return raise_status(st, s, "alloc");
  SharedBuffer *b = (SharedBuffer *)st->SharedBufferType->tp_alloc(st->SharedBufferType, 0);
  if (!b) {
    tp_mem_release(mem);
    return NULL;
  }
  b->mem = mem;
  b->ptr = ptr;
  b->nbytes = nbytes;
  return (PyObject *)b;
}

static PyObject *comm_stats(PyObject *o, PyObject *unused) {
  CommObject *self = (CommObject *)o;
  if (!live(self, "stats")) return NULL;
  tp_comm_stats_t s;
  tp_comm_get_stats(self->comm, &s);
  return Py_BuildValue("{s:K,s:K,s:K,s:d,s:O}", "calls", (unsigned long long)s.collectives, "bytes",
                       (unsigned long long)s.bytes, "zero_copy", (unsigned long long)s.zero_copy,
                       "seconds", s.seconds, "single_copy", s.single_copy ? Py_True : Py_False);
}

static PyObject *comm_get_int(PyObject *o, void *which) {
  CommObject *self = (CommObject *)o;
  if (!live(self, "rank/size")) return NULL;
  int v;
  if (which) tp_comm_size(self->comm, &v);
  else tp_comm_rank(self->comm, &v);
  return PyLong_FromLong(v);
}

static PyObject *comm_get_backend(PyObject *o, void *closure) {
  CommObject *self = (CommObject *)o;
  if (!live(self, "backend")) return NULL;
  const char *name;
  tp_comm_backend(self->comm, &name);
  return PyUnicode_FromString(name);
}

static PyObject *comm_get_timeout(PyObject *o, void *closure) {
  CommObject *self = (CommObject *)o;
  if (!live(self, "timeout")) return NULL;
  double t;
  tp_comm_timeout(self->comm, &t);
  return PyFloat_FromDouble(t);
}

static int comm_set_timeout(PyObject *o, PyObject *v, void *closure) {
  CommObject *self = (CommObject *)o;
  if (!v) {
    PyErr_SetString(PyExc_AttributeError, "cannot delete timeout");
    return -1;
  }
  if (!live(self, "timeout")) return -1;
  double t = PyFloat_AsDouble(v);
  if (t == -1 && PyErr_Occurred()) return -1;
  if (tp_comm_set_timeout(self->comm, t) != TP_SUCCESS) {
    char buf[64];
    snprintf(buf, sizeof buf, "%g", t);
    PyErr_Format(PyExc_ValueError, "timeout must be > 0 seconds, got %s", buf);
    return -1;
  }
  return 0;
}

static PyObject *comm_get_closed(PyObject *o, void *closure) {
  return PyBool_FromLong(((CommObject *)o)->comm == NULL);
}

static PyObject *comm_get_error(PyObject *o, void *closure) {
  CommObject *self = (CommObject *)o;
  if (!self->comm) Py_RETURN_NONE;
  tp_status_t e;
  tp_comm_get_async_error(self->comm, &e);
  if (e == TP_SUCCESS) Py_RETURN_NONE;
  return PyUnicode_FromString(tp_status_name(e));
}

static PyMethodDef comm_methods[] = {
    {"all_reduce", (PyCFunction)(void (*)(void))comm_all_reduce, METH_FASTCALL,
     "all_reduce(x, out, op): out = op over ranks of x (out may be x)"},
    {"all_gather", comm_all_gather, METH_VARARGS,
     "all_gather(x, out, counts=None): out=None allocates (size * len(x), ...)"},
    {"reduce_scatter", comm_reduce_scatter, METH_VARARGS,
     "reduce_scatter(x, out, op, counts=None): out=None allocates (len(x) / size, ...)"},
    {"broadcast", comm_broadcast, METH_VARARGS, "broadcast(x, out, root)"},
    {"reduce", comm_reduce, METH_VARARGS, "reduce(x, out, op, root)"},
    {"send", comm_send, METH_VARARGS, "send(x, peer)"},
    {"recv", comm_recv, METH_VARARGS, "recv(x, peer): fills x"},
    {"sendrecv", comm_sendrecv, METH_VARARGS, "sendrecv(x, dst, out, src)"},
    {"barrier", comm_barrier, METH_NOARGS, "barrier()"},
    {"split", comm_split, METH_VARARGS, "split(color, key) -> Comm or None"},
    {"alloc", comm_alloc, METH_VARARGS, "alloc(nbytes) -> SharedBuffer (collective)"},
    {"abort", comm_abort, METH_VARARGS, "abort(reason=''): fail the communicator on every rank"},
    {"close", comm_close, METH_NOARGS, "close(): release this rank's resources"},
    {"stats", comm_stats, METH_NOARGS, "stats() -> dict"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef comm_getset[] = {
    {"rank", comm_get_int, NULL, "this rank", NULL},
    {"size", comm_get_int, NULL, "number of ranks", (void *)1},
    {"backend", comm_get_backend, NULL, "backend name", NULL},
    {"timeout", comm_get_timeout, comm_set_timeout, "seconds every wait may take", NULL},
    {"closed", comm_get_closed, NULL, "True after close()", NULL},
    {"error", comm_get_error, NULL, "None, or the error that made the communicator unusable", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot comm_slots[] = {
    {Py_tp_new, comm_new},
    {Py_tp_dealloc, comm_dealloc},
    {Py_tp_methods, comm_methods},
    {Py_tp_getset, comm_getset},
    {Py_tp_doc, "Comm(world_size, rank, job_id, timeout=-1, backend='shm', spin_us=-1): "
                "a communicator of the C core.  Use tpcore.init / tpcore.spawn instead."},
    {0, NULL},
};

static PyType_Spec comm_spec = {
    .name = "tpcore._C.Comm",
    .basicsize = sizeof(CommObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .slots = comm_slots,
};

/* ------------------------------------------------- shared by the layer types */

/* An integer argument (an int or anything with __index__; not a float or a bool) in
 * [lo, hi]: TypeError or ValueError naming the op, the argument, the range and what came.
 * seed_arg: a seed, an integer in [0, 2**64). */
static PyObject *index_of(PyObject *o, const char *op, const char *name, const char *range) {
  if (PyBool_Check(o) || !PyIndex_Check(o)) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be an integer in %s, got %s", op, name, range, Py_TYPE(o)->tp_name);
    return NULL;
  }
  return PyNumber_Index(o);
}

static int int_arg(PyObject *o, const char *op, const char *name, long long lo, long long hi, long long *out) {
  char range[64];
  snprintf(range, sizeof range, "[%lld, %lld]", lo, hi);
  PyObject *i = index_of(o, op, name, range);
  if (!i) return -1;
  int overflow;
  long long v = PyLong_AsLongLongAndOverflow(i, &overflow);
  if (v == -1 && PyErr_Occurred()) {
    Py_DECREF(i);
    return -1;
  }
  if (overflow || v < lo || v > hi) {
    int low = overflow ? overflow < 0 : v < lo;
    PyErr_Format(PyExc_ValueError, "%s: %s must be at %s %lld (an integer in %s), got %S", op, name,
                 low ? "least" : "most", low ? lo : hi, range, i);
    Py_DECREF(i);
    return -1;
  }
  Py_DECREF(i);
  *out = v;
  return 0;
}

static int seed_arg(PyObject *o, const char *op, uint64_t *out) {
  PyObject *i = index_of(o, op, "seed", "[0, 2**64)");
  if (!i) return -1;
  unsigned long long v = PyLong_AsUnsignedLongLong(i); /* OverflowError when negative or >= 2**64 */
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError, "%s: seed must be an integer in [0, 2**64), got %S", op, i);
    }
    Py_DECREF(i);
    return -1;
  }
  Py_DECREF(i);
  *out = v;
  return 0;
}

/* A layer dimension: BLAS takes 32-bit ints. */
#define DIM_MAX ((long long)INT_MAX)

/* comm as a live communicator object of this module, or NULL with an exception. */
static CommObject *layer_comm(module_state *st, PyObject *commo, const char *who) {
  if (!st) return NULL;
  if (!PyObject_TypeCheck(commo, st->CommType)) {
    PyErr_Format(PyExc_TypeError, "%s: comm must be a tpcore communicator, got %s", who, Py_TYPE(commo)->tp_name);
    return NULL;
  }
  return live((CommObject *)commo, who) ? (CommObject *)commo : NULL;
}

/* The end of a layer constructor, given the C create call's status: on failure the
 * half-built object goes and the status is raised (NULL); on success the object keeps the
 * communicator it calls through alive. */
static PyObject *layer_made(PyObject *self, CommObject **slot, CommObject *co, tp_status_t s, module_state *st,
                            const char *name) {
  if (s != TP_SUCCESS) {
    Py_DECREF(self);
    return raise_status(st, s, name);
  }
  Py_INCREF(co);
  *slot = co;
  return self;
}

/* The end of a layer's dealloc, after its C object is destroyed. */
static void layer_free(PyObject *o, CommObject *comm) {
  PyTypeObject *tp = Py_TYPE(o);
  Py_XDECREF(comm);
  tp->tp_free(o);
  Py_DECREF(tp);
}

/* partition=None or a sequence of `size` ints -> *sizes (PyMem, NULL for None). */
static int parse_partition(PyObject *part, int size, int64_t **sizes) {
  *sizes = NULL;
  if (part == Py_None) return 0;
  PyObject *seq = PySequence_Fast(part, "partition must be a sequence of ints");
  if (!seq) return -1;
  if (PySequence_Fast_GET_SIZE(seq) != size) {
    PyErr_Format(PyExc_ValueError, "partition has %zd entries, expected one per rank (%d)",
                 PySequence_Fast_GET_SIZE(seq), size);
    Py_DECREF(seq);
    return -1;
  }
  int64_t *v = PyMem_Malloc(sizeof(int64_t) * (size_t)size);
  if (!v) {
    Py_DECREF(seq);
    PyErr_NoMemory();
    return -1;
  }
  for (int p = 0; p < size; p++) { /* any int64 here; the layer says which sizes it takes */
    long long e;
    if (int_arg(PySequence_Fast_GET_ITEM(seq, p), "partition", "an entry", LLONG_MIN, LLONG_MAX, &e) < 0) {
      Py_DECREF(seq);
      PyMem_Free(v);
      return -1;
    }
    v[p] = e;
  }
  Py_DECREF(seq);
  *sizes = v;
  return 0;
}

/* The output of a layer call: the caller's `out` workspace (checked: float32,
 * (M, cols), writable) or a new array.  A new reference, or NULL. */
static int lin_arg(PyObject *x, const char *op, const char *arg, int64_t cols, int64_t *rows);

static PyObject *layer_output(PyObject *out, const char *op, int64_t M, int64_t cols) {
  if (out && out != Py_None) {
    int64_t Mo;
    buf_t bo;
    if (lin_arg(out, op, "out", cols, &Mo) < 0 || get_buf(out, op, "out", 1, &bo) < 0) return NULL;
    if (Mo != M) {
      PyErr_Format(PyExc_ValueError, "%s: out has %lld rows, the input %lld", op, (long long)Mo, (long long)M);
      return NULL;
    }
    Py_INCREF(out);
    return out;
  }
  npy_intp dims[2] = {(npy_intp)M, (npy_intp)cols};
  return PyArray_SimpleNew(2, dims, NPY_FLOAT32);
}

/* A failed layer call: backward before forward is a RuntimeError, the rest as statuses. */
static PyObject *layer_error(CommObject *co, tp_status_t s, const char *op, int backward) {
  if (s == TP_ERR_INVALID_USAGE && backward) {
    PyErr_SetString(PyExc_RuntimeError, tp_last_error());
    return NULL;
  }
  return raise_status(cstate((PyObject *)co), s, op);
}

/* ------------------------------------------------------------ ParallelLinear */

typedef struct {
  PyObject_HEAD
  tp_parallel_linear_t L;
  CommObject *comm; /* kept alive; calls go through its in-flight accounting */
  tp_linear_info_t info;
  PyObject *owner;  /* an MLP that owns L (then L is not destroyed here) */
} LinearObject;

static PyObject *lin_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"comm", "kind", "in_features", "out_features", "bias", "gather_output",
                           "input_is_parallel", "partition", "seed", "gated", NULL};
  PyObject *commo, *part = Py_None, *in_o, *out_o, *seed_o = NULL;
  const char *kind;
  long long in_f, out_f;
  int bias = 1, gather = 0, inpar = 1, gated = 0;
  uint64_t seed = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OsOO|pppOOp:ParallelLinear", kwlist, &commo, &kind, &in_o, &out_o,
                                   &bias, &gather, &inpar, &part, &seed_o, &gated))
    return NULL;
  if (int_arg(in_o, "ParallelLinear", "in_features", 1, DIM_MAX, &in_f) < 0 ||
      int_arg(out_o, "ParallelLinear", "out_features", 1, DIM_MAX, &out_f) < 0 ||
      (seed_o && seed_arg(seed_o, "ParallelLinear", &seed) < 0))
    return NULL;
  module_state *st = state_of_type(type);
  CommObject *co = layer_comm(st, commo, "ParallelLinear");
  if (!co) return NULL;
  tp_linear_config_t cfg = TP_LINEAR_CONFIG_INITIALIZER;
  if (strcmp(kind, "column") == 0) cfg.kind = TP_COLUMN_PARALLEL;
  else if (strcmp(kind, "row") == 0) cfg.kind = TP_ROW_PARALLEL;
  else {
    PyErr_Format(PyExc_ValueError, "ParallelLinear: kind must be 'column' or 'row', got '%s'", kind);
    return NULL;
  }
  cfg.in_features = in_f;
  cfg.out_features = out_f;
  cfg.bias = bias;
  cfg.gather_output = gather;
  cfg.input_is_parallel = inpar;
  cfg.seed = seed;
  cfg.gated = gated;
  int size;
  tp_comm_size(co->comm, &size);
  int64_t *sizes;
  if (parse_partition(part, size, &sizes) < 0) return NULL;
  cfg.partition = sizes;
  LinearObject *self = (LinearObject *)type->tp_alloc(type, 0);
  if (!self) {
    PyMem_Free(sizes);
    return NULL;
  }
  tp_status_t s;
  COMM_CALL(co, s, tp_parallel_linear_create(&self->L, c_, &cfg));
  PyMem_Free(sizes);
  if (!layer_made((PyObject *)self, &self->comm, co, s, st, "ParallelLinear")) return NULL;
  tp_parallel_linear_info(self->L, &self->info);
  return (PyObject *)self;
}

static void lin_dealloc(PyObject *o) {
  LinearObject *self = (LinearObject *)o;
  if (self->owner) Py_DECREF(self->owner);
  else tp_parallel_linear_destroy(self->L);
  layer_free(o, self->comm);
}

/* x as a float32 2-D C-contiguous array with `cols` columns; rows out. */
static int lin_arg(PyObject *x, const char *op, const char *arg, int64_t cols, int64_t *rows) {
  buf_t b;
  if (get_buf(x, op, arg, 0, &b) < 0) return -1;
  PyArrayObject *a = (PyArrayObject *)x;
  if (b.dtype != TP_FLOAT32) {
    PyErr_Format(PyExc_TypeError, "%s: %s has dtype %s; expected float32", op, arg, tp_dtype_name(b.dtype));
    return -1;
  }
  if (PyArray_NDIM(a) != 2 || PyArray_DIM(a, 1) != cols) {
    PyErr_Format(PyExc_ValueError, "%s: %s must have shape (rows, %lld), got %d dimensions with last %lld", op, arg,
                 (long long)cols, PyArray_NDIM(a), PyArray_NDIM(a) ? (long long)PyArray_DIM(a, PyArray_NDIM(a) - 1) : 0LL);
    return -1;
  }
  *rows = PyArray_DIM(a, 0);
  return 0;
}

static PyObject *lin_run(PyObject *o, PyObject *x, PyObject *out, int backward) {
  LinearObject *self = (LinearObject *)o;
  const char *op = backward ? "backward" : "forward";
  if (!live(self->comm, op)) return NULL;
  int64_t in_cols = backward ? self->info.y_cols : self->info.x_cols;
  int64_t out_cols = backward ? self->info.x_cols : self->info.y_cols;
  int64_t M;
  if (lin_arg(x, op, backward ? "dy" : "x", in_cols, &M) < 0) return NULL;
  PyObject *y = layer_output(out, op, M, out_cols);
  if (!y) return NULL;
  const float *xp = PyArray_DATA((PyArrayObject *)x);
  float *yp = PyArray_DATA((PyArrayObject *)y);
  tp_status_t s;
  CommObject *co = self->comm;
  if (backward)
    COMM_CALL(co, s, ((void)c_, tp_parallel_linear_backward(self->L, yp, xp, M)));
  else
    COMM_CALL(co, s, ((void)c_, tp_parallel_linear_forward(self->L, yp, xp, M)));
  if (s != TP_SUCCESS) {
    Py_DECREF(y);
    return layer_error(co, s, op, backward);
  }
  return y;
}

static PyObject *lin_call(PyObject *o, PyObject *args, int backward) {
  PyObject *x, *out = Py_None;
  if (!PyArg_ParseTuple(args, backward ? "O|O:backward" : "O|O:forward", &x, &out)) return NULL;
  return lin_run(o, x, out, backward);
}
static PyObject *lin_forward(PyObject *o, PyObject *args) { return lin_call(o, args, 0); }
static PyObject *lin_backward(PyObject *o, PyObject *args) { return lin_call(o, args, 1); }

/* A NumPy view of a C-owned array that keeps its owner (a layer object) alive. */
static PyObject *owned_view(PyObject *self, float *p, int nd, int64_t d0, int64_t d1) {
  if (!p) Py_RETURN_NONE;
  npy_intp dims[2] = {(npy_intp)d0, (npy_intp)d1};
  PyObject *a = PyArray_SimpleNewFromData(nd, dims, NPY_FLOAT32, p);
  if (!a) return NULL;
  Py_INCREF(self);
  if (PyArray_SetBaseObject((PyArrayObject *)a, self) < 0) {
    Py_DECREF(a);
    return NULL;
  }
  return a;
}

static PyObject *lin_get(PyObject *o, void *which) {
  LinearObject *self = (LinearObject *)o;
  tp_linear_info_t *i = &self->info;
  switch ((intptr_t)which) {
    case 0: return owned_view(o, i->weight, 2, i->weight_rows, i->weight_cols);
    case 1: return owned_view(o, i->bias, 1, i->bias_len, 0);
    case 2: return owned_view(o, i->grad_weight, 2, i->weight_rows, i->weight_cols);
    case 3: return owned_view(o, i->grad_bias, 1, i->bias_len, 0);
    default:
      return Py_BuildValue("{s:L,s:L,s:L,s:L}", "offset", (long long)i->offset, "local", (long long)i->local,
                           "x_cols", (long long)i->x_cols, "y_cols", (long long)i->y_cols);
  }
}

static PyGetSetDef lin_getset[] = {
    {"weight", lin_get, NULL, "this rank's weight shard (a view)", (void *)0},
    {"bias", lin_get, NULL, "this rank's bias (a view), or None", (void *)1},
    {"grad_weight", lin_get, NULL, "gradient of the weight shard (a view)", (void *)2},
    {"grad_bias", lin_get, NULL, "gradient of the bias (a view), or None", (void *)3},
    {"shard", lin_get, NULL, "offset/local of the split dimension, input/output columns", (void *)4},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef lin_methods[] = {
    {"forward", lin_forward, METH_VARARGS, "forward(x[M, x_cols], out=None) -> y[M, y_cols]"},
    {"backward", lin_backward, METH_VARARGS, "backward(dy[M, y_cols], out=None) -> dx[M, x_cols]; accumulates grads"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot lin_slots[] = {
    {Py_tp_new, lin_new},
    {Py_tp_dealloc, lin_dealloc},
    {Py_tp_methods, lin_methods},
    {Py_tp_getset, lin_getset},
    {Py_tp_doc, "ParallelLinear(comm, kind, in_features, out_features, bias=True, gather_output=False, "
                "input_is_parallel=True, partition=None, seed=0): use tpcore.ColumnParallelLinear / RowParallelLinear"},
    {0, NULL},
};

static PyType_Spec lin_spec = {
    .name = "tpcore._C.ParallelLinear",
    .basicsize = sizeof(LinearObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = lin_slots,
};

/* ---------------------------------------------------------------- ParallelMLP */

static int parse_act(const char *name, tp_activation_t *act);

typedef struct {
  PyObject_HEAD
  tp_parallel_mlp_t M;
  CommObject *comm;
  int64_t hidden;
} MLPObject;

static PyObject *mlp_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"comm", "hidden", "ffn_hidden", "activation", "bias", "partition", "seed", NULL};
  PyObject *commo, *part = Py_None, *hidden_o, *ffn_o, *seed_o = NULL;
  const char *actname;
  long long hidden, ffn;
  int bias = 1;
  uint64_t seed = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOs|pOO:ParallelMLP", kwlist, &commo, &hidden_o, &ffn_o, &actname,
                                   &bias, &part, &seed_o))
    return NULL;
  if (int_arg(hidden_o, "ParallelMLP", "hidden", 1, DIM_MAX, &hidden) < 0 ||
      int_arg(ffn_o, "ParallelMLP", "ffn_hidden", 1, DIM_MAX, &ffn) < 0 ||
      (seed_o && seed_arg(seed_o, "ParallelMLP", &seed) < 0))
    return NULL;
  module_state *st = state_of_type(type);
  CommObject *co = layer_comm(st, commo, "ParallelMLP");
  if (!co) return NULL;
  tp_mlp_config_t cfg = TP_MLP_CONFIG_INITIALIZER;
  if (parse_act(actname, &cfg.activation) < 0) return NULL;
  cfg.hidden = hidden;
  cfg.ffn_hidden = ffn;
  cfg.bias = bias;
  cfg.seed = seed;
  int size;
  tp_comm_size(co->comm, &size);
  int64_t *sizes;
  if (parse_partition(part, size, &sizes) < 0) return NULL;
  cfg.partition = sizes;
  MLPObject *self = (MLPObject *)type->tp_alloc(type, 0);
  if (!self) {
    PyMem_Free(sizes);
    return NULL;
  }
  tp_status_t s;
  COMM_CALL(co, s, tp_parallel_mlp_create(&self->M, c_, &cfg));
  PyMem_Free(sizes);
  if (!layer_made((PyObject *)self, &self->comm, co, s, st, "ParallelMLP")) return NULL;
  self->hidden = hidden;
  return (PyObject *)self;
}

static void mlp_dealloc(PyObject *o) {
  MLPObject *self = (MLPObject *)o;
  tp_parallel_mlp_destroy(self->M);
  layer_free(o, self->comm);
}

static PyObject *mlp_call(PyObject *o, PyObject *args, int backward) {
  MLPObject *self = (MLPObject *)o;
  const char *op = backward ? "backward" : "forward";
  PyObject *x, *out = Py_None;
  if (!PyArg_ParseTuple(args, backward ? "O|O:backward" : "O|O:forward", &x, &out)) return NULL;
  if (!live(self->comm, op)) return NULL;
  int64_t M;
  if (lin_arg(x, op, backward ? "dy" : "x", self->hidden, &M) < 0) return NULL;
  PyObject *y = layer_output(out, op, M, self->hidden);
  if (!y) return NULL;
  const float *xp = PyArray_DATA((PyArrayObject *)x);
  float *yp = PyArray_DATA((PyArrayObject *)y);
  tp_status_t s;
  CommObject *co = self->comm;
  if (backward)
    COMM_CALL(co, s, ((void)c_, tp_parallel_mlp_backward(self->M, yp, xp, M)));
  else
    COMM_CALL(co, s, ((void)c_, tp_parallel_mlp_forward(self->M, yp, xp, M)));
  if (s != TP_SUCCESS) {
    Py_DECREF(y);
    return layer_error(co, s, op, backward);
  }
  return y;
}

static PyObject *mlp_forward(PyObject *o, PyObject *args) { return mlp_call(o, args, 0); }
static PyObject *mlp_backward(PyObject *o, PyObject *args) { return mlp_call(o, args, 1); }

/* fc1 / fc2 as ParallelLinear objects that borrow the MLP's layers. */
static PyObject *mlp_layer(PyObject *o, void *which) {
  MLPObject *self = (MLPObject *)o;
  module_state *st = state_of_type(Py_TYPE(o));
  if (!st) return NULL;
  LinearObject *l = (LinearObject *)st->LinearType->tp_alloc(st->LinearType, 0);
  if (!l) return NULL;
  l->L = tp_parallel_mlp_layer(self->M, (int)(intptr_t)which);
  tp_parallel_linear_info(l->L, &l->info);
  Py_INCREF(self->comm);
  l->comm = self->comm;
  Py_INCREF(o);
  l->owner = o;
  return (PyObject *)l;
}

static PyGetSetDef mlp_getset[] = {
    {"fc1", mlp_layer, NULL, "the column-parallel fc1 (a view of the MLP's layer)", (void *)0},
    {"fc2", mlp_layer, NULL, "the row-parallel fc2 (a view of the MLP's layer)", (void *)1},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef mlp_methods[] = {
    {"forward", mlp_forward, METH_VARARGS, "forward(x[M, hidden], out=None) -> y[M, hidden]"},
    {"backward", mlp_backward, METH_VARARGS, "backward(dy[M, hidden], out=None) -> dx[M, hidden]"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot mlp_slots[] = {
    {Py_tp_new, mlp_new},
    {Py_tp_dealloc, mlp_dealloc},
    {Py_tp_methods, mlp_methods},
    {Py_tp_getset, mlp_getset},
    {Py_tp_doc, "ParallelMLP(comm, hidden, ffn_hidden, activation, bias=True, partition=None, seed=0): "
                "use tpcore.ParallelMLP"},
    {0, NULL},
};

static PyType_Spec mlp_spec = {
    .name = "tpcore._C.ParallelMLP",
    .basicsize = sizeof(MLPObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = mlp_slots,
};

/* ------------------------------------------------------------------ module */

static PyObject *build_info(PyObject *m, PyObject *unused) {
  return Py_BuildValue("{s:s,s:[s],s:s,s:s,s:s}", "version", TPCORE_VERSION_STR, "backends", "shm",
                       "sanitize", TPCORE_SANITIZE_STR, "build", TPCORE_BUILD_STR, "blas", tp_blas_info());
}

static PyObject *set_num_threads(PyObject *m, PyObject *arg) {
  long n = PyLong_AsLong(arg);
  if (n == -1 && PyErr_Occurred()) return NULL;
  if (n < 1 || n > 4096) {
    PyErr_Format(PyExc_ValueError, "set_num_threads: n must be in 1..4096, got %ld", n);
    return NULL;
  }
  tp_set_num_threads((int)n);
  Py_RETURN_NONE;
}

static PyObject *get_num_threads(PyObject *m, PyObject *unused) { return PyLong_FromLong(tp_get_num_threads()); }

static int parse_act(const char *name, tp_activation_t *act) {
  static const char *names[] = {"gelu", "gelu_tanh", "silu", "relu", "swiglu"};
  for (int i = 0; i < 5; i++)
    if (strcmp(name, names[i]) == 0) {
      *act = (tp_activation_t)i;
      return 0;
    }
  PyErr_Format(PyExc_ValueError, "activation must be one of 'gelu', 'gelu_tanh', 'silu', 'relu', 'swiglu', got '%s'",
               name);
  return -1;
}

/* act_forward(name, h[M, F or 2F]) -> out[M, F]; act_backward(name, h, dout[M, F]) -> dh */
static PyObject *act_call(PyObject *args, int backward) {
  const char *name;
  PyObject *h, *dout = NULL, *outo = Py_None;
  if (backward ? !PyArg_ParseTuple(args, "sOO|O:act_backward", &name, &h, &dout, &outo)
               : !PyArg_ParseTuple(args, "sO|O:act_forward", &name, &h, &outo))
    return NULL;
  tp_activation_t act;
  if (parse_act(name, &act) < 0) return NULL;
  const char *op = backward ? "act_backward" : "act_forward";
  buf_t bh, bd;
  if (get_buf(h, op, "h", 0, &bh) < 0) return NULL;
  if (bh.dtype != TP_FLOAT32 || PyArray_NDIM((PyArrayObject *)h) != 2) {
    PyErr_Format(PyExc_TypeError, "%s: h must be a 2-D float32 array", op);
    return NULL;
  }
  npy_intp M = PyArray_DIM((PyArrayObject *)h, 0), C = PyArray_DIM((PyArrayObject *)h, 1);
  npy_intp F = act == TP_ACT_SWIGLU ? C / 2 : C;
  if (act == TP_ACT_SWIGLU && C % 2) {
    PyErr_Format(PyExc_ValueError, "%s: swiglu needs an even number of columns [gate | up], got %zd", op, (Py_ssize_t)C);
    return NULL;
  }
  if (backward) {
    if (get_buf(dout, op, "dout", 0, &bd) < 0) return NULL;
    if (bd.dtype != TP_FLOAT32 || bd.count != (size_t)(M * F)) {
      PyErr_Format(PyExc_ValueError, "%s: dout must be float32 with %zd x %zd elements", op, (Py_ssize_t)M, (Py_ssize_t)F);
      return NULL;
    }
  }
  npy_intp dims[2] = {M, backward ? C : F};
  PyObject *out;
  if (outo != Py_None) { /* a workspace reused across steps */
    buf_t bo;
    if (get_buf(outo, op, "out", 1, &bo) < 0) return NULL;
    if (bo.dtype != TP_FLOAT32 || bo.count != (size_t)(dims[0] * dims[1])) {
      PyErr_Format(PyExc_ValueError, "%s: out must be float32 with %zd x %zd elements", op, (Py_ssize_t)dims[0],
                   (Py_ssize_t)dims[1]);
      return NULL;
    }
    Py_INCREF(outo);
    out = outo;
  } else {
    out = PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    if (!out) return NULL;
  }
  float *o = PyArray_DATA((PyArrayObject *)out);
  Py_BEGIN_ALLOW_THREADS
  if (backward) tp_act_backward(o, bh.data, bd.data, M, F, act);
  else tp_act_forward(o, bh.data, M, F, act);
  Py_END_ALLOW_THREADS
  return out;
}

/* adamw_step(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step) and
 * sgd_step(p, g, buf_or_None, lr, momentum, weight_decay, first): in place. */
static int same_f32(PyObject *o, const char *op, const char *arg, size_t n, int writable, float **p) {
  buf_t b;
  if (get_buf(o, op, arg, writable, &b) < 0) return -1;
  if (b.dtype != TP_FLOAT32 || b.count != n) {
    PyErr_Format(PyExc_ValueError, "%s: %s must be float32 with %zu elements (like p), got %s with %zu", op, arg, n,
                 tp_dtype_name(b.dtype), b.count);
    return -1;
  }
  *p = b.data;
  return 0;
}

static PyObject *adamw_step(PyObject *mod, PyObject *args) {
  PyObject *po, *go, *mo, *vo;
  float lr, b1, b2, eps, wd;
  long long step;
  if (!PyArg_ParseTuple(args, "OOOOfffffL:adamw_step", &po, &go, &mo, &vo, &lr, &b1, &b2, &eps, &wd, &step))
    return NULL;
  buf_t bp;
  float *p, *g, *m, *v;
  if (get_buf(po, "adamw_step", "p", 1, &bp) < 0) return NULL;
  if (bp.dtype != TP_FLOAT32) {
    PyErr_Format(PyExc_TypeError, "adamw_step: p must be float32, got %s", tp_dtype_name(bp.dtype));
    return NULL;
  }
  p = bp.data;
  if (same_f32(go, "adamw_step", "g", bp.count, 0, &g) < 0 || same_f32(mo, "adamw_step", "m", bp.count, 1, &m) < 0 ||
      same_f32(vo, "adamw_step", "v", bp.count, 1, &v) < 0)
    return NULL;
  if (step < 1) {
    PyErr_Format(PyExc_ValueError, "adamw_step: step counts from 1, got %lld", step);
    return NULL;
  }
  Py_BEGIN_ALLOW_THREADS tp_adamw_step(p, g, m, v, (int64_t)bp.count, lr, b1, b2, eps, wd, step);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *sgd_step(PyObject *mod, PyObject *args) {
  PyObject *po, *go, *bo;
  float lr, mom, wd;
  int first;
  if (!PyArg_ParseTuple(args, "OOOfffp:sgd_step", &po, &go, &bo, &lr, &mom, &wd, &first)) return NULL;
  buf_t bp;
  float *g, *buf = NULL;
  if (get_buf(po, "sgd_step", "p", 1, &bp) < 0) return NULL;
  if (bp.dtype != TP_FLOAT32) {
    PyErr_Format(PyExc_TypeError, "sgd_step: p must be float32, got %s", tp_dtype_name(bp.dtype));
    return NULL;
  }
  if (same_f32(go, "sgd_step", "g", bp.count, 0, &g) < 0) return NULL;
  if (bo != Py_None && same_f32(bo, "sgd_step", "buf", bp.count, 1, &buf) < 0) return NULL;
  Py_BEGIN_ALLOW_THREADS tp_sgd_step(bp.data, g, buf, (int64_t)bp.count, lr, mom, wd, first);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

/* ------------------------------------------------------ VocabParallelEmbedding */

typedef struct {
  PyObject_HEAD
  tp_vocab_embedding_t E;
  CommObject *comm;
  tp_embedding_info_t info;
} EmbeddingObject;

static PyObject *emb_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"comm", "num_embeddings", "embedding_dim", "partition", "seed", NULL};
  PyObject *commo, *part = Py_None, *n_o, *dim_o, *seed_o = NULL;
  long long n, dim;
  uint64_t seed = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OO:VocabParallelEmbedding", kwlist, &commo, &n_o, &dim_o, &part,
                                   &seed_o))
    return NULL;
  if (int_arg(n_o, "VocabParallelEmbedding", "num_embeddings", 1, LLONG_MAX, &n) < 0 ||
      int_arg(dim_o, "VocabParallelEmbedding", "embedding_dim", 1, LLONG_MAX, &dim) < 0 ||
      (seed_o && seed_arg(seed_o, "VocabParallelEmbedding", &seed) < 0))
    return NULL;
  module_state *st = state_of_type(type);
  CommObject *co = layer_comm(st, commo, "VocabParallelEmbedding");
  if (!co) return NULL;
  tp_embedding_config_t cfg = TP_EMBEDDING_CONFIG_INITIALIZER;
  cfg.num_embeddings = n;
  cfg.embedding_dim = dim;
  cfg.seed = seed;
  int size;
  tp_comm_size(co->comm, &size);
  int64_t *sizes;
  if (parse_partition(part, size, &sizes) < 0) return NULL;
  cfg.partition = sizes;
  EmbeddingObject *self = (EmbeddingObject *)type->tp_alloc(type, 0);
  if (!self) {
    PyMem_Free(sizes);
    return NULL;
  }
  tp_status_t s;
  COMM_CALL(co, s, tp_vocab_embedding_create(&self->E, c_, &cfg));
  PyMem_Free(sizes);
  if (!layer_made((PyObject *)self, &self->comm, co, s, st, "VocabParallelEmbedding")) return NULL;
  tp_vocab_embedding_info(self->E, &self->info);
  return (PyObject *)self;
}

static void emb_dealloc(PyObject *o) {
  EmbeddingObject *self = (EmbeddingObject *)o;
  tp_vocab_embedding_destroy(self->E);
  layer_free(o, self->comm);
}

/* tokens: a 1-D C-contiguous int64 array; its length out. */
static int tokens_arg(PyObject *t, const char *op, const char *arg, int64_t *n) {
  buf_t b;
  if (get_buf(t, op, arg, 0, &b) < 0) return -1;
  if (b.dtype != TP_INT64 || PyArray_NDIM((PyArrayObject *)t) != 1) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be a 1-D int64 array", op, arg);
    return -1;
  }
  *n = (int64_t)b.count;
  return 0;
}

static PyObject *emb_forward(PyObject *o, PyObject *args) {
  EmbeddingObject *self = (EmbeddingObject *)o;
  PyObject *to, *out = Py_None;
  if (!PyArg_ParseTuple(args, "O|O:forward", &to, &out)) return NULL;
  if (!live(self->comm, "forward")) return NULL;
  int64_t M;
  if (tokens_arg(to, "embedding forward", "tokens", &M) < 0) return NULL;
  PyObject *y = layer_output(out, "embedding forward", M, self->info.dim);
  if (!y) return NULL;
  const int64_t *tp = PyArray_DATA((PyArrayObject *)to);
  float *yp = PyArray_DATA((PyArrayObject *)y);
  tp_status_t s;
  COMM_CALL(self->comm, s, ((void)c_, tp_vocab_embedding_forward(self->E, yp, tp, M)));
  if (s != TP_SUCCESS) {
    Py_DECREF(y);
    return layer_error(self->comm, s, "embedding forward", 0);
  }
  return y;
}

static PyObject *emb_backward(PyObject *o, PyObject *dy) {
  EmbeddingObject *self = (EmbeddingObject *)o;
  if (!live(self->comm, "backward")) return NULL;
  int64_t M;
  if (lin_arg(dy, "embedding backward", "dy", self->info.dim, &M) < 0) return NULL;
  const float *dp = PyArray_DATA((PyArrayObject *)dy);
  tp_status_t s;
  COMM_CALL(self->comm, s, ((void)c_, tp_vocab_embedding_backward(self->E, dp, M)));
  if (s != TP_SUCCESS) return layer_error(self->comm, s, "embedding backward", 1);
  Py_RETURN_NONE;
}

static PyObject *emb_get(PyObject *o, void *which) {
  EmbeddingObject *self = (EmbeddingObject *)o;
  tp_embedding_info_t *i = &self->info;
  switch ((intptr_t)which) {
    case 0: return owned_view(o, i->weight, 2, i->local, i->dim);
    case 1: return owned_view(o, i->grad_weight, 2, i->local, i->dim);
    default: return Py_BuildValue("{s:L,s:L}", "offset", (long long)i->offset, "local", (long long)i->local);
  }
}

static PyGetSetDef emb_getset[] = {
    {"weight", emb_get, NULL, "this rank's rows of the table (a view)", (void *)0},
    {"grad_weight", emb_get, NULL, "their gradient (a view)", (void *)1},
    {"shard", emb_get, NULL, "offset/local of this rank's vocabulary slice", (void *)2},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef emb_methods[] = {
    {"forward", emb_forward, METH_VARARGS, "forward(tokens[M] int64, out=None) -> y[M, dim] (collective)"},
    {"backward", emb_backward, METH_O, "backward(dy[M, dim]): accumulates grad_weight"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot emb_slots[] = {
    {Py_tp_new, emb_new},
    {Py_tp_dealloc, emb_dealloc},
    {Py_tp_methods, emb_methods},
    {Py_tp_getset, emb_getset},
    {Py_tp_doc, "VocabEmbedding(comm, num_embeddings, embedding_dim, partition=None, seed=0): "
                "use tpcore.VocabParallelEmbedding"},
    {0, NULL},
};

static PyType_Spec emb_spec = {
    .name = "tpcore._C.VocabEmbedding",
    .basicsize = sizeof(EmbeddingObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = emb_slots,
};

/* --------------------------------------------------------- VocabCrossEntropy */

typedef struct {
  PyObject_HEAD
  tp_vocab_xent_t X;
  CommObject *comm;
  PyObject *logits; /* the last forward's logits, kept alive for backward */
  int64_t M, V;
} XentObject;

static PyObject *xent_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"comm", NULL};
  PyObject *commo;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O:VocabCrossEntropy", kwlist, &commo)) return NULL;
  module_state *st = state_of_type(type);
  CommObject *co = layer_comm(st, commo, "VocabParallelCrossEntropy");
  if (!co) return NULL;
  XentObject *self = (XentObject *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  tp_status_t s = tp_vocab_xent_create(&self->X, co->comm);
  if (!layer_made((PyObject *)self, &self->comm, co, s, st, "VocabParallelCrossEntropy")) return NULL;
  return (PyObject *)self;
}

static void xent_dealloc(PyObject *o) {
  XentObject *self = (XentObject *)o;
  tp_vocab_xent_destroy(self->X);
  Py_XDECREF(self->logits);
  layer_free(o, self->comm);
}

/* forward(logits[M, V], targets[M], vocab_offset=-1, ignore_index=-100) -> (losses[M], valid, vocab) */
static PyObject *xent_forward(PyObject *o, PyObject *args) {
  XentObject *self = (XentObject *)o;
  PyObject *lo_, *to, *off_o = NULL, *ignore_o = NULL;
  long long off = -1, ignore = -100;
  if (!PyArg_ParseTuple(args, "OO|OO:forward", &lo_, &to, &off_o, &ignore_o)) return NULL;
  if ((off_o && int_arg(off_o, "cross-entropy", "vocab_offset", -1, LLONG_MAX, &off) < 0) ||
      (ignore_o && int_arg(ignore_o, "cross-entropy", "ignore_index", LLONG_MIN, LLONG_MAX, &ignore) < 0))
    return NULL;
  if (!live(self->comm, "forward")) return NULL;
  buf_t b;
  if (get_buf(lo_, "cross-entropy", "logits", 0, &b) < 0) return NULL;
  if (b.dtype != TP_FLOAT32 || PyArray_NDIM((PyArrayObject *)lo_) != 2) {
    PyErr_SetString(PyExc_TypeError, "cross-entropy: logits must be a 2-D float32 array (rows, shard width)");
    return NULL;
  }
  int64_t M = PyArray_DIM((PyArrayObject *)lo_, 0), V = PyArray_DIM((PyArrayObject *)lo_, 1), Mt;
  if (tokens_arg(to, "cross-entropy", "targets", &Mt) < 0) return NULL;
  if (Mt != M) {
    PyErr_Format(PyExc_ValueError, "cross-entropy: %lld targets for %lld rows of logits", (long long)Mt, (long long)M);
    return NULL;
  }
  npy_intp d[1] = {(npy_intp)M};
  PyObject *losses = PyArray_SimpleNew(1, d, NPY_FLOAT32);
  if (!losses) return NULL;
  float *lp = PyArray_DATA((PyArrayObject *)losses);
  const float *xp = b.data;
  const int64_t *tp = PyArray_DATA((PyArrayObject *)to);
  int64_t valid = 0, vocab = 0;
  tp_status_t s;
  COMM_CALL(self->comm, s, ((void)c_, tp_vocab_xent_forward(self->X, lp, xp, tp, M, V, off, ignore, &valid, &vocab)));
  Py_CLEAR(self->logits);
  if (s != TP_SUCCESS) {
    Py_DECREF(losses);
    return layer_error(self->comm, s, "cross-entropy forward", 0);
  }
  Py_INCREF(lo_);
  self->logits = lo_;
  self->M = M;
  self->V = V;
  return Py_BuildValue("NLL", losses, (long long)valid, (long long)vocab);
}

/* backward(dloss=None, scale=1.0, out=None) -> dlogits[M, V] */
static PyObject *xent_backward(PyObject *o, PyObject *args) {
  XentObject *self = (XentObject *)o;
  PyObject *dlo = Py_None, *out = Py_None;
  float scale = 1.0f;
  if (!PyArg_ParseTuple(args, "|OfO:backward", &dlo, &scale, &out)) return NULL;
  if (!live(self->comm, "backward")) return NULL;
  if (!self->logits) {
    PyErr_SetString(PyExc_RuntimeError, "cross-entropy backward: called before forward");
    return NULL;
  }
  const float *dl = NULL;
  if (dlo != Py_None) {
    buf_t b;
    if (get_buf(dlo, "cross-entropy backward", "dloss", 0, &b) < 0) return NULL;
    if (b.dtype != TP_FLOAT32 || (int64_t)b.count != self->M) {
      PyErr_Format(PyExc_ValueError, "cross-entropy backward: dloss must be float32 with one entry per row (%lld)",
                   (long long)self->M);
      return NULL;
    }
    dl = b.data;
  }
  PyObject *d = layer_output(out, "cross-entropy backward", self->M, self->V);
  if (!d) return NULL;
  float *dp = PyArray_DATA((PyArrayObject *)d);
  tp_status_t s;
  COMM_CALL(self->comm, s, ((void)c_, tp_vocab_xent_backward(self->X, dp, dl, scale)));
  if (s != TP_SUCCESS) {
    Py_DECREF(d);
    return layer_error(self->comm, s, "cross-entropy backward", 1);
  }
  return d;
}

static PyMethodDef xent_methods[] = {
    {"forward", xent_forward, METH_VARARGS,
     "forward(logits[M, V], targets[M] int64, vocab_offset=-1, ignore_index=-100) -> (losses[M], valid, vocab)"},
    {"backward", xent_backward, METH_VARARGS, "backward(dloss=None, scale=1.0, out=None) -> dlogits[M, V]"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot xent_slots[] = {
    {Py_tp_new, xent_new},
    {Py_tp_dealloc, xent_dealloc},
    {Py_tp_methods, xent_methods},
    {Py_tp_doc, "VocabCrossEntropy(comm): use tpcore.VocabParallelCrossEntropy"},
    {0, NULL},
};

static PyType_Spec xent_spec = {
    .name = "tpcore._C.VocabCrossEntropy",
    .basicsize = sizeof(XentObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = xent_slots,
};

/* ------------------------------------------------------------ TransformerBlock */

typedef struct {
  PyObject_HEAD
  tp_block_t K;
  CommObject *comm;
  int64_t C;
} BlockObject;

static PyObject *blk_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"comm", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "norm", "eps", "activation",
                           "pre_norm", "bias", "causal", "rope_theta", "head_partition", "ffn_partition", "seed",
                           "attention_only", NULL};
  PyObject *commo, *hpart = Py_None, *fpart = Py_None, *dim_o[5], *seed_o = NULL;
  long long dims[5]; /* hidden, heads, kv_heads (0: = heads), head_dim, ffn_hidden */
  static const char *dim_names[5] = {"hidden", "heads", "kv_heads", "head_dim", "ffn_hidden"};
  const char *norm = "layernorm", *act = "gelu";
  float eps = 1e-5f, theta = 0.0f;
  int pre = 1, bias = 1, causal = 1, attn_only = 0;
  uint64_t seed = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|sfspppfOOOp:TransformerBlock", kwlist, &commo, &dim_o[0],
                                   &dim_o[1], &dim_o[2], &dim_o[3], &dim_o[4], &norm, &eps, &act, &pre, &bias, &causal,
                                   &theta, &hpart, &fpart, &seed_o, &attn_only))
    return NULL;
  for (int i = 0; i < 5; i++)
    if (int_arg(dim_o[i], "TransformerBlock", dim_names[i], i == 2 || (i == 4 && attn_only) ? 0 : 1, DIM_MAX,
                &dims[i]) < 0)
      return NULL;
  if (seed_o && seed_arg(seed_o, "TransformerBlock", &seed) < 0) return NULL;
  long long C = dims[0], H = dims[1], Hk = dims[2], D = dims[3], F = dims[4];
  module_state *st = state_of_type(type);
  CommObject *co = layer_comm(st, commo, "TransformerBlock");
  if (!co) return NULL;
  tp_block_config_t cfg = TP_BLOCK_CONFIG_INITIALIZER;
  cfg.hidden = C, cfg.heads = H, cfg.kv_heads = Hk, cfg.head_dim = D, cfg.ffn_hidden = F;
  if (strcmp(norm, "layernorm") == 0) cfg.norm = TP_NORM_LAYER;
  else if (strcmp(norm, "rmsnorm") == 0) cfg.norm = TP_NORM_RMS;
  else {
    PyErr_Format(PyExc_ValueError, "TransformerBlock: norm must be 'layernorm' or 'rmsnorm', got '%s'", norm);
    return NULL;
  }
  if (parse_act(act, &cfg.activation) < 0) return NULL;
  cfg.eps = eps, cfg.pre_norm = pre, cfg.bias = bias, cfg.causal = causal, cfg.rope_theta = theta, cfg.seed = seed;
  cfg.attention_only = attn_only;
  int size;
  tp_comm_size(co->comm, &size);
  int64_t *hs = NULL, *fs = NULL;
  if (parse_partition(hpart, size, &hs) < 0 || parse_partition(fpart, size, &fs) < 0) {
    PyMem_Free(hs);
    return NULL;
  }
  cfg.head_partition = hs, cfg.ffn_partition = fs;
  BlockObject *self = (BlockObject *)type->tp_alloc(type, 0);
  if (!self) {
    PyMem_Free(hs), PyMem_Free(fs);
    return NULL;
  }
  tp_status_t s;
  COMM_CALL(co, s, tp_block_create(&self->K, c_, &cfg));
  PyMem_Free(hs), PyMem_Free(fs);
  if (!layer_made((PyObject *)self, &self->comm, co, s, st, "TransformerBlock")) return NULL;
  self->C = C;
  return (PyObject *)self;
}

static void blk_dealloc(PyObject *o) {
  BlockObject *self = (BlockObject *)o;
  tp_block_destroy(self->K);
  layer_free(o, self->comm);
}

/* forward(x[B*T, C], B, T, pos0=None, key_mask=None, use_cache=False, need_backward=False, out=None) */
static PyObject *blk_forward(PyObject *o, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"x", "B", "T", "pos0", "key_mask", "use_cache", "need_backward", "out", NULL};
  BlockObject *self = (BlockObject *)o;
  PyObject *x, *po = Py_None, *mo = Py_None, *out = Py_None, *B_o, *T_o;
  long long B, T, BT;
  int use_cache = 0, need_backward = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OOppO:forward", kwlist, &x, &B_o, &T_o, &po, &mo, &use_cache,
                                   &need_backward, &out))
    return NULL;
  if (int_arg(B_o, "block forward", "B", 0, LLONG_MAX, &B) < 0 ||
      int_arg(T_o, "block forward", "T", 0, LLONG_MAX, &T) < 0)
    return NULL;
  if (!live(self->comm, "forward")) return NULL;
  int64_t M;
  if (lin_arg(x, "block forward", "x", self->C, &M) < 0) return NULL;
  if (__builtin_mul_overflow(B, T, &BT) || M != BT) {
    PyErr_Format(PyExc_ValueError, "block forward: x has %lld rows, not B * T = %lld x %lld", (long long)M,
                 (long long)B, (long long)T);
    return NULL;
  }
  tp_block_batch_t bt = {B, T, NULL, NULL, use_cache, need_backward};
  if (po != Py_None) {
    int64_t n;
    if (tokens_arg(po, "block forward", "pos0", &n) < 0) return NULL;
    if (n != B) {
      PyErr_Format(PyExc_ValueError, "block forward: pos0 needs %lld entries, got %lld", (long long)B, (long long)n);
      return NULL;
    }
    bt.pos0 = PyArray_DATA((PyArrayObject *)po);
  }
  if (mo != Py_None) {
    buf_t b;
    if (get_buf(mo, "block forward", "key_mask", 0, &b) < 0) return NULL;
    if (b.dtype != TP_UINT8 || (int64_t)b.count != M) {
      PyErr_Format(PyExc_ValueError, "block forward: key_mask must be uint8 with B * T = %lld entries", (long long)M);
      return NULL;
    }
    bt.key_mask = b.data;
  }
  PyObject *y = layer_output(out, "block forward", M, self->C);
  if (!y) return NULL;
  const float *xp = PyArray_DATA((PyArrayObject *)x);
  float *yp = PyArray_DATA((PyArrayObject *)y);
  tp_status_t s;
  COMM_CALL(self->comm, s, ((void)c_, tp_block_forward(self->K, yp, xp, &bt)));
  if (s != TP_SUCCESS) {
    Py_DECREF(y);
    if (s == TP_ERR_INVALID_USAGE) {
      PyErr_SetString(PyExc_ValueError, tp_last_error());
      return NULL;
    }
    return layer_error(self->comm, s, "block forward", 0);
  }
  return y;
}

static PyObject *blk_backward(PyObject *o, PyObject *args) {
  BlockObject *self = (BlockObject *)o;
  PyObject *dy, *out = Py_None;
  if (!PyArg_ParseTuple(args, "O|O:backward", &dy, &out)) return NULL;
  if (!live(self->comm, "backward")) return NULL;
  int64_t M;
  if (lin_arg(dy, "block backward", "dy", self->C, &M) < 0) return NULL;
  PyObject *dx = layer_output(out, "block backward", M, self->C);
  if (!dx) return NULL;
  const float *dp = PyArray_DATA((PyArrayObject *)dy);
  float *xp = PyArray_DATA((PyArrayObject *)dx);
  tp_status_t s;
  COMM_CALL(self->comm, s, ((void)c_, tp_block_backward(self->K, xp, dp, M)));
  if (s != TP_SUCCESS) {
    Py_DECREF(dx);
    return layer_error(self->comm, s, "block backward", 1);
  }
  return dx;
}

static PyObject *blk_cache(PyObject *o, PyObject *args) {
  BlockObject *self = (BlockObject *)o;
  PyObject *batch_o, *len_o;
  long long batch, len;
  if (!PyArg_ParseTuple(args, "OO:cache", &batch_o, &len_o)) return NULL;
  if (int_arg(batch_o, "TransformerBlock.cache", "batch", 1, DIM_MAX, &batch) < 0 ||
      int_arg(len_o, "TransformerBlock.cache", "max_len", 1, DIM_MAX, &len) < 0)
    return NULL;
  tp_status_t s = tp_block_cache(self->K, batch, len);
  if (s != TP_SUCCESS) return raise_status(cstate((PyObject *)self->comm), s, "cache");
  Py_RETURN_NONE;
}

/* {name: (param view, grad view)} of this rank's shard */
static PyObject *blk_params(PyObject *o, PyObject *unused) {
  tp_param_t p[32];
  int n = tp_block_params(((BlockObject *)o)->K, p, 32);
  PyObject *d = PyDict_New();
  if (!d) return NULL;
  for (int i = 0; i < n && i < 32; i++) {
    int nd = p[i].ndim;
    PyObject *a = owned_view(o, p[i].data, nd, p[i].rows, p[i].cols), *g = owned_view(o, p[i].grad, nd, p[i].rows, p[i].cols);
    PyObject *t = (a && g) ? PyTuple_Pack(2, a, g) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(g);
    if (!t || PyDict_SetItemString(d, p[i].name, t) < 0) {
      Py_XDECREF(t);
      Py_DECREF(d);
      return NULL;
    }
    Py_DECREF(t);
  }
  return d;
}

static PyObject *blk_info(PyObject *o, void *unused) {
  tp_block_info_t i;
  tp_block_info(((BlockObject *)o)->K, &i);
  return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L,s:O}", "q0", (long long)i.q0, "nq", (long long)i.nq, "k0",
                       (long long)i.k0, "nk", (long long)i.nk, "cache_batch", (long long)i.cache_batch, "cache_len",
                       (long long)i.cache_len, "kv_replicated", i.kv_replicated ? Py_True : Py_False);
}

static PyGetSetDef blk_getset[] = {
    {"info", blk_info, NULL, "this rank's heads and the KV cache's capacity", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef blk_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))blk_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(x[B*T, C], B, T, pos0=None, key_mask=None, use_cache=False, need_backward=False, out=None) -> y"},
    {"backward", blk_backward, METH_VARARGS, "backward(dy[B*T, C], out=None) -> dx; accumulates the gradients"},
    {"cache", blk_cache, METH_VARARGS, "cache(batch, max_len): (re)allocate the KV cache"},
    {"params", blk_params, METH_NOARGS, "{name: (param, grad)} views of this rank's shard"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot blk_slots[] = {
    {Py_tp_new, blk_new},
    {Py_tp_dealloc, blk_dealloc},
    {Py_tp_methods, blk_methods},
    {Py_tp_getset, blk_getset},
    {Py_tp_doc, "TransformerBlock(comm, hidden, heads, kv_heads, head_dim, ffn_hidden, ...): use tpcore.TransformerBlock"},
    {0, NULL},
};

static PyType_Spec blk_spec = {
    .name = "tpcore._C.TransformerBlock",
    .basicsize = sizeof(BlockObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = blk_slots,
};

/* linear_forward(x[M, K], w[N, K], b[N] or None, out=None) -> y[M, N] = x w^T + b (tpcore's BLAS);
 * linear_backward(dy[M, N], x[M, K], w[N, K], dw[N, K] or None, dx_out=None) -> dx (dw accumulates) */
static int f32_matrix(PyObject *o, const char *op, const char *arg, int writable, int64_t *r, int64_t *c, float **p) {
  buf_t b;
  if (get_buf(o, op, arg, writable, &b) < 0) return -1;
  if (b.dtype != TP_FLOAT32 || PyArray_NDIM((PyArrayObject *)o) != 2) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be a 2-D float32 array", op, arg);
    return -1;
  }
  *r = PyArray_DIM((PyArrayObject *)o, 0);
  *c = PyArray_DIM((PyArrayObject *)o, 1);
  *p = b.data;
  return 0;
}

static PyObject *linear_forward_k(PyObject *mod, PyObject *args) {
  PyObject *xo, *wo, *bo = Py_None, *out = Py_None;
  if (!PyArg_ParseTuple(args, "OO|OO:linear_forward", &xo, &wo, &bo, &out)) return NULL;
  int64_t M, K, N, K2;
  float *x, *w, *b = NULL;
  if (f32_matrix(xo, "linear_forward", "x", 0, &M, &K, &x) < 0 || f32_matrix(wo, "linear_forward", "w", 0, &N, &K2, &w) < 0)
    return NULL;
  if (K2 != K || M > INT_MAX || N > INT_MAX || K > INT_MAX) {
    PyErr_Format(PyExc_ValueError, "linear_forward: x is (%lld, %lld) but w is (%lld, %lld)", (long long)M,
                 (long long)K, (long long)N, (long long)K2);
    return NULL;
  }
  if (bo != Py_None && same_f32(bo, "linear_forward", "b", (size_t)N, 0, &b) < 0) return NULL;
  PyObject *y = layer_output(out, "linear_forward", M, N);
  if (!y) return NULL;
  float *yp = PyArray_DATA((PyArrayObject *)y);
  Py_BEGIN_ALLOW_THREADS tp_linear_forward(yp, x, w, b, M, K, N);
  Py_END_ALLOW_THREADS
  return y;
}

static PyObject *linear_backward_k(PyObject *mod, PyObject *args) {
  PyObject *dyo, *xo, *wo, *dwo = Py_None, *out = Py_None;
  if (!PyArg_ParseTuple(args, "OOO|OO:linear_backward", &dyo, &xo, &wo, &dwo, &out)) return NULL;
  int64_t M, N, M2, K, N2, K2;
  float *dy, *x, *w, *dw = NULL;
  if (f32_matrix(dyo, "linear_backward", "dy", 0, &M, &N, &dy) < 0 ||
      f32_matrix(xo, "linear_backward", "x", 0, &M2, &K, &x) < 0 ||
      f32_matrix(wo, "linear_backward", "w", 0, &N2, &K2, &w) < 0)
    return NULL;
  if (M2 != M || N2 != N || K2 != K || M > INT_MAX || N > INT_MAX || K > INT_MAX) {
    PyErr_SetString(PyExc_ValueError, "linear_backward: dy (M, N), x (M, K) and w (N, K) do not agree");
    return NULL;
  }
  if (dwo != Py_None && same_f32(dwo, "linear_backward", "dw", (size_t)(N * K), 1, &dw) < 0) return NULL;
  PyObject *dx = layer_output(out, "linear_backward", M, K);
  if (!dx) return NULL;
  float *dxp = PyArray_DATA((PyArrayObject *)dx);
  Py_BEGIN_ALLOW_THREADS tp_linear_backward(dxp, dw, NULL, dy, x, w, M, K, N, 0);
  Py_END_ALLOW_THREADS
  return dx;
}

/* norm_forward(kind, x[M, C], w[C], b[C] or None, eps) -> (y, mean, rstd);
 * norm_backward(kind, dy, x, w, mean, rstd, dw, db or None) -> dx (dw, db accumulate) */
static int norm_kind(const char *k) {
  if (strcmp(k, "layernorm") == 0) return 0;
  if (strcmp(k, "rmsnorm") == 0) return 1;
  PyErr_Format(PyExc_ValueError, "norm must be 'layernorm' or 'rmsnorm', got '%s'", k);
  return -1;
}

static PyObject *norm_forward(PyObject *mod, PyObject *args) {
  const char *kind;
  PyObject *xo, *wo, *bo;
  float eps;
  if (!PyArg_ParseTuple(args, "sOOOf:norm_forward", &kind, &xo, &wo, &bo, &eps)) return NULL;
  int rms = norm_kind(kind);
  if (rms < 0) return NULL;
  int64_t C;
  buf_t bx;
  if (get_buf(xo, "norm", "x", 0, &bx) < 0) return NULL;
  if (bx.dtype != TP_FLOAT32 || PyArray_NDIM((PyArrayObject *)xo) != 2) {
    PyErr_SetString(PyExc_TypeError, "norm: x must be a 2-D float32 array");
    return NULL;
  }
  int64_t M = PyArray_DIM((PyArrayObject *)xo, 0);
  C = PyArray_DIM((PyArrayObject *)xo, 1);
  float *w, *b = NULL;
  if (same_f32(wo, "norm", "w", (size_t)C, 0, &w) < 0) return NULL;
  if (bo != Py_None && same_f32(bo, "norm", "b", (size_t)C, 0, &b) < 0) return NULL;
  npy_intp d2[2] = {(npy_intp)M, (npy_intp)C}, d1[1] = {(npy_intp)M};
  PyObject *y = PyArray_SimpleNew(2, d2, NPY_FLOAT32), *mu = PyArray_SimpleNew(1, d1, NPY_FLOAT32),
           *rs = PyArray_SimpleNew(1, d1, NPY_FLOAT32);
  if (!y || !mu || !rs) {
    Py_XDECREF(y), Py_XDECREF(mu), Py_XDECREF(rs);
    return NULL;
  }
  float *yp = PyArray_DATA((PyArrayObject *)y), *mp = PyArray_DATA((PyArrayObject *)mu),
        *rp = PyArray_DATA((PyArrayObject *)rs);
  const float *xp = bx.data;
  Py_BEGIN_ALLOW_THREADS
  if (rms) tp_rmsnorm_forward(yp, rp, xp, w, M, C, eps);
  else tp_layernorm_forward(yp, mp, rp, xp, w, b, M, C, eps);
  Py_END_ALLOW_THREADS
  return Py_BuildValue("NNN", y, mu, rs);
}

static PyObject *norm_backward(PyObject *mod, PyObject *args) {
  const char *kind;
  PyObject *dyo, *xo, *wo, *mo, *ro, *dwo, *dbo;
  if (!PyArg_ParseTuple(args, "sOOOOOOO:norm_backward", &kind, &dyo, &xo, &wo, &mo, &ro, &dwo, &dbo)) return NULL;
  int rms = norm_kind(kind);
  if (rms < 0) return NULL;
  buf_t bx;
  if (get_buf(xo, "norm", "x", 0, &bx) < 0) return NULL;
  if (bx.dtype != TP_FLOAT32 || PyArray_NDIM((PyArrayObject *)xo) != 2) {
    PyErr_SetString(PyExc_TypeError, "norm: x must be a 2-D float32 array");
    return NULL;
  }
  int64_t M = PyArray_DIM((PyArrayObject *)xo, 0), C = PyArray_DIM((PyArrayObject *)xo, 1);
  float *dy, *w, *mu, *rs, *dw, *db = NULL;
  if (same_f32(dyo, "norm", "dy", (size_t)(M * C), 0, &dy) < 0 || same_f32(wo, "norm", "w", (size_t)C, 0, &w) < 0 ||
      same_f32(mo, "norm", "mean", (size_t)M, 0, &mu) < 0 || same_f32(ro, "norm", "rstd", (size_t)M, 0, &rs) < 0 ||
      same_f32(dwo, "norm", "dw", (size_t)C, 1, &dw) < 0 ||
      (dbo != Py_None && same_f32(dbo, "norm", "db", (size_t)C, 1, &db) < 0))
    return NULL;
  npy_intp d2[2] = {(npy_intp)M, (npy_intp)C};
  PyObject *dx = PyArray_SimpleNew(2, d2, NPY_FLOAT32);
  if (!dx) return NULL;
  float *dxp = PyArray_DATA((PyArrayObject *)dx);
  const float *xp = bx.data;
  Py_BEGIN_ALLOW_THREADS
  if (rms) tp_rmsnorm_backward(dxp, dw, dy, xp, w, rs, M, C);
  else tp_layernorm_backward(dxp, dw, db, dy, xp, w, mu, rs, M, C);
  Py_END_ALLOW_THREADS
  return dx;
}

static PyObject *act_forward(PyObject *m, PyObject *args) { return act_call(args, 0); }
static PyObject *act_backward(PyObject *m, PyObject *args) { return act_call(args, 1); }

static PyMethodDef module_methods[] = {
    {"build_info", build_info, METH_NOARGS, "what this build contains"},
    {"set_num_threads", set_num_threads, METH_O, "set_num_threads(n): BLAS threads of this process"},
    {"get_num_threads", get_num_threads, METH_NOARGS, "BLAS threads of this process"},
    {"act_forward", act_forward, METH_VARARGS, "act_forward(name, h) -> act(h)"},
    {"adamw_step", adamw_step, METH_VARARGS, "adamw_step(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step)"},
    {"sgd_step", sgd_step, METH_VARARGS, "sgd_step(p, g, buf, lr, momentum, weight_decay, first)"},
    {"act_backward", act_backward, METH_VARARGS, "act_backward(name, h, dout) -> dh"},
    {"linear_forward", linear_forward_k, METH_VARARGS, "linear_forward(x, w, b=None, out=None) -> x @ w.T + b"},
    {"linear_backward", linear_backward_k, METH_VARARGS,
     "linear_backward(dy, x, w, dw=None, out=None) -> dy @ w; dw += dy.T @ x"},
    {"norm_forward", norm_forward, METH_VARARGS, "norm_forward(kind, x, w, b, eps) -> (y, mean, rstd)"},
    {"norm_backward", norm_backward, METH_VARARGS,
     "norm_backward(kind, dy, x, w, mean, rstd, dw, db) -> dx; dw and db accumulate"},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *m) {
  module_state *st = PyModule_GetState(m);
  st->CommError = PyErr_NewExceptionWithDoc(
      "tpcore.CommError",
      "A collective failed: a peer failed, aborted, died or called a different collective. "
      "Attributes: code (status name), peer_failure (True when another rank caused it).",
      PyExc_RuntimeError, NULL);
  if (!st->CommError) return -1;
  PyObject *bases = PyTuple_Pack(2, st->CommError, PyExc_TimeoutError);
  if (!bases) return -1;
  st->CommTimeout = PyErr_NewExceptionWithDoc(
      "tpcore.CommTimeout", "A wait ran past the communicator's timeout; names the rank waited for.",
      bases, NULL);
  Py_DECREF(bases);
  if (!st->CommTimeout) return -1;
  st->CommType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &comm_spec, NULL);
  if (!st->CommType) return -1;
  st->SharedBufferType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &sb_spec, NULL);
  if (!st->SharedBufferType) return -1;
  st->LinearType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &lin_spec, NULL);
  if (!st->LinearType) return -1;
  st->MLPType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &mlp_spec, NULL);
  if (!st->MLPType) return -1;
  st->EmbeddingType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &emb_spec, NULL);
  if (!st->EmbeddingType) return -1;
  st->XentType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &xent_spec, NULL);
  if (!st->XentType) return -1;
  st->BlockType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &blk_spec, NULL);
  if (!st->BlockType) return -1;
  if (PyModule_AddObjectRef(m, "CommError", st->CommError) < 0 ||
      PyModule_AddObjectRef(m, "CommTimeout", st->CommTimeout) < 0 ||
      PyModule_AddObjectRef(m, "Comm", (PyObject *)st->CommType) < 0 ||
      PyModule_AddObjectRef(m, "SharedBuffer", (PyObject *)st->SharedBufferType) < 0 ||
      PyModule_AddObjectRef(m, "ParallelLinear", (PyObject *)st->LinearType) < 0 ||
      PyModule_AddObjectRef(m, "ParallelMLP", (PyObject *)st->MLPType) < 0 ||
      PyModule_AddObjectRef(m, "VocabEmbedding", (PyObject *)st->EmbeddingType) < 0 ||
      PyModule_AddObjectRef(m, "VocabCrossEntropy", (PyObject *)st->XentType) < 0 ||
      PyModule_AddObjectRef(m, "TransformerBlock", (PyObject *)st->BlockType) < 0)
    return -1;
  return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
  module_state *st = PyModule_GetState(m);
  if (st) {
    Py_VISIT(st->CommError);
    Py_VISIT(st->CommTimeout);
    Py_VISIT(st->CommType);
    Py_VISIT(st->SharedBufferType);
    Py_VISIT(st->LinearType);
    Py_VISIT(st->MLPType);
    Py_VISIT(st->EmbeddingType);
    Py_VISIT(st->XentType);
    Py_VISIT(st->BlockType);
  }
  return 0;
}

static int module_clear(PyObject *m) {
  module_state *st = PyModule_GetState(m);
  if (st) {
    Py_CLEAR(st->CommError);
    Py_CLEAR(st->CommTimeout);
    Py_CLEAR(st->CommType);
    Py_CLEAR(st->SharedBufferType);
    Py_CLEAR(st->LinearType);
    Py_CLEAR(st->MLPType);
    Py_CLEAR(st->EmbeddingType);
    Py_CLEAR(st->XentType);
    Py_CLEAR(st->BlockType);
  }
  return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef tpcore_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tpcore._C",
    .m_doc = "C core of tpcore: communicators, tensor-parallel layers, kernels.",
    .m_size = sizeof(module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
};

PyMODINIT_FUNC PyInit__C(void) {
  import_array();
  return PyModuleDef_Init(&tpcore_module);
}
