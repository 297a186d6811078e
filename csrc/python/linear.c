/*
 * linear.c: the ParallelLinear type (tpcore._C.ParallelLinear), a column- or
 * row-parallel linear layer of the C core: constructor, forward/backward, and
 * views of its weight, bias and gradients.  linear_borrowed makes one that views
 * a layer owned by another object (an MLP's fc1/fc2).
 */
#include "ext.h"

typedef struct {
  PyObject_HEAD tp_parallel_linear_t L;
  CommObject *comm; /* kept alive; calls go through its in-flight accounting */
  tp_linear_info_t info;
  PyObject *owner;    /* an MLP that owns L (then L is not destroyed here) */
  tp_device_t device; /* where its parameters and tensors live */
  int device_id;
} LinearObject;

static PyObject *lin_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {
      "comm", "kind",  "in_features", "out_features", "bias", "gather_output", "input_is_parallel", "partition",
      "seed", "gated", "device",      "weight_dtype", NULL};
  PyObject *commo, *part = Py_None, *in_o, *out_o, *seed_o = NULL, *dev_o = Py_None, *wdt_o = Py_None;
  const char *kind;
  long long in_f, out_f;
  int bias = 1, gather = 0, inpar = 1, gated = 0;
  uint64_t seed = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OsOO|pppOOpOO:ParallelLinear", kwlist, &commo, &kind, &in_o, &out_o,
                                   &bias, &gather, &inpar, &part, &seed_o, &gated, &dev_o, &wdt_o))
    return NULL;
  if (int_arg(in_o, "ParallelLinear", "in_features", 1, DIM_MAX, &in_f) < 0 ||
      int_arg(out_o, "ParallelLinear", "out_features", 1, DIM_MAX, &out_f) < 0 ||
      (seed_o && seed_arg(seed_o, "ParallelLinear", &seed) < 0))
    return NULL;
  module_state *st = state_of_type(type);
  CommObject *co = layer_comm(st, commo, "ParallelLinear");
  if (!co) return NULL;
  tp_linear_config_t cfg = TP_LINEAR_CONFIG_INITIALIZER;
  if (strcmp(kind, "column") == 0) cfg.kind = TP_COLUMN_PARALLEL;
  else if (strcmp(kind, "row") == 0) cfg.kind = TP_ROW_PARALLEL;
  else {
    PyErr_Format(PyExc_ValueError, "ParallelLinear: kind must be 'column' or 'row', got '%s'", kind);
    return NULL;
  }
  cfg.in_features = in_f;
  cfg.out_features = out_f;
  cfg.bias = bias;
  cfg.gather_output = gather;
  cfg.input_is_parallel = inpar;
  cfg.seed = seed;
  cfg.gated = gated;
  if (parse_device(dev_o, "ParallelLinear", &cfg.device, &cfg.device_id) < 0) return NULL;
  if (parse_weight_dtype(wdt_o, "ParallelLinear", &cfg.weight_dtype) < 0) return NULL;
  int size;
  tp_comm_size(co->comm, &size);
  int64_t *sizes;
  if (parse_partition(part, size, &sizes) < 0) return NULL;
  cfg.partition = sizes;
  LinearObject *self = (LinearObject *)type->tp_alloc(type, 0);
  if (!self) {
    PyMem_Free(sizes);
    return NULL;
  }
  tp_status_t s;
  COMM_CALL(co, s, tp_parallel_linear_create(&self->L, c_, &cfg));
  PyMem_Free(sizes);
  if (!layer_made((PyObject *)self, &self->comm, co, s, st, "ParallelLinear")) return NULL;
  tp_parallel_linear_info(self->L, &self->info);
  self->device = cfg.device;
  self->device_id = cfg.device_id;
  return (PyObject *)self;
}

static void lin_dealloc(PyObject *o) {
  LinearObject *self = (LinearObject *)o;
  if (self->owner) Py_DECREF(self->owner);
  else tp_parallel_linear_destroy(self->L);
  layer_free(o, self->comm);
}

static tp_status_t lin_fwd(void *L, const tp_tensor *y, const tp_tensor *x) {
  return tp_parallel_linear_forward((tp_parallel_linear_t)L, y, x, NULL);
}
static tp_status_t lin_bwd(void *L, const tp_tensor *dx, const tp_tensor *dy) {
  return tp_parallel_linear_backward((tp_parallel_linear_t)L, dx, dy, NULL);
}

