/*
 * ext.h: the private header of tpcore._C, the thin CPython face of the C core.
 * What the extension's files share, and nothing else:
 *   - the NumPy C API set up for several files (one PY_ARRAY_UNIQUE_SYMBOL;
 *     import_array() runs only in module.c, which defines TPCORE_EXT_IMPORT_ARRAY
 *     before including this header; every other file gets NO_IMPORT_ARRAY),
 *   - the module state and how an object finds it (module.c),
 *   - status -> exception mapping (errors.c),
 *   - NumPy array import/export: checks, tp_tensor views, owned views (arrays.c),
 *   - the communicator object and the macro that calls through it with the GIL
 *     released (comm.c),
 *   - helpers shared by the layer types: argument parsing, output arrays, errors
 *     (layer_common.c),
 *   - the type specs and method tables each file exports to module.c.
 * No math and no communication logic live in the extension.  The only files of
 * the project that include Python.h or NumPy headers are in this folder.
 */
#ifndef TPCORE_PYTHON_EXT_H
#define TPCORE_PYTHON_EXT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_20_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL tpcore_ext_ARRAY_API
#ifndef TPCORE_EXT_IMPORT_ARRAY
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include <limits.h>
#include <stdint.h>
#include <string.h>

#include "tpcore/comm.h"
#include "tpcore/device.h"
#include "tpcore/kernels.h"
#include "tpcore/layers.h"

/* ------------------------------------------------------ module state (module.c) */

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
  PyTypeObject *DeviceArrayType;
  PyTypeObject *StoreType;
} module_state;

extern struct PyModuleDef tpcore_module;

static inline module_state *state_of_type(PyTypeObject *t) {
  PyObject *m = PyType_GetModuleByDef(t, &tpcore_module);
  return m ? (module_state *)PyModule_GetState(m) : NULL;
}

/* ------------------------------------------------------------------ errors.c */

/* Raise the exception that matches a tp_status_t, with the core's sentence; NULL. */
PyObject *raise_status(module_state *st, tp_status_t s, const char *op);

/* ------------------------------------------------------------------ arrays.c */

typedef struct {
  void *data;
  size_t count;
  tp_dtype_t dtype;
  tp_device_t device; /* where data lives: CPU for NumPy; a DeviceArray's device */
  int device_id;
} buf_t;

/* Checks that obj is a NumPy array this op can use (known dtype, C-contiguous,
 * aligned, writable when `writable`); fills b (device CPU).  Errors name the op and
 * the argument.  For callers that read or write the data on the CPU. */
int get_host_buf(PyObject *obj, const char *op, const char *arg, int writable, buf_t *b);

/* get_host_buf, or a tpcore.DeviceArray of ANY device (b->device says which; its
 * read-only flag refused for a written argument with NumPy's wording).  Only for
 * callers that hand the pointer to code that handles device memory (the collectives:
 * the C dispatcher stages what a backend cannot take).  Host code: get_host_buf. */
int get_buf(PyObject *obj, const char *op, const char *arg, int writable, buf_t *b);

/* The ValueError for a read-only array an op writes into (NumPy and DeviceArray); -1. */
int buf_readonly_error(const char *op, const char *arg);

/* A tp_tensor view of obj: a NumPy array (get_host_buf's checks; device CPU), or a
 * DeviceArray's own tensor (any device). */
int get_tensor(PyObject *obj, const char *op, const char *arg, int writable, tp_tensor *t);

/* The tp_tensor view of an array already checked by get_buf (dtype from b). */
static inline tp_tensor array_tensor(PyObject *obj, const buf_t *b) {
  PyArrayObject *a = (PyArrayObject *)obj;
  int64_t shape[TP_MAX_DIMS];
  int nd = PyArray_NDIM(a);
  for (int i = 0; i < nd && i < TP_MAX_DIMS; i++) shape[i] = (int64_t)PyArray_DIM(a, i);
  return tp_tensor_nd(b->data, b->dtype, nd, shape);
}

/* x as a float32 2-D C-contiguous array with `cols` columns; rows out. */
int matrix_arg(PyObject *x, const char *op, const char *arg, int64_t cols, int64_t *rows);

/* tokens: a 1-D C-contiguous int64 array; its length out. */
int tokens_arg(PyObject *t, const char *op, const char *arg, int64_t *n);

/* A NumPy float32 view of a C-owned array that keeps its owner (a layer object)
 * alive; None for p == NULL. */
PyObject *owned_view(PyObject *self, float *p, int nd, int64_t d0, int64_t d1);
/* The same for memory of any dtype (a bfloat16 / float16 weight: an ml_dtypes.bfloat16 /
 * float16 NumPy view). */
