/*
 * comm_a2a.c: Comm.all_to_all (tpcore._C), the binding of tp_all_to_all.  The
 * Python face (python/tpcore/distributed/comm.py) splits along an axis, exchanges
 * the counts when the caller does not know them, and makes the output; here the
 * arrays and the counts (in elements) are checked against each other before the
 * call, which runs with the GIL released.
 */
#include "ext.h"

/* The sum of counts (size entries) into *total; -1 with a ValueError on overflow. */
static int counts_total(const size_t *counts, int size, const char *arg, size_t *total) {
  size_t t = 0;
  for (int p = 0; p < size; p++)
    if (__builtin_add_overflow(t, counts[p], &t)) {
      PyErr_Format(PyExc_ValueError, "all_to_all: %s add up past 2**64 elements", arg);
      return -1;
    }
  *total = t;
  return 0;
}

/* all_to_all(x, out, send_counts, recv_counts) -> out */
PyObject *comm_all_to_all(PyObject *o, PyObject *args) {
  CommObject *self = (CommObject *)o;
  PyObject *x, *out, *sco, *rco;
  if (!PyArg_ParseTuple(args, "OOOO:all_to_all", &x, &out, &sco, &rco)) return NULL;
  if (!live(self, "all_to_all")) return NULL;
  int size = 1;
  tp_comm_size(self->comm, &size);
  buf_t bx, bo;
  if (get_buf(x, "all_to_all", "x", 0, &bx) < 0 || get_buf(out, "all_to_all", "out", 1, &bo) < 0) return NULL;
  if (bx.dtype != bo.dtype) {
    PyErr_Format(PyExc_TypeError, "all_to_all: out has dtype %s but x has dtype %s; they must match",
                 tp_dtype_name(bo.dtype), tp_dtype_name(bx.dtype));
    return NULL;
  }
  size_t *sc = PyMem_Malloc(2 * sizeof(size_t) * (size_t)size), *rc = sc ? sc + size : NULL;
  if (!sc) return PyErr_NoMemory();
  size_t sent = 0, got = 0;
  if (parse_counts(sco, size, sc, "all_to_all") < 0 || parse_counts(rco, size, rc, "all_to_all") < 0 ||
      counts_total(sc, size, "send_counts", &sent) < 0 || counts_total(rc, size, "recv_counts", &got) < 0)
    goto fail;
  if (bx.count != sent) {
    PyErr_Format(PyExc_ValueError, "all_to_all: x has %zu elements but send_counts add up to %zu", bx.count, sent);
    goto fail;
  }
  if (bo.count != got) {
    PyErr_Format(PyExc_ValueError, "all_to_all: out has %zu elements but recv_counts add up to %zu", bo.count, got);
    goto fail;
  }
  tp_status_t s;
  COMM_CALL(self, s, tp_all_to_all(bx.data, sc, bo.data, rc, bx.dtype, c_, NULL));
  PyMem_Free(sc);
  if (s != TP_SUCCESS) return raise_status(cstate(o), s, "all_to_all");
  Py_INCREF(out);
  return out;
fail:
  PyMem_Free(sc);
  return NULL;
}
