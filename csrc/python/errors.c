/*
 * errors.c: tp_status_t -> Python exception.  INVALID_ARGUMENT is a ValueError,
 * NOMEM a MemoryError, TIMEOUT tpcore.CommTimeout, every other status a
 * tpcore.CommError carrying `code` (the status name) and `peer_failure`.
 * The message is the core's last-error sentence.
 */
#include "ext.h"

/* Raise the exception that matches a tp_status_t, with the core's sentence. */
PyObject *raise_status(module_state *st, tp_status_t s, const char *op) {
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
