/*
 * cuda.c: the extension's face of the CUDA plugin loader (cuda/cuda_load.c) and of the
 * run-time library finder (core/dynlib.c).  python/tpcore/_cuda.py uses these; nothing
 * here loads the plugin unless asked (`import tpcore` never does).
 *   _cuda_load(path=None)      tp_cuda_load; RuntimeError with the reason when it fails
 *   _cuda_status()             tp_cuda_status's line
 *   _cuda_info()               {"why_not_built", "loaded", "plugin", "build"}
 *   _set_library_dirs(list)    tp_set_library_dirs (the nvidia-* wheels' lib directories)
 *   _find_library(what, env, sonames)   tp_dynlib_open: the path it loaded, or the error
 *   _library_searches()        {what: {"found": bool, "path" | "error": str}}
 *   _device_stream_entries(device, id)  the stream entries' wrappers (set_current, query,
 *                              stream_wait, mem_info) once each, for the tests
 *   _device_selftest(device, id, nbytes)  every entry of a device table through the wrappers
 *                              on the default stream (alloc, copies both ways and 2-D, memset,
 *                              owns, sync, query, free); a dict of what each step saw
 */
#include "ext.h"

#include <dlfcn.h>

#include "../core/dynlib.h"
#include "../cuda/cuda_load.h"
#include "../devices/device_impl.h"

#ifndef TPCORE_CUDA_WHY_NOT_STR /* setup.py: "" when the plugin was built, else why not */
#define TPCORE_CUDA_WHY_NOT_STR "this build did not say (not built by setup.py)"
#endif

static PyObject *raise_core(tp_status_t s) {
  const char *msg = tp_last_error();
  PyErr_SetString(s == TP_ERR_INVALID_ARGUMENT ? PyExc_ValueError
                  : s == TP_ERR_NOMEM          ? PyExc_MemoryError
                                               : PyExc_RuntimeError,
                  msg && *msg ? msg : tp_status_name(s));
  return NULL;
}

static PyObject *cuda_load(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs > 1) return PyErr_Format(PyExc_TypeError, "_cuda_load takes at most one argument");
  const char *path = NULL;
  if (nargs == 1 && args[0] != Py_None) {
    path = PyUnicode_AsUTF8(args[0]);
    if (!path) return NULL;
  }
  tp_status_t s;
  Py_BEGIN_ALLOW_THREADS s = tp_cuda_load(path);
  Py_END_ALLOW_THREADS if (s != TP_SUCCESS) return raise_core(s);
  Py_RETURN_NONE;
}

static PyObject *cuda_status(PyObject *m, PyObject *unused) { return PyUnicode_FromString(tp_cuda_status()); }

static PyObject *cuda_info(PyObject *m, PyObject *unused) {
  const char *path = tp_cuda_plugin_path();
  return Py_BuildValue("{s:s,s:O,s:s,s:s}", "why_not_built", TPCORE_CUDA_WHY_NOT_STR, "loaded",
                       *path ? Py_True : Py_False, "plugin", path, "build", tp_cuda_plugin_build());
}

/* A list of str -> a NULL-terminated array of UTF-8 pointers (owned by the list's items). */
static int str_list(PyObject *obj, const char *op, const char *arg, const char ***out, int *n) {
  *out = NULL;
  *n = 0;
  if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be a list of str", op, arg);
    return -1;
  }
  Py_ssize_t len = PySequence_Fast_GET_SIZE(obj);
  if (len > 64) {
    PyErr_Format(PyExc_ValueError, "%s: %s has %zd entries (at most 64)", op, arg, len);
    return -1;
  }
  const char **v = PyMem_Calloc((size_t)len + 1, sizeof *v);
  if (!v) {
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < len; i++) {
    PyObject *item = PySequence_Fast_GET_ITEM(obj, i);
    if (!PyUnicode_Check(item) || !(v[i] = PyUnicode_AsUTF8(item))) {
      if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "%s: %s[%zd] is not a str", op, arg, i);
      PyMem_Free(v);
      return -1;
    }
  }
  *out = v;
  *n = (int)len;
  return 0;
}

static PyObject *set_library_dirs(PyObject *m, PyObject *arg) {
  const char **dirs;
  int n;
  if (str_list(arg, "set_library_dirs", "dirs", &dirs, &n) < 0) return NULL;
  tp_status_t s = tp_set_library_dirs(dirs, n);
  PyMem_Free(dirs);
  if (s != TP_SUCCESS) return raise_core(s);
  Py_RETURN_NONE;
}

static PyObject *find_library(PyObject *m, PyObject *args) {
  const char *what, *env;
  PyObject *names;
  if (!PyArg_ParseTuple(args, "szO:_find_library", &what, &env, &names)) return NULL;
  const char **sonames;
  int n;
  if (str_list(names, "_find_library", "sonames", &sonames, &n) < 0) return NULL;
  void *h;
  Py_BEGIN_ALLOW_THREADS h = tp_dynlib_open(what, env, sonames, n);
  Py_END_ALLOW_THREADS PyMem_Free(sonames);
  if (!h) return raise_core(tp_last_status());
  PyObject *path = PyUnicode_FromString(tp_dynlib_path(h));
  dlclose(h); /* the handle's users open it again; a search only says where */
  return path;
}

static PyObject *library_searches(PyObject *m, PyObject *unused) {
  PyObject *out = PyDict_New();
  char what[64], result[1024];
  int found;
  for (int i = 0; out && (found = tp_dynlib_search_result(i, what, sizeof what, result, sizeof result)) >= 0; i++) {
    PyObject *entry = Py_BuildValue("{s:O,s:s}", "found", found ? Py_True : Py_False, found ? "path" : "error", result);
    if (!entry || PyDict_SetItemString(out, what, entry) < 0) Py_CLEAR(out);
    Py_XDECREF(entry);
  }
  return out;
}

