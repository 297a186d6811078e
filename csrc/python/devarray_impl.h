/* devarray_impl.h: what devarray.c (the DeviceArray type) and devarray_dlpack.c (its DLPack
 * export) share. */
#ifndef TPCORE_DEVARRAY_IMPL_H
#define TPCORE_DEVARRAY_IMPL_H

#include "ext.h" /* first: Python.h */

#include "dlpack_abi.h"

/* dlpack.c */
int dlpack_import(PyObject *obj, const char *op, const char *arg, int writable, tp_tensor *t, PyObject **hold,
                  int *readonly);
DLDataType dlpack_dtype_of(tp_dtype_t t);
const char *dlpack_cuda_status(void);

typedef struct {
  PyObject_HEAD tp_tensor t;
  size_t nbytes;
  void *alloc;    /* owned device memory, or NULL */
  PyObject *base; /* owner of viewed memory, or NULL */
  int readonly;
} DevArray;

/* devarray.c: a copy of a on (dev, id), synchronised (the host can read it at once). */
PyObject *devarray_copy_to(DevArray *a, tp_device_t dev, int id);

/* devarray_dlpack.c: the methods __dlpack__(stream=, max_version=, dl_device=, copy=) and
 * __dlpack_device__(). */
PyObject *da_dlpack(PyObject *self, PyObject *args, PyObject *kw);
PyObject *da_dlpack_device(PyObject *self, PyObject *unused);

#endif
