/*
 * comm.c: the Comm type (tpcore._C.Comm), a communicator of the C core, and
 * SharedBuffer, the registered memory that Comm.alloc hands out.  Every call
 * checks its arrays (arrays.c), runs with the GIL released through COMM_CALL
 * (ext.h: close() from another thread aborts the call, and the last call out
 * destroys the communicator) and maps a failed status to an exception (errors.c).
 */
#include "ext.h"

/* ---------------------------------------------------------- argument helpers */

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
    if (strcmp(s, "mean") == 0) {
      *out = TP_AVG;
      return 0;
    }
    PyErr_Format(PyExc_ValueError,
                 "%s: op must be one of 'sum', 'prod', 'min', 'max', 'avg' or 'mean' (avg's alias), got '%s'", op, s);
    return -1;
  }
  PyErr_Format(PyExc_TypeError, "%s: op must be a string ('sum', 'prod', 'min', 'max', 'avg' or 'mean'), got %s", op,
               Py_TYPE(o)->tp_name);
  return -1;
}

/* ------------------------------------------------------------ SharedBuffer */

typedef struct {
  PyObject_HEAD tp_mem_t mem;
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
    {Py_tp_doc,
     "Memory shared with the peers of a communicator (registered); "
     "exposes the buffer protocol."},
    {0, NULL},
};

PyType_Spec sb_spec = {
    .name = "tpcore._C.SharedBuffer",
    .basicsize = sizeof(SharedBuffer),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = sb_slots,
};

/* -------------------------------------------------------------------- Comm */

static PyObject *comm_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"world_size", "rank",      "job_id",        "timeout", "backend",
                           "spin_us",    "device_id", "job_id_unique", NULL};
  int world, rank, spin_us = -1, device_id = -1, unique = 0;
  const char *job, *backend = "shm";
  double timeout = -1;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "iis|dsiip:Comm", kwlist, &world, &rank, &job, &timeout, &backend,
                                   &spin_us, &device_id, &unique))
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
  cfg.device_id = device_id;
  cfg.job_id_unique = unique;
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

/* This rank could not make an array (`what`: "output"; nbytes: a decimal text, or "more than
 * 2**64") for the collective `name` it is about to call (exc: the MemoryError, or the ValueError
 * of a size no array can have).  The peers are in that call or will be, waiting for this rank: the
 * communicator is aborted with one sentence naming the call, this rank and why, so that their
 * calls fail with it instead of a timeout or "rank R closed the communicator" (at world 1
 * nobody waits: it stays usable).  Returns the error for this rank: exc's type, the sentence. */
static PyObject *output_error(CommObject *self, const char *name, const char *what, const char *nbytes, PyObject *exc) {
  int size = 1, rank = 0;
  uint64_t seq = 0;
  tp_comm_size(self->comm, &size);
  tp_comm_rank(self->comm, &rank);
  tp_comm_seq(self->comm, &seq);
  PyObject *es = PyObject_Str(exc);
  const char *why = es ? PyUnicode_AsUTF8(es) : NULL;
  if (!why) PyErr_Clear();
  char reason[768];
  snprintf(reason, sizeof reason, "%s #%llu: rank %d could not allocate its %s of %s bytes (%s: %s)", name,
           (unsigned long long)seq + 1, rank, what, nbytes, Py_TYPE(exc)->tp_name, why ? why : "?");
  Py_XDECREF(es);
  if (size > 1) tp_comm_abort(self->comm, reason); /* the peers' CommError: "rank R aborted ...: <reason>" */
  PyObject *type = PyObject_TypeCheck(exc, (PyTypeObject *)PyExc_MemoryError) ? PyExc_MemoryError : PyExc_ValueError;
  return PyObject_CallFunction(type, "s", reason);
}

/* output_failed(op, what, nbytes, exc) -> the exception to raise (Comm._made's failure path) */
static PyObject *comm_output_failed(PyObject *o, PyObject *args) {
  CommObject *self = (CommObject *)o;
  const char *name, *what, *nbytes;
  PyObject *exc;
  if (!PyArg_ParseTuple(args, "sssO:output_failed", &name, &what, &nbytes, &exc)) return NULL;
  if (!live(self, name)) return NULL;
  return output_error(self, name, what, nbytes, exc);
}