static PyObject *device_stream_entries(PyObject *m, PyObject *args) {
  int device, id;
  if (!PyArg_ParseTuple(args, "ii:_device_stream_entries", &device, &id)) return NULL;
  tp_status_t s;
  int done = -1;
  size_t fr = 0, tot = 0;
  if ((s = tp_device_set_current((tp_device_t)device, id)) != TP_SUCCESS ||
      (s = tp_device_query((tp_device_t)device, id, NULL, &done)) != TP_SUCCESS ||
      (s = tp_device_stream_wait((tp_device_t)device, id, NULL, NULL)) != TP_SUCCESS ||
      (s = tp_device_mem_info((tp_device_t)device, id, &fr, &tot)) != TP_SUCCESS)
    return raise_core(s);
  return Py_BuildValue("{s:i,s:n,s:n}", "done", done, "free", (Py_ssize_t)fr, "total", (Py_ssize_t)tot);
}

/* Bytes of a known pattern through a device and back; every step's outcome is checked by
 * the test (tests/devices/test_cuda_build.py), on the CPU here and on a GPU where there is one. */
static tp_status_t selftest(tp_device_t d, int id, size_t n, unsigned char *src, unsigned char *back, int *owns_dev,
                            int *owns_host, int *owns_id, int *done) {
  void *a = NULL, *b = NULL;
  tp_status_t s;
  for (size_t i = 0; i < n; i++) src[i] = (unsigned char)(i * 7 + 3);
  if ((s = tp_device_alloc(d, id, n, &a)) || (s = tp_device_alloc(d, id, n, &b))) goto out;
  if ((s = tp_device_copy(d, a, TP_DEVICE_CPU, src, n, NULL))) goto out; /* host -> device */
  if ((s = tp_device_memset(d, b, 0x5a, n, NULL))) goto out;
  if ((s = tp_device_copy(d, b, d, a, n / 2, NULL))) goto out; /* device -> device, half */
  /* 2-D, host -> device: 2 rows of n/8 bytes at pitch n/4, src's second half into b's */
  size_t rows = 2, width = n / 8, pitch = n / 4;
  if ((s = tp_device_copy_2d(d, (char *)b + n / 2, pitch, TP_DEVICE_CPU, src + n / 2, pitch, width, rows, NULL)))
    goto out;
  if ((s = tp_device_sync(d, id, NULL))) goto out;
  if ((s = tp_device_query(d, id, NULL, done))) goto out;
  tp_device_t od;
  tp_pointer_device(a, &od, owns_id);
  *owns_dev = od == d;
  tp_pointer_device(src, &od, NULL);
  *owns_host = od != TP_DEVICE_CPU;
  if ((s = tp_device_copy(TP_DEVICE_CPU, back, d, b, n, NULL))) goto out; /* device -> host */
out:
  tp_device_free(d, id, a);
  tp_device_free(d, id, b);
  return s;
}

static PyObject *device_selftest(PyObject *m, PyObject *args) {
  int device, id;
  Py_ssize_t n;
  if (!PyArg_ParseTuple(args, "iin:_device_selftest", &device, &id, &n)) return NULL;
  if (n < 64 || n % 64 || n > (1 << 26))
    return PyErr_Format(PyExc_ValueError, "_device_selftest: nbytes must be a multiple of 64 in [64, 2^26], got %zd",
                        n);
  PyObject *src = PyBytes_FromStringAndSize(NULL, n), *back = PyBytes_FromStringAndSize(NULL, n);
  if (!src || !back) {
    Py_XDECREF(src);
    Py_XDECREF(back);
    return NULL;
  }
  int owns_dev = 0, owns_host = 1, owns_id = -1, done = -1;
  tp_status_t s;
  Py_BEGIN_ALLOW_THREADS s = selftest((tp_device_t)device, id, (size_t)n, (unsigned char *)PyBytes_AS_STRING(src),
                                      (unsigned char *)PyBytes_AS_STRING(back), &owns_dev, &owns_host, &owns_id, &done);
  Py_END_ALLOW_THREADS if (s != TP_SUCCESS) {
    Py_DECREF(src);
    Py_DECREF(back);
    return raise_core(s);
  }
  return Py_BuildValue("{s:N,s:N,s:O,s:O,s:i,s:i}", "src", src, "back", back, "owns_device",
                       owns_dev ? Py_True : Py_False, "host_claimed", owns_host ? Py_True : Py_False, "owner_id",
                       owns_id, "done", done);
}

PyMethodDef cuda_methods[] = {
    {"_cuda_load", (PyCFunction)(void (*)(void))cuda_load, METH_FASTCALL, "_cuda_load(path=None): tp_cuda_load"},
    {"_cuda_status", cuda_status, METH_NOARGS, "tp_cuda_status()"},
    {"_cuda_info", cuda_info, METH_NOARGS, "what this build and process know of the CUDA plugin"},
    {"_set_library_dirs", set_library_dirs, METH_O, "_set_library_dirs(dirs): tp_set_library_dirs"},
    {"_find_library", find_library, METH_VARARGS, "_find_library(what, env, sonames): the path tp_dynlib_open loads"},
    {"_library_searches", library_searches, METH_NOARGS, "the last search of each run-time library"},
    {"_device_stream_entries", device_stream_entries, METH_VARARGS, "runs the stream entries' wrappers once"},
    {"_device_selftest", device_selftest, METH_VARARGS, "_device_selftest(device, id, nbytes): every table entry"},
    {NULL, NULL, 0, NULL},
};