/* A layer on a GPU: x (and out) are tensors on its device (a DeviceArray or any DLPack
 * tensor); the output is a new DeviceArray there unless out is given. */
static PyObject *lin_run_device(LinearObject *self, PyObject *x, PyObject *out, int backward) {
  return device_layer_call(
      state_of_type(Py_TYPE(self)), self->comm, backward ? "ParallelLinear.backward" : "ParallelLinear.forward",
      backward ? "dy" : "x", self->device, self->device_id, backward ? self->info.y_cols : self->info.x_cols,
      backward ? self->info.x_cols : self->info.y_cols, x, out, backward ? lin_bwd : lin_fwd, self->L, backward);
}

static PyObject *lin_run(PyObject *o, PyObject *x, PyObject *out, int backward) {
  LinearObject *self = (LinearObject *)o;
  if (self->device != TP_DEVICE_CPU) {
    if (!live(self->comm, backward ? "backward" : "forward")) return NULL;
    return lin_run_device(self, x, out, backward);
  }
  const char *op = backward ? "backward" : "forward";
  if (!live(self->comm, op)) return NULL;
  int64_t in_cols = backward ? self->info.y_cols : self->info.x_cols;
  int64_t out_cols = backward ? self->info.x_cols : self->info.y_cols;
  int64_t M;
  if (matrix_arg(x, op, backward ? "dy" : "x", in_cols, &M) < 0) return NULL;
  PyObject *y = layer_output(out, op, M, out_cols);
  if (!y) return NULL;
  const float *xp = PyArray_DATA((PyArrayObject *)x);
  float *yp = PyArray_DATA((PyArrayObject *)y);
  tp_status_t s;
  CommObject *co = self->comm;
  tp_tensor tx = tp_tensor_2d((void *)xp, TP_FLOAT32, M, in_cols), ty = tp_tensor_2d(yp, TP_FLOAT32, M, out_cols);
  if (backward) COMM_CALL(co, s, ((void)c_, tp_parallel_linear_backward(self->L, &ty, &tx, NULL)));
  else COMM_CALL(co, s, ((void)c_, tp_parallel_linear_forward(self->L, &ty, &tx, NULL)));
  if (s != TP_SUCCESS) {
    Py_DECREF(y);
    return layer_error(co, s, op, backward);
  }
  return y;
}

static PyObject *lin_call(PyObject *o, PyObject *args, int backward) {
  PyObject *x, *out = Py_None;
  if (!PyArg_ParseTuple(args, backward ? "O|O:backward" : "O|O:forward", &x, &out)) return NULL;
  return lin_run(o, x, out, backward);
}
static PyObject *lin_forward(PyObject *o, PyObject *args) { return lin_call(o, args, 0); }
static PyObject *lin_backward(PyObject *o, PyObject *args) { return lin_call(o, args, 1); }

/* A parameter of a GPU layer: a DeviceArray view kept alive by the layer. */
static PyObject *device_param(LinearObject *self, float *p, int nd, int64_t d0, int64_t d1) {
  if (!p) Py_RETURN_NONE;
  int64_t shape[2] = {d0, d1};
  tp_tensor t = tp_tensor_nd(p, TP_FLOAT32, nd, shape);
  t.device = self->device;
  t.device_id = self->device_id;
  return devarray_wrap(state_of_type(Py_TYPE(self)), &t, (PyObject *)self, 0);
}

static PyObject *lin_get(PyObject *o, void *which) {
  LinearObject *self = (LinearObject *)o;
  tp_linear_info_t *i = &self->info;
  tp_parallel_linear_info(self->L, i); /* the gradients appear with the first backward or alloc_grads */
  if (self->device != TP_DEVICE_CPU && (intptr_t)which < 4) {
    switch ((intptr_t)which) {
      case 0:
        return device_param_view_dt(state_of_type(Py_TYPE(self)), o, i->weight, i->weight_dtype, 2, i->weight_rows,
                                    i->weight_cols, self->device, self->device_id);
      case 1: return device_param(self, i->bias, 1, i->bias_len, 0);
      case 2: return device_param(self, i->grad_weight, 2, i->weight_rows, i->weight_cols);
      default: return device_param(self, i->grad_bias, 1, i->bias_len, 0);
    }
  }
  switch ((intptr_t)which) {
    case 0: return owned_view_dt(o, i->weight, i->weight_dtype, 2, i->weight_rows, i->weight_cols);
    case 1: return owned_view(o, i->bias, 1, i->bias_len, 0);
    case 2: return owned_view(o, i->grad_weight, 2, i->weight_rows, i->weight_cols);
    case 3: return owned_view(o, i->grad_bias, 1, i->bias_len, 0);
    case 5: return PyUnicode_FromFormat("%s:%d", tp_device_name(self->device), self->device_id);
    case 6: return PyUnicode_FromString(tp_dtype_name(i->weight_dtype));
    default:
      return Py_BuildValue("{s:L,s:L,s:L,s:L}", "offset", (long long)i->offset, "local", (long long)i->local, "x_cols",
                           (long long)i->x_cols, "y_cols", (long long)i->y_cols);
  }
}

