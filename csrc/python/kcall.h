/* The calling convention of the kernel bindings (kernels.c, kernels_attn.c): a kcall
 * collects the tensor arguments of one call (kc_in: NumPy arrays, DeviceArrays or DLPack
 * tensors, all on the first one's device), makes new outputs of the first one's kind
 * (kc_new) and turns the kernel's status into the call's result (kc_done, kc_fail). */
#ifndef TPCORE_PYTHON_KCALL_H
#define TPCORE_PYTHON_KCALL_H

#include "ext.h"

#define KC_MAX_ARGS 12

typedef struct {
  module_state *st;
  const char *op;
  tp_device_t dev;
  int id, have, numpy; /* numpy: the first tensor was a NumPy array (outputs are NumPy) */
  PyObject *keep[KC_MAX_ARGS];
  int nkeep;
} kcall;

#define KCALL(name, mod) kcall c = {(module_state *)PyModule_GetState(mod), name, TP_DEVICE_CPU, 0, 0, 0, {0}, 0}
#define KRUN(s, expr)                  \
  do {                                 \
    Py_BEGIN_ALLOW_THREADS s = (expr); \
    Py_END_ALLOW_THREADS               \
  } while (0)

/* The references a call holds, dropped. */
void kc_release(kcall *c);
/* o as a tensor on the call's device (the first tensor fixes it); optional: None gives
 * *tp = NULL.  0 / -1 (an exception set). */
int kc_in(kcall *c, PyObject *o, const char *name, int writable, int optional, tp_tensor *t, const tp_tensor **tp);
/* A new output of the call's kind: *t its tensor; the array is returned (new ref). */
PyObject *kc_new(kcall *c, tp_dtype_t dt, int ndim, const int64_t *shape, tp_tensor *t);
/* result when s is TP_SUCCESS (else the status raised, result dropped); releases the call. */
PyObject *kc_done(kcall *c, tp_status_t s, PyObject *result);
/* NULL with the exception already set; releases the call. */
PyObject *kc_fail(kcall *c);

#endif