PyObject *owned_view_dt(PyObject *self, void *p, tp_dtype_t dt, int nd, int64_t d0, int64_t d1);
/* The tp_dtype_t of a NumPy dtype: 1, or 0 when tpcore has none (big-endian, complex, ...). */
int descr_dtype(PyArray_Descr *d, tp_dtype_t *out);
/* The NumPy dtype of a tp_dtype_t (bfloat16: ml_dtypes'; a TypeError when it is missing). */
PyArray_Descr *numpy_descr(tp_dtype_t dt);
/* A layer's weight_dtype argument: None or "float32" (TP_FLOAT32), "bfloat16", "float16";
 * a ValueError naming op otherwise.  0 / -1. */
int parse_weight_dtype(PyObject *o, const char *op, tp_dtype_t *dt);

/* -------------------------------------------------------------------- comm.c */

typedef struct {
  PyObject_HEAD tp_comm_t comm;
  Py_ssize_t inflight; /* calls running with the GIL released (counted under the GIL) */
  tp_comm_t closing;   /* closed by one thread while another's call was running */
} CommObject;

extern PyType_Spec comm_spec, sb_spec;

static inline module_state *cstate(PyObject *self) { return state_of_type(Py_TYPE(self)); }

/* 1 if the communicator is open; else 0 with CommError "<op>: the communicator is closed". */
static inline int live(CommObject *self, const char *op) {
  if (!self->comm) {
    module_state *st = cstate((PyObject *)self);
    PyErr_Format(st ? st->CommError : PyExc_RuntimeError, "%s: the communicator is closed", op);
    return 0;
  }
  return 1;
}

#define CALL_NOGIL(st, expr)            \
  do {                                  \
    Py_BEGIN_ALLOW_THREADS st = (expr); \
    Py_END_ALLOW_THREADS                \
  } while (0)

/* A call on the communicator with the GIL released.  close() from another thread
 * meanwhile aborts the call and the communicator is destroyed when the last
 * running call has returned (never under it). */
static inline void comm_leave(CommObject *self) {
  if (--self->inflight == 0 && self->closing) {
    tp_comm_t z = self->closing;
    self->closing = NULL;
    Py_BEGIN_ALLOW_THREADS tp_comm_destroy(z);
    Py_END_ALLOW_THREADS
  }
}

/* A sequence of `size` non-negative ints (elements per rank) into counts; -1 with a
 * ValueError / TypeError naming op otherwise. */
int parse_counts(PyObject *obj, int size, size_t *counts, const char *op);
/* comm_a2a.c: Comm.all_to_all(x, out, send_counts, recv_counts). */
PyObject *comm_all_to_all(PyObject *o, PyObject *args);

/* site.c: the package's folder (at module exec), and the call site ("file.py:LINE" of the
 * first frame outside tpcore) handed to the core for its history; reset with NULL after. */
void site_init(PyObject *module);
void comm_set_call_site(tp_comm_t c);

/* st = expr, run with the GIL released; expr may name the communicator as c_.  The calls
 * it makes carry the Python caller's site (site.c). */
#define COMM_CALL(self, st, expr)                            \
  do {                                                       \
    tp_comm_t c_ = (self)->comm;                             \
    (self)->inflight++;                                      \
    comm_set_call_site(c_);                                  \
    Py_BEGIN_ALLOW_THREADS st = (expr);                      \
    Py_END_ALLOW_THREADS if (c_) tp_comm_set_site(c_, NULL); \
    comm_leave(self);                                        \
  } while (0)

/* ------------------------------------------------------------ layer_common.c */

/* A layer dimension: BLAS takes 32-bit ints. */
#define DIM_MAX ((long long)INT_MAX)

/* An integer argument (an int or anything with __index__; not a float or a bool) in
 * [lo, hi]: TypeError or ValueError naming the op, the argument, the range and what came. */
int int_arg(PyObject *o, const char *op, const char *name, long long lo, long long hi, long long *out);
/* A seed: an integer in [0, 2**64). */
int seed_arg(PyObject *o, const char *op, uint64_t *out);
/* partition=None or a sequence of `size` ints -> *sizes (PyMem, NULL for None). */
int parse_partition(PyObject *part, int size, int64_t **sizes);
/* An activation name -> tp_activation_t; ValueError listing the names. */
int parse_act(const char *name, tp_activation_t *act);

/* comm as a live communicator object of this module, or NULL with an exception. */
CommObject *layer_comm(module_state *st, PyObject *commo, const char *who);
/* The end of a layer constructor (see layer_common.c). */
PyObject *layer_made(PyObject *self, CommObject **slot, CommObject *co, tp_status_t s, module_state *st,
                     const char *name);
/* The end of a layer's dealloc, after its C object is destroyed. */
void layer_free(PyObject *o, CommObject *comm);
/* The output of a layer call: the caller's `out` workspace (checked: float32,
 * (M, cols), writable) or a new array.  A new reference, or NULL. */
PyObject *layer_output(PyObject *out, const char *op, int64_t M, int64_t cols);
/* A failed layer call: backward before forward is a RuntimeError, the rest as statuses. */
PyObject *layer_error(CommObject *co, tp_status_t s, const char *op, int backward);
/* memory(): a layer's tp_layer_memory_t (filled with status s) as a dict, or NULL raised. */
PyObject *layer_memory(PyObject *self, tp_status_t s, const tp_layer_memory_t *m, const char *op);

