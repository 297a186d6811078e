/*
 * store.c: tpcore._C.Store, the rendezvous store of the C core (tpcore/store.h).
 * Every call that talks to the server runs with the GIL released; close() while
 * another thread is in a call defers the destruction to the last call out.
 * tpcore.Store (python/tpcore/store.py) is the documented face.
 */
#include "ext.h"
#include "tpcore/store.h"

typedef struct {
  PyObject_HEAD tp_store_t store;
  int inflight;
  int closing; /* close() was called while a call was in flight */
} StoreObject;

static PyObject *closed_error(void) {
  PyErr_SetString(PyExc_ValueError, "store: the store is closed");
  return NULL;
}

static void store_leave(StoreObject *self) {
  if (--self->inflight == 0 && self->closing && self->store) {
    tp_store_t s = self->store;
    self->store = NULL;
    Py_BEGIN_ALLOW_THREADS tp_store_close(s);
    Py_END_ALLOW_THREADS
  }
}

#define STORE_CALL(self, st, expr)          \
  do {                                      \
    tp_store_t s_ = (self)->store;          \
    (self)->inflight++;                     \
    Py_BEGIN_ALLOW_THREADS st = (expr);     \
    Py_END_ALLOW_THREADS store_leave(self); \
  } while (0)

static int usable(StoreObject *self) {
  if (!self->store || self->closing) {
    closed_error();
    return 0;
  }
  return 1;
}

/* A key: str without NUL, as UTF-8 (the core checks its length). */
static const char *key_arg(PyObject *o, const char *op) {
  if (!PyUnicode_Check(o)) {
    PyErr_Format(PyExc_TypeError, "store %s: a key must be a str, got %s", op, Py_TYPE(o)->tp_name);
    return NULL;
  }
  Py_ssize_t n;
  const char *k = PyUnicode_AsUTF8AndSize(o, &n);
  if (!k) return NULL;
  if ((Py_ssize_t)strlen(k) != n) {
    PyErr_Format(PyExc_ValueError, "store %s: a key must not contain NUL characters", op);
    return NULL;
  }
  return k;
}

static PyObject *fail(StoreObject *self, tp_status_t s, const char *op) {
  module_state *st = state_of_type(Py_TYPE(self));
  if (!st) return NULL;
  return raise_status(st, s, op);
}

static PyObject *store_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"host",        "port",  "is_server", "secret", "timeout", "io_timeout", "max_value_bytes",
                           "max_clients", "quiet", NULL};
  const char *host;
  int port, is_server = 0, max_clients = 0, quiet = 0;
  Py_buffer secret = {0};
  double timeout = 300.0, io_timeout = 0.0;
  Py_ssize_t max_value = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "siby*|ddnip:Store", kwlist, &host, &port, &is_server, &secret, &timeout,
                                   &io_timeout, &max_value, &max_clients, &quiet))
    return NULL;
  module_state *st = state_of_type(type);
  if (!st || max_value < 0) {
    if (st) PyErr_Format(PyExc_ValueError, "Store: max_value_bytes must be >= 0, got %zd", max_value);
    PyBuffer_Release(&secret);
    return NULL;
  }
  StoreObject *self = (StoreObject *)type->tp_alloc(type, 0);
  if (!self) {
    PyBuffer_Release(&secret);
    return NULL;
  }
  tp_store_config_t cfg = TP_STORE_CONFIG_INITIALIZER;
  cfg.host = host, cfg.port = port, cfg.is_server = is_server;
  cfg.secret = secret.buf, cfg.secret_len = (size_t)secret.len;
  cfg.timeout_s = timeout, cfg.io_timeout_s = io_timeout;
  cfg.max_value_bytes = (size_t)max_value, cfg.max_clients = max_clients, cfg.quiet = quiet;
  tp_status_t s;
  CALL_NOGIL(s, tp_store_open(&self->store, &cfg));
  PyBuffer_Release(&secret);
  if (s != TP_SUCCESS) {
    Py_DECREF(self);
    return raise_status(st, s, "Store");
  }
  return (PyObject *)self;
}

static void store_dealloc(PyObject *o) {
  StoreObject *self = (StoreObject *)o;
  PyTypeObject *tp = Py_TYPE(o);
  if (self->store) {
    tp_store_t s = self->store;
    self->store = NULL;
    Py_BEGIN_ALLOW_THREADS tp_store_close(s);
    Py_END_ALLOW_THREADS
  }
  tp->tp_free(o);
  Py_DECREF(tp);
}

static PyObject *store_set(PyObject *o, PyObject *args) {
  StoreObject *self = (StoreObject *)o;
  PyObject *ko;
  Py_buffer v;
  if (!PyArg_ParseTuple(args, "Oy*:set", &ko, &v)) return NULL;
  const char *k = key_arg(ko, "set");
  if (!k || !usable(self)) {
    PyBuffer_Release(&v);
    return NULL;
  }
  tp_status_t s;
  STORE_CALL(self, s, tp_store_set(s_, k, v.buf, (size_t)v.len));
  PyBuffer_Release(&v);
  if (s != TP_SUCCESS) return fail(self, s, "set");
  Py_RETURN_NONE;
}

static PyObject *get_common(StoreObject *self, PyObject *ko, int wait) {
  const char *k = key_arg(ko, wait ? "get" : "try_get");
  if (!k || !usable(self)) return NULL;
  void *v = NULL;
  size_t n = 0;
  int found = 1;
  tp_status_t s;
  if (wait) STORE_CALL(self, s, tp_store_get(s_, k, &v, &n));
  else STORE_CALL(self, s, tp_store_try_get(s_, k, &v, &n, &found));
  if (s != TP_SUCCESS) return fail(self, s, "get");
  if (!found) Py_RETURN_NONE;
  PyObject *r = PyBytes_FromStringAndSize(v, (Py_ssize_t)n);
  tp_store_free(v);
  return r;
}

