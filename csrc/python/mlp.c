/*
 * mlp.c: the ParallelMLP type (tpcore._C.ParallelMLP): fc1 column-parallel, the
 * activation, fc2 row-parallel, one all-reduce per forward; fc1 and fc2 are also
 * reachable as ParallelLinear views (linear_borrowed).
 */
#include "ext.h"

typedef struct {
  PyObject_HEAD tp_parallel_mlp_t M;
  CommObject *comm;
  int64_t hidden;
  tp_device_t device; /* where its parameters and tensors live */
  int device_id;
} MLPObject;

static PyObject *mlp_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"comm",      "hidden", "ffn_hidden", "activation",   "bias",
                           "partition", "seed",   "device",     "weight_dtype", NULL};
  PyObject *commo, *part = Py_None, *hidden_o, *ffn_o, *seed_o = NULL, *dev_o = Py_None, *wdt_o = Py_None;
  const char *actname;
  long long hidden, ffn;
  int bias = 1;
  uint64_t seed = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOs|pOOOO:ParallelMLP", kwlist, &commo, &hidden_o, &ffn_o, &actname,
                                   &bias, &part, &seed_o, &dev_o, &wdt_o))
    return NULL;
  if (int_arg(hidden_o, "ParallelMLP", "hidden", 1, DIM_MAX, &hidden) < 0 ||
      int_arg(ffn_o, "ParallelMLP", "ffn_hidden", 1, DIM_MAX, &ffn) < 0 ||
      (seed_o && seed_arg(seed_o, "ParallelMLP", &seed) < 0))
    return NULL;
  module_state *st = state_of_type(type);
  CommObject *co = layer_comm(st, commo, "ParallelMLP");
  if (!co) return NULL;
  tp_mlp_config_t cfg = TP_MLP_CONFIG_INITIALIZER;
  if (parse_act(actname, &cfg.activation) < 0) return NULL;
  cfg.hidden = hidden;
  cfg.ffn_hidden = ffn;
  cfg.bias = bias;
  cfg.seed = seed;
  if (parse_device(dev_o, "ParallelMLP", &cfg.device, &cfg.device_id) < 0) return NULL;
  if (parse_weight_dtype(wdt_o, "ParallelMLP", &cfg.weight_dtype) < 0) return NULL;
  int size;
  tp_comm_size(co->comm, &size);
  int64_t *sizes;
  if (parse_partition(part, size, &sizes) < 0) return NULL;
  cfg.partition = sizes;
  MLPObject *self = (MLPObject *)type->tp_alloc(type, 0);
  if (!self) {
    PyMem_Free(sizes);
    return NULL;
  }
  tp_status_t s;
  COMM_CALL(co, s, tp_parallel_mlp_create(&self->M, c_, &cfg));
  PyMem_Free(sizes);
  if (!layer_made((PyObject *)self, &self->comm, co, s, st, "ParallelMLP")) return NULL;
  self->hidden = hidden;
  self->device = cfg.device;
  self->device_id = cfg.device_id;
  return (PyObject *)self;
}

static void mlp_dealloc(PyObject *o) {
  MLPObject *self = (MLPObject *)o;
  tp_parallel_mlp_destroy(self->M);
  layer_free(o, self->comm);
}

static tp_status_t mlp_fwd(void *m, const tp_tensor *y, const tp_tensor *x) {
  return tp_parallel_mlp_forward((tp_parallel_mlp_t)m, y, x, NULL);
}
static tp_status_t mlp_bwd(void *m, const tp_tensor *dx, const tp_tensor *dy) {
  return tp_parallel_mlp_backward((tp_parallel_mlp_t)m, dx, dy, NULL);
}