/* The new output of a collective (out=None), times x dims of d, could not be made (the error is
 * set): output_error's error, raised instead.  The bytes are counted without overflow. */
static PyObject *raise_output_error(CommObject *self, const char *name, int nd, const npy_intp *dims,
                                    unsigned long long times, PyArray_Descr *d) {
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  PyErr_NormalizeException(&et, &ev, &tb);
  Py_XDECREF(tb);
  unsigned long long n = (unsigned long long)PyDataType_ELSIZE(d);
  int over = __builtin_mul_overflow(n, times, &n);
  for (int i = 0; i < nd; i++) over |= __builtin_mul_overflow(n, (unsigned long long)dims[i], &n);
  char nbytes[32];
  if (over) snprintf(nbytes, sizeof nbytes, "more than 2**64");
  else snprintf(nbytes, sizeof nbytes, "%llu", n);
  PyObject *err = ev ? output_error(self, name, "output", nbytes, ev) : NULL;
  Py_XDECREF(et);
  Py_XDECREF(ev);
  if (err) {
    PyErr_SetObject((PyObject *)Py_TYPE(err), err);
    Py_DECREF(err);
  }
  return NULL;
}

/* all_reduce(x, out, op) */
static PyObject *comm_all_reduce(PyObject *o, PyObject *const *args, Py_ssize_t n) {
  CommObject *self = (CommObject *)o;
  PyObject *x, *out, *opo;
  if (n != 3) {
    PyErr_SetString(PyExc_TypeError, "all_reduce(x, out, op) takes 3 positional arguments");
    return NULL;
  }
  x = args[0];
  out = args[1];
  opo = args[2];
  if (!live(self, "all_reduce")) return NULL;
  buf_t bx, bo;
  tp_redop_t op;
  if (get_buf(x, "all_reduce", "x", 0, &bx) < 0 || get_buf(out, "all_reduce", out == x ? "x" : "out", 1, &bo) < 0 ||
      same_dtype("all_reduce", "x", &bx, "out", &bo) < 0 || parse_op(opo, "all_reduce", &op) < 0)
    return NULL;
  if (bx.count != bo.count) {
    PyErr_Format(PyExc_ValueError, "all_reduce: out has %zu elements but x has %zu; they must match", bo.count,
                 bx.count);
    return NULL;
  }
  tp_status_t s;
  COMM_CALL(self, s, tp_all_reduce(bx.data, bo.data, bx.count, bx.dtype, op, c_, NULL));
  if (s != TP_SUCCESS) return raise_status(cstate(o), s, "all_reduce");
  Py_INCREF(out);
  return out;
}

