/*
 * module.c: the module tpcore._C itself, the thin CPython face of the C core.
 * Its state (exception classes and type objects, ext.h), the module's own
 * functions (build_info, BLAS threads), and exec/traverse/clear, which make the
 * types that the other files export (comm.c, linear.c, mlp.c, vocab.c, block.c)
 * and add the kernels' functions (kernels.c).  The one import_array() is here.
 *
 * The extension, by file: errors.c (status -> exception), arrays.c (NumPy array
 * checks, tp_tensor views, owned views), comm.c (Comm, SharedBuffer),
 * layer_common.c (what the layer types share), linear.c, mlp.c, vocab.c,
 * block.c (one per layer type or family), kernels.c (kernels as functions).
 * No math and no communication logic live here.  The only files of the project
 * that include Python.h or NumPy headers are in this folder.
 */
#define TPCORE_EXT_IMPORT_ARRAY /* this file runs import_array() */
#include "ext.h"
#include "tpcore/throttle.h"

/* The names the registries list: backends (comm/backends.c) and the device types whose
 * tables this process can use (devices/device.c). */
static PyObject *registry_names(int devices) {
  PyObject *list = PyList_New(0);
  for (int i = 0; list; i++) {
    const char *name = NULL;
    if (devices) {
      if (i >= TP_NUM_DEVICE_TYPES) break;
      if (!tp_device_available((tp_device_t)i)) continue;
      name = tp_device_name((tp_device_t)i);
    } else if (!(name = tp_comm_backend_name(i))) {
      break;
    }
    PyObject *s = PyUnicode_FromString(name);
    if (!s || PyList_Append(list, s) < 0) Py_CLEAR(list);
    Py_XDECREF(s);
  }
  return list;
}

static PyObject *build_info(PyObject *m, PyObject *unused) {
  PyObject *backends = registry_names(0), *devices = registry_names(1);
  if (!backends || !devices) {
    Py_XDECREF(backends);
    Py_XDECREF(devices);
    return NULL;
  }
  return Py_BuildValue("{s:s,s:N,s:N,s:s,s:s,s:s}", "version", TPCORE_VERSION_STR, "backends", backends, "devices",
                       devices, "sanitize", TPCORE_SANITIZE_STR, "build", TPCORE_BUILD_STR, "blas", tp_blas_info());
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

static PyObject *set_throttle(PyObject *m, PyObject *arg) {
  double f = PyFloat_AsDouble(arg);
  if (f == -1.0 && PyErr_Occurred()) return NULL;
  if (tp_set_throttle(f) != TP_SUCCESS) {
    PyErr_SetString(PyExc_ValueError, tp_last_error());
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *get_throttle(PyObject *m, PyObject *unused) { return PyFloat_FromDouble(tp_get_throttle()); }

static PyMethodDef module_methods[] = {
    {"build_info", build_info, METH_NOARGS, "what this build contains"},
    {"set_num_threads", set_num_threads, METH_O, "set_num_threads(n): BLAS threads of this process"},
    {"get_num_threads", get_num_threads, METH_NOARGS, "BLAS threads of this process"},
    {"set_throttle", set_throttle, METH_O, "set_throttle(factor): slow this process's compute kernels factor x"},
    {"get_throttle", get_throttle, METH_NOARGS, "the compute throttle's factor (1.0: off)"},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *m) {
  module_state *st = PyModule_GetState(m);
  site_init(m);
  st->CommError =
      PyErr_NewExceptionWithDoc("tpcore.CommError",
                                "A collective failed: a peer failed, aborted, died or called a different collective. "
                                "Attributes: code (status name), peer_failure (True when another rank caused it).",
                                PyExc_RuntimeError, NULL);
  if (!st->CommError) return -1;
  PyObject *bases = PyTuple_Pack(2, st->CommError, PyExc_TimeoutError);
  if (!bases) return -1;
  st->CommTimeout = PyErr_NewExceptionWithDoc(
      "tpcore.CommTimeout", "A wait ran past the communicator's timeout; names the rank waited for.", bases, NULL);
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
  st->DeviceArrayType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &devarray_spec, NULL);
  if (!st->DeviceArrayType) return -1;
  st->StoreType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &store_spec, NULL);
  if (!st->StoreType) return -1;
  if (PyModule_AddFunctions(m, devarray_methods) < 0) return -1;
  if (PyModule_AddFunctions(m, kernel_methods) < 0) return -1;
  if (PyModule_AddFunctions(m, attention_methods) < 0) return -1; /* kernels_attn.c */
  if (PyModule_AddFunctions(m, quant_methods) < 0) return -1;     /* quant.c */
  if (PyModule_AddFunctions(m, partition_methods) < 0) return -1;
  if (PyModule_AddFunctions(m, cuda_methods) < 0) return -1;
  if (PyModule_AddObjectRef(m, "CommError", st->CommError) < 0 ||
      PyModule_AddObjectRef(m, "CommTimeout", st->CommTimeout) < 0 ||
      PyModule_AddObjectRef(m, "Comm", (PyObject *)st->CommType) < 0 ||
      PyModule_AddObjectRef(m, "SharedBuffer", (PyObject *)st->SharedBufferType) < 0 ||
      PyModule_AddObjectRef(m, "ParallelLinear", (PyObject *)st->LinearType) < 0 ||
      PyModule_AddObjectRef(m, "ParallelMLP", (PyObject *)st->MLPType) < 0 ||
      PyModule_AddObjectRef(m, "VocabEmbedding", (PyObject *)st->EmbeddingType) < 0 ||
      PyModule_AddObjectRef(m, "VocabCrossEntropy", (PyObject *)st->XentType) < 0 ||
      PyModule_AddObjectRef(m, "TransformerBlock", (PyObject *)st->BlockType) < 0 ||
      PyModule_AddObjectRef(m, "DeviceArray", (PyObject *)st->DeviceArrayType) < 0 ||
      PyModule_AddObjectRef(m, "Store", (PyObject *)st->StoreType) < 0)
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
    Py_VISIT(st->DeviceArrayType);
    Py_VISIT(st->StoreType);
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
    Py_CLEAR(st->DeviceArrayType);
    Py_CLEAR(st->StoreType);
  }
  return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

struct PyModuleDef tpcore_module = {
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