static PyObject *mlp_call(PyObject *o, PyObject *args, int backward) {
  MLPObject *self = (MLPObject *)o;
  const char *op = backward ? "backward" : "forward";
  PyObject *x, *out = Py_None;
  if (!PyArg_ParseTuple(args, backward ? "O|O:backward" : "O|O:forward", &x, &out)) return NULL;
  if (!live(self->comm, op)) return NULL;
  if (self->device != TP_DEVICE_CPU) /* a GPU MLP: device tensors in, a DeviceArray out */
    return device_layer_call(state_of_type(Py_TYPE(o)), self->comm,
                             backward ? "ParallelMLP.backward" : "ParallelMLP.forward", backward ? "dy" : "x",
                             self->device, self->device_id, self->hidden, self->hidden, x, out,
                             backward ? mlp_bwd : mlp_fwd, self->M, backward);
  int64_t M;
  if (matrix_arg(x, op, backward ? "dy" : "x", self->hidden, &M) < 0) return NULL;
  PyObject *y = layer_output(out, op, M, self->hidden);
  if (!y) return NULL;
  const float *xp = PyArray_DATA((PyArrayObject *)x);
  float *yp = PyArray_DATA((PyArrayObject *)y);
  tp_status_t s;
  CommObject *co = self->comm;
  tp_tensor tx = tp_tensor_2d((void *)xp, TP_FLOAT32, M, self->hidden),
            ty = tp_tensor_2d(yp, TP_FLOAT32, M, self->hidden);
  if (backward) COMM_CALL(co, s, ((void)c_, tp_parallel_mlp_backward(self->M, &ty, &tx, NULL)));
  else COMM_CALL(co, s, ((void)c_, tp_parallel_mlp_forward(self->M, &ty, &tx, NULL)));
  if (s != TP_SUCCESS) {
    Py_DECREF(y);
    return layer_error(co, s, op, backward);
  }
  return y;
}

static PyObject *mlp_forward(PyObject *o, PyObject *args) { return mlp_call(o, args, 0); }
static PyObject *mlp_backward(PyObject *o, PyObject *args) { return mlp_call(o, args, 1); }

/* fc1 / fc2 as ParallelLinear objects that borrow the MLP's layers. */
static PyObject *mlp_layer(PyObject *o, void *which) {
  MLPObject *self = (MLPObject *)o;
  module_state *st = state_of_type(Py_TYPE(o));
  if (!st) return NULL;
  return linear_borrowed(st, tp_parallel_mlp_layer(self->M, (int)(intptr_t)which), self->comm, o, self->device,
                         self->device_id);
}

static PyGetSetDef mlp_getset[] = {
    {"fc1", mlp_layer, NULL, "the column-parallel fc1 (a view of the MLP's layer)", (void *)0},
    {"fc2", mlp_layer, NULL, "the row-parallel fc2 (a view of the MLP's layer)", (void *)1},
    {NULL, NULL, NULL, NULL, NULL},
};

/* fc1's and fc2's gradients, zeroed (backward makes them too): idempotent. */
static PyObject *mlp_alloc_grads(PyObject *o, PyObject *unused) {
  MLPObject *self = (MLPObject *)o;
  tp_status_t s = tp_parallel_mlp_alloc_grads(self->M);
  if (s != TP_SUCCESS) return raise_status(cstate(o), s, "alloc_grads"); /* local: a closed comm is no matter */
  Py_RETURN_NONE;
}

static PyObject *mlp_memory(PyObject *o, PyObject *unused) {
  MLPObject *self = (MLPObject *)o;
  tp_layer_memory_t m;
  m.size = sizeof m;
  return layer_memory(o, tp_parallel_mlp_memory(self->M, &m), &m, "memory");
}

static PyMethodDef mlp_methods[] = {
    {"alloc_grads", mlp_alloc_grads, METH_NOARGS, "alloc_grads(): allocate fc1's and fc2's gradients (zeroed) now"},
    {"memory", mlp_memory, METH_NOARGS,
     "memory() -> {device, params, grads, workspace, cache, cache_used, comm}: bytes this rank's layer holds"},
    {"forward", mlp_forward, METH_VARARGS, "forward(x[M, hidden], out=None) -> y[M, hidden]"},
    {"backward", mlp_backward, METH_VARARGS, "backward(dy[M, hidden], out=None) -> dx[M, hidden]"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot mlp_slots[] = {
    {Py_tp_new, mlp_new},
    {Py_tp_dealloc, mlp_dealloc},
    {Py_tp_methods, mlp_methods},
    {Py_tp_getset, mlp_getset},
    {Py_tp_doc,
     "ParallelMLP(comm, hidden, ffn_hidden, activation, bias=True, partition=None, seed=0): "
     "use tpcore.ParallelMLP"},
    {0, NULL},
};

PyType_Spec mlp_spec = {
    .name = "tpcore._C.ParallelMLP",
    .basicsize = sizeof(MLPObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = mlp_slots,
};