/* Reads an optional per-rank count sequence into counts (size entries). */
int parse_counts(PyObject *obj, int size, size_t *counts, const char *op) {
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
        PyErr_Format(PyExc_ValueError,
                     "reduce_scatter: x has length %zd along axis 0, which does not split "
                     "evenly over %d ranks",
                     (Py_ssize_t)dims[0], size);
        return NULL;
      }
      dims[0] /= size;
    } else if (__builtin_mul_overflow(dims[0], (npy_intp)size, &dims[0])) {
      PyErr_Format(PyExc_ValueError, "all_gather: x has length %zd along axis 0; %d ranks of it overflow a size",
                   (Py_ssize_t)PyArray_DIM(xa, 0), size);
      return raise_output_error(self, name, nd, PyArray_DIMS(xa), (unsigned long long)size, PyArray_DESCR(xa));
    }
    PyArray_Descr *d = PyArray_DESCR(xa);
    Py_INCREF(d);
    made = PyArray_NewFromDescr(&PyArray_Type, d, nd, dims, NULL, NULL, 0, NULL);
    if (!made) return raise_output_error(self, name, nd, dims, 1, PyArray_DESCR(xa));
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
      PyErr_Format(PyExc_ValueError, "all_gather: x has %zu elements but counts[%d] is %zu", bx.count, rank,
                   counts[rank]);
      goto fail;
    }
    if (bo.count != total) {
      PyErr_Format(PyExc_ValueError, "all_gather: out has %zu elements, expected %zu (the ranks' parts together)",
                   bo.count, total);
      goto fail;
    }
  } else {
    if (bx.count != total) {
      PyErr_Format(PyExc_ValueError, "reduce_scatter: x has %zu elements, expected %zu (the ranks' parts together)",
                   bx.count, total);
      goto fail;
    }
    if (bo.count != counts[rank]) {
      PyErr_Format(PyExc_ValueError, "reduce_scatter: out has %zu elements but this rank's part is %zu", bo.count,
                   counts[rank]);
      goto fail;
    }
  }
  tp_status_t s;
  if (scatter) COMM_CALL(self, s, tp_reduce_scatter_v(bx.data, bo.data, counts, bx.dtype, op, c_, NULL));
  else COMM_CALL(self, s, tp_all_gather_v(bx.data, bo.data, counts, bx.dtype, c_, NULL));
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
  tp_comm_region_stats_t rs[TP_COMM_REGIONS_MAX];
  int nr = 0;
  tp_comm_region_stats(self->comm, rs, TP_COMM_REGIONS_MAX, &nr);
  PyObject *regions = PyDict_New();
  if (!regions) return NULL;
  for (int i = 0; i < nr; i++) {
    PyObject *r = Py_BuildValue("{s:K,s:K,s:d}", "calls", (unsigned long long)rs[i].calls, "bytes",
                                (unsigned long long)rs[i].bytes, "seconds", rs[i].seconds);
    if (!r || PyDict_SetItemString(regions, rs[i].name, r) < 0) {
      Py_XDECREF(r);
      Py_DECREF(regions);
      return NULL;
    }
    Py_DECREF(r);
  }
  return Py_BuildValue("{s:K,s:K,s:K,s:d,s:O,s:N}", "calls", (unsigned long long)s.collectives, "bytes",
                       (unsigned long long)s.bytes, "zero_copy", (unsigned long long)s.zero_copy, "seconds", s.seconds,
                       "single_copy", s.single_copy ? Py_True : Py_False, "regions", regions);
}

/* An optional int field: None when < 0. */
static PyObject *opt_int(long long v) {
  if (v < 0) Py_RETURN_NONE;
  return PyLong_FromLongLong(v);
}

static PyObject *comm_history(PyObject *o, PyObject *unused) {
  CommObject *self = (CommObject *)o;
  if (!live(self, "history")) return NULL;
  int cap = 0, n = 0;
  tp_comm_history(self->comm, NULL, 0, &cap); /* the entries it holds now, not its capacity */
  tp_coll_record_t *recs = cap ? PyMem_Malloc(sizeof *recs * (size_t)cap) : NULL;
  if (cap && !recs) return PyErr_NoMemory();
  tp_comm_history(self->comm, recs, cap, &n);
  PyObject *list = PyList_New(n);
  for (int i = 0; list && i < n; i++) {
    const tp_coll_record_t *e = &recs[i];
    int p2p = e->seq == 0;
    PyObject *d = Py_BuildValue(
        "{s:N,s:s,s:N,s:N,s:K,s:N,s:N,s:N,s:s,s:s,s:d,s:N,s:s}", "seq",
        p2p ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(e->seq), "op", e->op, "redop",
        e->redop >= 0 ? PyUnicode_FromString(tp_redop_name((tp_redop_t)e->redop)) : Py_NewRef(Py_None), "dtype",
        e->dtype >= 0 ? PyUnicode_FromString(tp_dtype_name((tp_dtype_t)e->dtype)) : Py_NewRef(Py_None), "count",
        (unsigned long long)e->count, "root", opt_int(p2p ? -1 : e->root), "peer", opt_int(p2p ? e->root : -1), "src",
        opt_int(e->src), "site", e->site, "region", e->region, "start", e->start, "seconds",
        e->seconds >= 0 ? PyFloat_FromDouble(e->seconds) : Py_NewRef(Py_None), "status",
        e->status == TP_SUCCESS       ? "ok"
        : e->status == TP_IN_PROGRESS ? "in progress"
                                      : tp_status_name(e->status));
    if (!d) {
      Py_CLEAR(list);
      break;
    }
    PyList_SET_ITEM(list, i, d);
  }
  PyMem_Free(recs);
  return list;
}