/* ------------------------------------------------------ the layer types' files */

extern PyType_Spec lin_spec;            /* linear.c */
extern PyType_Spec mlp_spec;            /* mlp.c */
extern PyType_Spec emb_spec, xent_spec; /* vocab.c */
extern PyType_Spec blk_spec;            /* block.c */

/* A ParallelLinear object that borrows L (owned by `owner`, e.g. an MLP, kept alive). */
PyObject *linear_borrowed(module_state *st, tp_parallel_linear_t L, CommObject *comm, PyObject *owner,
                          tp_device_t device, int device_id);

/* ----------------------------------------------------------------- kernels.c */

extern PyMethodDef kernel_methods[];    /* added to the module by module.c */
extern PyMethodDef attention_methods[]; /* likewise (kernels_attn.c: the attention kernel) */
extern PyMethodDef quant_methods[];     /* likewise (quant.c: the quantized weight rows) */
extern PyMethodDef partition_methods[]; /* likewise (partition.c) */
extern PyMethodDef cuda_methods[];      /* likewise (cuda.c: the CUDA plugin and library finder) */

/* ------------------------------------------------- dlpack.c and devarray.c */

/* Any DLPack producer (or a bare capsule) -> a checked tp_tensor view (CPU, CUDA-host
 * or CUDA; known dtype; C-contiguous; byte_offset added) and *hold, whose release
 * calls the producer's deleter once.  `writable`: refuse a read-only tensor. */
int dlpack_import(PyObject *obj, const char *op, const char *arg, int writable, tp_tensor *t, PyObject **hold,
                  int *readonly);
/* 1 when CUDA tensors can be used in this process (loads the CUDA plugin once). */
int dlpack_cuda_usable(void);
/* One line on why CUDA is (not) usable. */
const char *dlpack_cuda_status(void);
/* device strings: None/'cpu' -> CPU; 'cuda' (the rank's GPU), 'cuda:N'; checked. */
int parse_device(PyObject *o, const char *op, tp_device_t *type, int *id);
/* A DeviceArray viewing t, its memory kept alive by base. */
PyObject *devarray_wrap(module_state *st, const tp_tensor *t, PyObject *base, int readonly);
/* The tensor of a DeviceArray, or NULL with a TypeError. */
const tp_tensor *devarray_tensor(module_state *st, PyObject *o);
/* The tensor (and read-only flag) of o when o is a tpcore.DeviceArray of any module
 * instance; NULL, with no exception, when it is not one. */
const tp_tensor *devarray_peek(PyObject *o, int *readonly);

/* A new array (contents undefined) on (dev, id): a layer's output. */
PyObject *devarray_empty(module_state *st, tp_device_t dev, int id, tp_dtype_t dt, int ndim, const int64_t *shape);
/* x (a DeviceArray or any DLPack tensor) as a tensor on (dev, id); *keep holds it.
 * Another device is a TypeError naming who, arg and both devices. */
int device_input(module_state *st, PyObject *x, const char *who, const char *arg, int writable, tp_device_t dev, int id,
                 tp_tensor *t, PyObject **keep);

/* One forward/backward of a layer on a GPU: x (and out) tensors on (dev, id) of shape
 * (M, in_cols) / (M, out_cols), the output a new DeviceArray unless out is given;
 * fn(layer, y, x) runs with the GIL released through co (the legacy default stream). */
PyObject *device_layer_call(module_state *st, CommObject *co, const char *op, const char *arg, tp_device_t dev, int id,
                            int64_t in_cols, int64_t out_cols, PyObject *x, PyObject *out,
                            tp_status_t (*fn)(void *layer, const tp_tensor *y, const tp_tensor *x), void *layer,
                            int backward);

/* A device tensor's dtype, rank and shape (entries < 0: any) checked, naming op and arg. */
int device_check(const tp_tensor *t, const char *op, const char *arg, tp_dtype_t dt, int ndim, const int64_t *shape);
/* out checked (on (dev, id), writable, dtype, shape), or a new DeviceArray for None. */
int device_output(module_state *st, PyObject *out, const char *op, tp_device_t dev, int id, tp_dtype_t dt, int ndim,
                  const int64_t *shape, tp_tensor *t, PyObject **keep);
/* A GPU layer's float32 parameter as a DeviceArray view kept alive by owner (None for NULL). */
PyObject *device_param_view_dt(module_state *st, PyObject *owner, void *p, tp_dtype_t dt, int nd, int64_t d0,
                               int64_t d1, tp_device_t dev, int id);
PyObject *device_param_view(module_state *st, PyObject *owner, float *p, int nd, int64_t d0, int64_t d1,
                            tp_device_t dev, int id);

extern PyType_Spec store_spec;         /* store.c */
extern PyType_Spec devarray_spec;      /* devarray.c */
extern PyMethodDef devarray_methods[]; /* from_dlpack, asarray, parse_device */

#endif /* TPCORE_PYTHON_EXT_H */
