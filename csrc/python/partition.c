/*
 * partition.c: the shard split (include/tpcore/partition.h) exposed to Python as
 * _C.partition(n, world, weights or None, align) -> [size of each rank].
 * tpcore.partition() keeps its type checks and calls this, so the layers in C and
 * the Python code split a dimension with one implementation.
 */
#include "tpcore/partition.h"

#include "ext.h"

static PyObject *partition_k(PyObject *mod, PyObject *args) {
  long long n, align;
  int world;
  PyObject *wo;
  if (!PyArg_ParseTuple(args, "LiOL:partition", &n, &world, &wo, &align)) return NULL;
  if (world < 1 || world > 1 << 20) {
    PyErr_Format(PyExc_ValueError, "partition: world must be an integer in [1, 2^20], got %d", world);
    return NULL;
  }
  double *w = NULL;
  int64_t *sizes = PyMem_Malloc((size_t)world * sizeof(int64_t));
  if (!sizes) return PyErr_NoMemory();
  if (wo != Py_None) {
    PyObject *seq = PySequence_Fast(wo, "partition: weights must be a sequence");
    if (!seq) goto fail;
    if (PySequence_Fast_GET_SIZE(seq) != world) {
      PyErr_Format(PyExc_ValueError, "partition: %d weights for %d ranks", (int)PySequence_Fast_GET_SIZE(seq), world);
      Py_DECREF(seq);
      goto fail;
    }
    w = PyMem_Malloc((size_t)world * sizeof(double));
    if (!w) {
      Py_DECREF(seq);
      PyErr_NoMemory();
      goto fail;
    }
    for (int r = 0; r < world; r++) {
      w[r] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, r));
      if (w[r] == -1.0 && PyErr_Occurred()) {
        Py_DECREF(seq);
        goto fail;
      }
    }
    Py_DECREF(seq);
  }
  tp_status_t s = tp_partition((int64_t)n, world, w, (int64_t)align, sizes, NULL);
  if (s != TP_SUCCESS) {
    PyErr_SetString(PyExc_ValueError, tp_last_error());
    goto fail;
  }
  PyObject *out = PyList_New(world);
  for (int r = 0; out && r < world; r++) {
    PyObject *v = PyLong_FromLongLong((long long)sizes[r]);
    if (!v) Py_CLEAR(out);
    else PyList_SET_ITEM(out, r, v);
  }
  PyMem_Free(w);
  PyMem_Free(sizes);
  return out;
fail:
  PyMem_Free(w);
  PyMem_Free(sizes);
  return NULL;
}

PyMethodDef partition_methods[] = {
    {"partition", partition_k, METH_VARARGS,
     "partition(n, world, weights or None, align) -> [size of each rank] (tp_partition)"},
    {NULL, NULL, 0, NULL},
};