/* set_region(name or None) -> the previous region's name */
static PyObject *comm_set_region(PyObject *o, PyObject *arg) {
  CommObject *self = (CommObject *)o;
  if (!live(self, "set_region")) return NULL;
  const char *name = NULL;
  if (arg != Py_None) {
    if (!PyUnicode_Check(arg)) {
      PyErr_Format(PyExc_TypeError, "set_region: name must be a str or None, got %s", Py_TYPE(arg)->tp_name);
      return NULL;
    }
    Py_ssize_t len;
    name = PyUnicode_AsUTF8AndSize(arg, &len);
    if (!name) return NULL;
    if (len >= TP_COMM_REGION_NAME_MAX || strlen(name) != (size_t)len) {
      PyErr_Format(PyExc_ValueError, "set_region: name must be at most %d characters without NUL, got %R",
                   TP_COMM_REGION_NAME_MAX - 1, arg);
      return NULL;
    }
  }
  return PyUnicode_FromString(tp_comm_set_region(self->comm, name));
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

/* Comm.probe(backend) -> None when this process could use the backend, else the reason. */
static PyObject *comm_probe(PyObject *cls, PyObject *arg) {
  const char *name = PyUnicode_AsUTF8(arg);
  if (!name) return NULL;
  tp_status_t s;
  CALL_NOGIL(s, tp_comm_backend_usable(name));
  if (s == TP_SUCCESS) Py_RETURN_NONE;
  return PyUnicode_FromString(tp_last_error());
}

static PyMethodDef comm_methods[] = {
    {"probe", comm_probe, METH_O | METH_STATIC,
     "probe(backend) -> None when this process could use the backend, else why not"},
    {"all_reduce", (PyCFunction)(void (*)(void))comm_all_reduce, METH_FASTCALL,
     "all_reduce(x, out, op): out = op over ranks of x (out may be x)"},
    {"all_gather", comm_all_gather, METH_VARARGS,
     "all_gather(x, out, counts=None): out=None allocates (size * len(x), ...)"},
    {"reduce_scatter", comm_reduce_scatter, METH_VARARGS,
     "reduce_scatter(x, out, op, counts=None): out=None allocates (len(x) / size, ...)"},
    {"all_to_all", comm_all_to_all, METH_VARARGS,
     "all_to_all(x, out, send_counts, recv_counts): x's block p (send_counts[p] elements) to rank p; "
     "rank p's block for this rank into out's block p (recv_counts[p] elements)"},
    {"broadcast", comm_broadcast, METH_VARARGS, "broadcast(x, out, root)"},
    {"reduce", comm_reduce, METH_VARARGS, "reduce(x, out, op, root)"},
    {"send", comm_send, METH_VARARGS, "send(x, peer)"},
    {"recv", comm_recv, METH_VARARGS, "recv(x, peer): fills x"},
    {"sendrecv", comm_sendrecv, METH_VARARGS, "sendrecv(x, dst, out, src)"},
    {"barrier", comm_barrier, METH_NOARGS, "barrier()"},
    {"split", comm_split, METH_VARARGS, "split(color, key) -> Comm or None"},
    {"alloc", comm_alloc, METH_VARARGS, "alloc(nbytes) -> SharedBuffer (collective)"},
    {"abort", comm_abort, METH_VARARGS, "abort(reason=''): fail the communicator on every rank"},
    {"output_failed", comm_output_failed, METH_VARARGS,
     "output_failed(op, what, nbytes, exc) -> the error to raise: this rank could not make an array for the "
     "collective op it is about to call (the communicator is aborted naming it when size > 1)"},
    {"close", comm_close, METH_NOARGS, "close(): release this rank's resources"},
    {"stats", comm_stats, METH_NOARGS, "stats() -> dict (with 'regions': {name: {calls, bytes, seconds}})"},
    {"history", comm_history, METH_NOARGS, "history() -> the last calls (TPCORE_HISTORY), oldest first, as dicts"},
    {"set_region", comm_set_region, METH_O, "set_region(name or None) -> the previous region's name"},
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
    {Py_tp_doc,
     "Comm(world_size, rank, job_id, timeout=-1, backend='shm', spin_us=-1): "
     "a communicator of the C core.  Use tpcore.init / tpcore.spawn instead."},
    {0, NULL},
};

PyType_Spec comm_spec = {
    .name = "tpcore._C.Comm",
    .basicsize = sizeof(CommObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .slots = comm_slots,
};