static PyGetSetDef lin_getset[] = {
    {"weight", lin_get, NULL, "this rank's weight shard (a view)", (void *)0},
    {"bias", lin_get, NULL, "this rank's bias (a view), or None", (void *)1},
    {"grad_weight", lin_get, NULL, "gradient of the weight shard (a view), or None before alloc_grads / backward",
     (void *)2},
    {"grad_bias", lin_get, NULL, "gradient of the bias (a view), or None (no bias, or not allocated yet)", (void *)3},
    {"shard", lin_get, NULL, "offset/local of the split dimension, input/output columns", (void *)4},
    {"device", lin_get, NULL, "'cpu:0' or 'cuda:N'", (void *)5},
    {"weight_dtype", lin_get, NULL, "'float32', 'bfloat16' or 'float16': the weight's storage", (void *)6},
    {NULL, NULL, NULL, NULL, NULL},
};

/* The gradient buffers, zeroed (backward makes them too): idempotent; none for a quantized weight. */
static PyObject *lin_alloc_grads(PyObject *o, PyObject *unused) {
  LinearObject *self = (LinearObject *)o;
  tp_status_t s = tp_parallel_linear_alloc_grads(self->L);
  if (s != TP_SUCCESS) return raise_status(cstate(o), s, "alloc_grads"); /* local: a closed comm is no matter */
  tp_parallel_linear_info(self->L, &self->info);
  Py_RETURN_NONE;
}

static PyObject *lin_memory(PyObject *o, PyObject *unused) {
  LinearObject *self = (LinearObject *)o;
  tp_layer_memory_t m;
  m.size = sizeof m;
  return layer_memory(o, tp_parallel_linear_memory(self->L, &m), &m, "memory");
}

static PyMethodDef lin_methods[] = {
    {"alloc_grads", lin_alloc_grads, METH_NOARGS, "alloc_grads(): allocate the gradients (zeroed) now; idempotent"},
    {"memory", lin_memory, METH_NOARGS,
     "memory() -> {device, params, grads, workspace, cache, cache_used, comm}: bytes this rank's layer holds"},
    {"forward", lin_forward, METH_VARARGS, "forward(x[M, x_cols], out=None) -> y[M, y_cols]"},
    {"backward", lin_backward, METH_VARARGS, "backward(dy[M, y_cols], out=None) -> dx[M, x_cols]; accumulates grads"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot lin_slots[] = {
    {Py_tp_new, lin_new},
    {Py_tp_dealloc, lin_dealloc},
    {Py_tp_methods, lin_methods},
    {Py_tp_getset, lin_getset},
    {Py_tp_doc,
     "ParallelLinear(comm, kind, in_features, out_features, bias=True, gather_output=False, "
     "input_is_parallel=True, partition=None, seed=0): use tpcore.ColumnParallelLinear / RowParallelLinear"},
    {0, NULL},
};

PyType_Spec lin_spec = {
    .name = "tpcore._C.ParallelLinear",
    .basicsize = sizeof(LinearObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = lin_slots,
};

PyObject *linear_borrowed(module_state *st, tp_parallel_linear_t L, CommObject *comm, PyObject *owner,
                          tp_device_t device, int device_id) {
  LinearObject *l = (LinearObject *)st->LinearType->tp_alloc(st->LinearType, 0);
  if (!l) return NULL;
  l->L = L;
  tp_parallel_linear_info(l->L, &l->info);
  Py_INCREF(comm);
  l->comm = comm;
  Py_INCREF(owner);
  l->owner = owner;
  l->device = device;
  l->device_id = device_id;
  return (PyObject *)l;
}
