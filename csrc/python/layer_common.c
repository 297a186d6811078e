/*
 * layer_common.c: what the layer types (linear.c, mlp.c, vocab.c, block.c) share:
 * integer, seed, partition and activation arguments; the communicator a layer is
 * built on; the ends of a constructor and a dealloc; the output array of a call
 * (the caller's `out` workspace or a new array) and the exception of a failed one.
 */
#include "ext.h"

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

int int_arg(PyObject *o, const char *op, const char *name, long long lo, long long hi, long long *out) {
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

int seed_arg(PyObject *o, const char *op, uint64_t *out) {
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

/* comm as a live communicator object of this module, or NULL with an exception. */
CommObject *layer_comm(module_state *st, PyObject *commo, const char *who) {
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
PyObject *layer_made(PyObject *self, CommObject **slot, CommObject *co, tp_status_t s, module_state *st,
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
void layer_free(PyObject *o, CommObject *comm) {
  PyTypeObject *tp = Py_TYPE(o);
  Py_XDECREF(comm);
  tp->tp_free(o);
  Py_DECREF(tp);
}

/* partition=None or a sequence of `size` ints -> *sizes (PyMem, NULL for None). */
int parse_partition(PyObject *part, int size, int64_t **sizes) {
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
PyObject *layer_output(PyObject *out, const char *op, int64_t M, int64_t cols) {
  if (out && out != Py_None) {
    int64_t Mo;
    buf_t bo;
    if (matrix_arg(out, op, "out", cols, &Mo) < 0 || get_host_buf(out, op, "out", 1, &bo) < 0) return NULL;
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
PyObject *layer_error(CommObject *co, tp_status_t s, const char *op, int backward) {
  if (s == TP_ERR_INVALID_USAGE && backward) {
    PyErr_SetString(PyExc_RuntimeError, tp_last_error());
    return NULL;
  }
  return raise_status(cstate((PyObject *)co), s, op);
}

/* An activation name -> tp_activation_t. */
int parse_act(const char *name, tp_activation_t *act) {
  static const char *names[] = {"gelu", "gelu_tanh", "silu", "relu", "swiglu", "geglu"};
  for (int i = 0; i < (int)(sizeof names / sizeof names[0]); i++)
    if (strcmp(name, names[i]) == 0) {
      *act = (tp_activation_t)i;
      return 0;
    }
  PyErr_Format(PyExc_ValueError,
               "activation must be one of 'gelu', 'gelu_tanh', 'silu', 'relu', 'swiglu', 'geglu', got '%s'", name);
  return -1;
}

/* A layer's tp_layer_memory_t as a dict: "device" ("cpu" or "cuda:N") and the byte counts
 * params, grads, workspace, cache, cache_used and comm (ints); the status raised otherwise. */
PyObject *layer_memory(PyObject *self, tp_status_t s, const tp_layer_memory_t *m, const char *op) {
  if (s != TP_SUCCESS) return raise_status(cstate(self), s, op);
  PyObject *dev = m->device == TP_DEVICE_CPU ? PyUnicode_FromString("cpu")
                                             : PyUnicode_FromFormat("%s:%d", tp_device_name(m->device), m->device_id);
  if (!dev) return NULL;
  return Py_BuildValue("{s:N,s:n,s:n,s:n,s:n,s:n,s:n}", "device", dev, "params", (Py_ssize_t)m->params, "grads",
                       (Py_ssize_t)m->grads, "workspace", (Py_ssize_t)m->workspace, "cache", (Py_ssize_t)m->cache,
                       "cache_used", (Py_ssize_t)m->cache_used, "comm", (Py_ssize_t)m->comm);
}