static PyObject *store_get(PyObject *o, PyObject *k) { return get_common((StoreObject *)o, k, 1); }
static PyObject *store_try_get(PyObject *o, PyObject *k) { return get_common((StoreObject *)o, k, 0); }

static PyObject *store_add(PyObject *o, PyObject *args) {
  StoreObject *self = (StoreObject *)o;
  PyObject *ko;
  long long delta;
  if (!PyArg_ParseTuple(args, "OL:add", &ko, &delta)) return NULL;
  const char *k = key_arg(ko, "add");
  if (!k || !usable(self)) return NULL;
  int64_t r = 0;
  tp_status_t s;
  STORE_CALL(self, s, tp_store_add(s_, k, (int64_t)delta, &r));
  if (s != TP_SUCCESS) return fail(self, s, "add");
  return PyLong_FromLongLong((long long)r);
}

static PyObject *store_wait(PyObject *o, PyObject *keys) {
  StoreObject *self = (StoreObject *)o;
  PyObject *seq = PySequence_Fast(keys, "store wait: keys must be a list of str");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n < 1 || n > 4096) {
    Py_DECREF(seq);
    PyErr_Format(PyExc_ValueError, "store wait: give 1..4096 keys, got %zd", n);
    return NULL;
  }
  const char **ks = PyMem_Malloc(sizeof *ks * (size_t)n);
  if (!ks) {
    Py_DECREF(seq);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    ks[i] = key_arg(PySequence_Fast_GET_ITEM(seq, i), "wait");
    if (!ks[i]) {
      PyMem_Free(ks);
      Py_DECREF(seq);
      return NULL;
    }
  }
  tp_status_t s = TP_SUCCESS;
  if (usable(self)) STORE_CALL(self, s, tp_store_wait(s_, ks, (int)n));
  else s = TP_ERR_INVALID_USAGE;
  PyMem_Free(ks);
  Py_DECREF(seq);
  if (s == TP_ERR_INVALID_USAGE && PyErr_Occurred()) return NULL;
  if (s != TP_SUCCESS) return fail(self, s, "wait");
  Py_RETURN_NONE;
}

static PyObject *store_delete(PyObject *o, PyObject *ko) {
  StoreObject *self = (StoreObject *)o;
  const char *k = key_arg(ko, "delete");
  if (!k || !usable(self)) return NULL;
  int existed = 0;
  tp_status_t s;
  STORE_CALL(self, s, tp_store_delete(s_, k, &existed));
  if (s != TP_SUCCESS) return fail(self, s, "delete");
  return PyBool_FromLong(existed);
}

static PyObject *store_barrier(PyObject *o, PyObject *args) {
  StoreObject *self = (StoreObject *)o;
  PyObject *ko;
  int n;
  if (!PyArg_ParseTuple(args, "Oi:barrier", &ko, &n)) return NULL;
  const char *k = key_arg(ko, "barrier");
  if (!k || !usable(self)) return NULL;
  tp_status_t s;
  STORE_CALL(self, s, tp_store_barrier(s_, k, n));
  if (s != TP_SUCCESS) return fail(self, s, "barrier");
  Py_RETURN_NONE;
}

static PyObject *store_close(PyObject *o, PyObject *unused) {
  StoreObject *self = (StoreObject *)o;
  if (!self->store) Py_RETURN_NONE;
  if (self->inflight) {
    self->closing = 1; /* the call in progress fails at once; the last call out closes it */
    tp_store_interrupt(self->store);
    Py_RETURN_NONE;
  }
  tp_store_t s = self->store;
  self->store = NULL;
  Py_BEGIN_ALLOW_THREADS tp_store_close(s);
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *store_port(PyObject *o, void *closure) {
  StoreObject *self = (StoreObject *)o;
  if (!self->store) return closed_error();
  return PyLong_FromLong(tp_store_port(self->store));
}

static PyObject *store_closed(PyObject *o, void *closure) {
  StoreObject *self = (StoreObject *)o;
  return PyBool_FromLong(!self->store || self->closing);
}

static PyMethodDef store_methods[] = {
    {"set", store_set, METH_VARARGS, "set(key, value): stores bytes under key"},
    {"get", store_get, METH_O, "get(key) -> bytes: waits (under the timeout) until key exists"},
    {"try_get", store_try_get, METH_O, "try_get(key) -> bytes or None, without waiting"},
    {"add", store_add, METH_VARARGS, "add(key, delta) -> the new integer value"},
    {"wait", store_wait, METH_O, "wait(keys): until every key exists"},
    {"delete", store_delete, METH_O, "delete(key) -> whether it existed"},
    {"barrier", store_barrier, METH_VARARGS, "barrier(name, n): until n callers arrived"},
    {"close", store_close, METH_NOARGS, "closes the connection (and the server of the hosting process)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef store_getset[] = {
    {"port", store_port, NULL, "the server's port", NULL},
    {"closed", store_closed, NULL, "whether close() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot store_slots[] = {
    {Py_tp_new, store_new},
    {Py_tp_dealloc, store_dealloc},
    {Py_tp_methods, store_methods},
    {Py_tp_getset, store_getset},
    {Py_tp_doc,
     "Store(host, port, is_server, secret, timeout=300, io_timeout=0, max_value_bytes=0, "
     "max_clients=0, quiet=False): the rendezvous store (use tpcore.Store)"},
    {0, NULL},
};

PyType_Spec store_spec = {
    .name = "tpcore._C.Store",
    .basicsize = sizeof(StoreObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = store_slots,
};
