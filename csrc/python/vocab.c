/*
 * vocab.c: the vocabulary-parallel pair.  VocabEmbedding (tpcore._C.VocabEmbedding):
 * each rank holds a slice of the table's rows; forward looks tokens up and
 * all-reduces.  VocabCrossEntropy (tpcore._C.VocabCrossEntropy): the loss over
 * logits whose vocabulary is split across ranks, without gathering them.
 */
#include "ext.h"

/* ------------------------------------------------------ VocabParallelEmbedding */

typedef struct {
  PyObject_HEAD tp_vocab_embedding_t E;
  CommObject *comm;
  tp_embedding_info_t info;
  tp_device_t device; /* where its table and tensors live */
  int device_id;
} EmbeddingObject;

static PyObject *emb_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"comm", "num_embeddings", "embedding_dim", "partition",
                           "seed", "device",         "weight_dtype",  NULL};
  PyObject *commo, *part = Py_None, *n_o, *dim_o, *seed_o = NULL, *dev_o = Py_None, *wdt_o = Py_None;
  long long n, dim;
  uint64_t seed = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OOOO:VocabParallelEmbedding", kwlist, &commo, &n_o, &dim_o, &part,
                                   &seed_o, &dev_o, &wdt_o))
    return NULL;
  if (int_arg(n_o, "VocabParallelEmbedding", "num_embeddings", 1, LLONG_MAX, &n) < 0 ||
      int_arg(dim_o, "VocabParallelEmbedding", "embedding_dim", 1, LLONG_MAX, &dim) < 0 ||
      (seed_o && seed_arg(seed_o, "VocabParallelEmbedding", &seed) < 0))
    return NULL;
  module_state *st = state_of_type(type);
  CommObject *co = layer_comm(st, commo, "VocabParallelEmbedding");
  if (!co) return NULL;
  tp_embedding_config_t cfg = TP_EMBEDDING_CONFIG_INITIALIZER;
  cfg.num_embeddings = n;
  cfg.embedding_dim = dim;
  cfg.seed = seed;
  if (parse_device(dev_o, "VocabParallelEmbedding", &cfg.device, &cfg.device_id) < 0) return NULL;
  if (parse_weight_dtype(wdt_o, "VocabParallelEmbedding", &cfg.weight_dtype) < 0) return NULL;
  int size;
  tp_comm_size(co->comm, &size);
  int64_t *sizes;
  if (parse_partition(part, size, &sizes) < 0) return NULL;
  cfg.partition = sizes;
  EmbeddingObject *self = (EmbeddingObject *)type->tp_alloc(type, 0);
  if (!self) {
    PyMem_Free(sizes);
    return NULL;
  }
  tp_status_t s;
  COMM_CALL(co, s, tp_vocab_embedding_create(&self->E, c_, &cfg));
  PyMem_Free(sizes);
  if (!layer_made((PyObject *)self, &self->comm, co, s, st, "VocabParallelEmbedding")) return NULL;
  tp_vocab_embedding_info(self->E, &self->info);
  self->device = cfg.device;
  self->device_id = cfg.device_id;
  return (PyObject *)self;
}

static void emb_dealloc(PyObject *o) {
  EmbeddingObject *self = (EmbeddingObject *)o;
  tp_vocab_embedding_destroy(self->E);
  layer_free(o, self->comm);
}

/* A GPU table: tokens[M] int64 on its device in, y[M, dim] a DeviceArray there (or out). */
static PyObject *emb_forward_device(EmbeddingObject *self, PyObject *to, PyObject *out) {
  static const char *op = "VocabParallelEmbedding.forward";
  module_state *st = state_of_type(Py_TYPE(self));
  tp_tensor tt, ty;
  PyObject *kt = NULL, *ky = NULL;
  if (device_input(st, to, op, "tokens", 0, self->device, self->device_id, &tt, &kt) < 0) return NULL;
  if (device_check(&tt, op, "tokens", TP_INT64, 1, NULL) < 0) {
    Py_DECREF(kt);
    return NULL;
  }
  int64_t shape[2] = {tt.shape[0], self->info.dim};
  if (device_output(st, out, op, self->device, self->device_id, TP_FLOAT32, 2, shape, &ty, &ky) < 0) {
    Py_DECREF(kt);
    return NULL;
  }
  tp_status_t s;
  COMM_CALL(self->comm, s, ((void)c_, tp_vocab_embedding_forward(self->E, &ty, &tt, NULL)));
  Py_DECREF(kt);
  if (s != TP_SUCCESS) {
    Py_DECREF(ky);
    return layer_error(self->comm, s, "embedding forward", 0);
  }
  return ky;
}

static PyObject *emb_forward(PyObject *o, PyObject *args) {
  EmbeddingObject *self = (EmbeddingObject *)o;
  PyObject *to, *out = Py_None;
  if (!PyArg_ParseTuple(args, "O|O:forward", &to, &out)) return NULL;
  if (!live(self->comm, "forward")) return NULL;
  if (self->device != TP_DEVICE_CPU) return emb_forward_device(self, to, out);
  int64_t M;
  if (tokens_arg(to, "embedding forward", "tokens", &M) < 0) return NULL;
  PyObject *y = layer_output(out, "embedding forward", M, self->info.dim);
  if (!y) return NULL;
  const int64_t *tp = PyArray_DATA((PyArrayObject *)to);
  float *yp = PyArray_DATA((PyArrayObject *)y);
  tp_status_t s;
  tp_tensor ty = tp_tensor_2d(yp, TP_FLOAT32, M, self->info.dim), tt = tp_tensor_1d((void *)tp, TP_INT64, M);
  COMM_CALL(self->comm, s, ((void)c_, tp_vocab_embedding_forward(self->E, &ty, &tt, NULL)));
  if (s != TP_SUCCESS) {
    Py_DECREF(y);
    return layer_error(self->comm, s, "embedding forward", 0);
  }
  return y;
}

static PyObject *emb_backward(PyObject *o, PyObject *dy) {
  EmbeddingObject *self = (EmbeddingObject *)o;
  if (!live(self->comm, "backward")) return NULL;
  if (self->device != TP_DEVICE_CPU) { /* dy[M, dim] float32 on the table's device */
    static const char *op = "VocabParallelEmbedding.backward";
    tp_tensor td;
    PyObject *kd = NULL;
    int64_t shape[2] = {-1, self->info.dim};
    if (device_input(state_of_type(Py_TYPE(o)), dy, op, "dy", 0, self->device, self->device_id, &td, &kd) < 0)
      return NULL;
    if (device_check(&td, op, "dy", TP_FLOAT32, 2, shape) < 0) {
      Py_DECREF(kd);
      return NULL;
    }
    tp_status_t s;
    COMM_CALL(self->comm, s, ((void)c_, tp_vocab_embedding_backward(self->E, &td, NULL)));
    Py_DECREF(kd);
    if (s != TP_SUCCESS) return layer_error(self->comm, s, "embedding backward", 1);
    Py_RETURN_NONE;
  }
  int64_t M;
  if (matrix_arg(dy, "embedding backward", "dy", self->info.dim, &M) < 0) return NULL;
  const float *dp = PyArray_DATA((PyArrayObject *)dy);
  tp_status_t s;
  tp_tensor td = tp_tensor_2d((void *)dp, TP_FLOAT32, M, self->info.dim);
  COMM_CALL(self->comm, s, ((void)c_, tp_vocab_embedding_backward(self->E, &td, NULL)));
  if (s != TP_SUCCESS) return layer_error(self->comm, s, "embedding backward", 1);
  Py_RETURN_NONE;
}

static PyObject *emb_get(PyObject *o, void *which) {
  EmbeddingObject *self = (EmbeddingObject *)o;
  tp_embedding_info_t *i = &self->info;
  tp_vocab_embedding_info(self->E, i); /* the gradient appears with the first backward or alloc_grads */
  if (self->device != TP_DEVICE_CPU && (intptr_t)which < 2)
    return device_param_view_dt(state_of_type(Py_TYPE(o)), o, (intptr_t)which ? (void *)i->grad_weight : i->weight,
                                (intptr_t)which ? TP_FLOAT32 : i->weight_dtype, 2, i->local, i->dim, self->device,
                                self->device_id);
  switch ((intptr_t)which) {
    case 3: return PyUnicode_FromFormat("%s:%d", tp_device_name(self->device), self->device_id);
    case 0: return owned_view_dt(o, i->weight, i->weight_dtype, 2, i->local, i->dim);
    case 4: return PyUnicode_FromString(tp_dtype_name(i->weight_dtype));
    case 1: return owned_view(o, i->grad_weight, 2, i->local, i->dim);
    default: return Py_BuildValue("{s:L,s:L}", "offset", (long long)i->offset, "local", (long long)i->local);
  }
}

static PyGetSetDef emb_getset[] = {
    {"weight", emb_get, NULL, "this rank's rows of the table (a view)", (void *)0},
    {"grad_weight", emb_get, NULL, "their gradient (a view), or None before alloc_grads / backward", (void *)1},
    {"weight_dtype", emb_get, NULL, "'float32', 'bfloat16' or 'float16': the table's storage", (void *)4},
    {"shard", emb_get, NULL, "offset/local of this rank's vocabulary slice", (void *)2},
    {"device", emb_get, NULL, "'cpu:0' or 'cuda:N'", (void *)3},
    {NULL, NULL, NULL, NULL, NULL},
};

/* The table's gradient, zeroed (backward makes it too): idempotent; none for a quantized table. */
static PyObject *emb_alloc_grads(PyObject *o, PyObject *unused) {
  EmbeddingObject *self = (EmbeddingObject *)o;
  tp_status_t s = tp_vocab_embedding_alloc_grads(self->E);
  if (s != TP_SUCCESS) return raise_status(cstate(o), s, "alloc_grads"); /* local: a closed comm is no matter */
  tp_vocab_embedding_info(self->E, &self->info);
  Py_RETURN_NONE;
}

static PyObject *emb_memory(PyObject *o, PyObject *unused) {
  EmbeddingObject *self = (EmbeddingObject *)o;
  tp_layer_memory_t m;
  m.size = sizeof m;
  return layer_memory(o, tp_vocab_embedding_memory(self->E, &m), &m, "memory");
}

static PyMethodDef emb_methods[] = {
    {"alloc_grads", emb_alloc_grads, METH_NOARGS, "alloc_grads(): allocate the gradient (zeroed) now; idempotent"},
    {"memory", emb_memory, METH_NOARGS,
     "memory() -> {device, params, grads, workspace, cache, cache_used, comm}: bytes this rank's layer holds"},
    {"forward", emb_forward, METH_VARARGS, "forward(tokens[M] int64, out=None) -> y[M, dim] (collective)"},
    {"backward", emb_backward, METH_O, "backward(dy[M, dim]): accumulates grad_weight"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot emb_slots[] = {
    {Py_tp_new, emb_new},
    {Py_tp_dealloc, emb_dealloc},
    {Py_tp_methods, emb_methods},
    {Py_tp_getset, emb_getset},
    {Py_tp_doc,
     "VocabEmbedding(comm, num_embeddings, embedding_dim, partition=None, seed=0): "
     "use tpcore.VocabParallelEmbedding"},
    {0, NULL},
};

PyType_Spec emb_spec = {
    .name = "tpcore._C.VocabEmbedding",
    .basicsize = sizeof(EmbeddingObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = emb_slots,
};

/* --------------------------------------------------------- VocabCrossEntropy */

typedef struct {
  PyObject_HEAD tp_vocab_xent_t X;
  CommObject *comm;
  PyObject *logits; /* the last forward's logits, kept alive for backward */
  int64_t M, V;
  tp_device_t device; /* where its tensors live */
  int device_id;
} XentObject;

static PyObject *xent_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"comm", "device", NULL};
  PyObject *commo, *dev_o = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:VocabCrossEntropy", kwlist, &commo, &dev_o)) return NULL;
  module_state *st = state_of_type(type);
  CommObject *co = layer_comm(st, commo, "VocabParallelCrossEntropy");
  if (!co) return NULL;
  tp_xent_config_t cfg = TP_XENT_CONFIG_INITIALIZER;
  if (parse_device(dev_o, "VocabParallelCrossEntropy", &cfg.device, &cfg.device_id) < 0) return NULL;
  XentObject *self = (XentObject *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  tp_status_t s = tp_vocab_xent_create(&self->X, co->comm, &cfg);
  if (!layer_made((PyObject *)self, &self->comm, co, s, st, "VocabParallelCrossEntropy")) return NULL;
  self->device = cfg.device;
  self->device_id = cfg.device_id;
  return (PyObject *)self;
}

static void xent_dealloc(PyObject *o) {
  XentObject *self = (XentObject *)o;
  tp_vocab_xent_destroy(self->X);
  Py_XDECREF(self->logits);
  layer_free(o, self->comm);
}

/* A GPU cross-entropy: logits[M, V] float32 and targets[M] int64 on its device; losses[M] a
 * DeviceArray there.  The logits stay referenced until the next forward (backward reads them). */
static PyObject *xent_forward_device(XentObject *self, PyObject *lo_, PyObject *to, long long off, long long ignore) {
  static const char *op = "VocabParallelCrossEntropy.forward";
  module_state *st = state_of_type(Py_TYPE(self));
  tp_tensor tx, tt, tl;
  PyObject *kx = NULL, *kt = NULL, *kl = NULL;
  if (device_input(st, lo_, op, "logits", 0, self->device, self->device_id, &tx, &kx) < 0) return NULL;
  if (device_check(&tx, op, "logits", TP_FLOAT32, 2, NULL) < 0) goto fail;
  int64_t M = tx.shape[0], V = tx.shape[1], want[1] = {M};
  if (device_input(st, to, op, "targets", 0, self->device, self->device_id, &tt, &kt) < 0) goto fail;
  if (device_check(&tt, op, "targets", TP_INT64, 1, want) < 0) goto fail;
  if (device_output(st, Py_None, op, self->device, self->device_id, TP_FLOAT32, 1, want, &tl, &kl) < 0) goto fail;
  int64_t valid = 0, vocab = 0;
  tp_status_t s;
  COMM_CALL(self->comm, s,
            ((void)c_, tp_vocab_xent_forward(self->X, &tl, &tx, &tt, off, ignore, &valid, &vocab, NULL)));
  Py_CLEAR(self->logits);
  Py_CLEAR(kt);
  if (s != TP_SUCCESS) {
    Py_DECREF(kl);
    Py_DECREF(kx);
    return layer_error(self->comm, s, "cross-entropy forward", 0);
  }
  self->logits = kx; /* the imported logits (its memory) until the next forward */
  self->M = M;
  self->V = V;
  return Py_BuildValue("NLL", kl, (long long)valid, (long long)vocab);
fail:
  Py_XDECREF(kx);
  Py_XDECREF(kt);
  return NULL;
}

/* backward on a GPU: dloss[M] float32 on the device or None; dlogits a DeviceArray (or out). */
static PyObject *xent_backward_device(XentObject *self, PyObject *dlo, float scale, PyObject *out) {
  static const char *op = "VocabParallelCrossEntropy.backward";
  module_state *st = state_of_type(Py_TYPE(self));
  tp_tensor tl, td;
  PyObject *kl = NULL, *kd = NULL;
  int64_t want[1] = {self->M}, shape[2] = {self->M, self->V};
  if (dlo != Py_None) {
    if (device_input(st, dlo, op, "dloss", 0, self->device, self->device_id, &tl, &kl) < 0) return NULL;
    if (device_check(&tl, op, "dloss", TP_FLOAT32, 1, want) < 0) {
      Py_DECREF(kl);
      return NULL;
    }
  }
  if (device_output(st, out, op, self->device, self->device_id, TP_FLOAT32, 2, shape, &td, &kd) < 0) {
    Py_XDECREF(kl);
    return NULL;
  }
  tp_status_t s;
  COMM_CALL(self->comm, s, ((void)c_, tp_vocab_xent_backward(self->X, &td, kl ? &tl : NULL, scale, NULL)));
  Py_XDECREF(kl);
  if (s != TP_SUCCESS) {
    Py_DECREF(kd);
    return layer_error(self->comm, s, "cross-entropy backward", 1);
  }
  return kd;
}

/* forward(logits[M, V], targets[M], vocab_offset=-1, ignore_index=-100) -> (losses[M], valid, vocab) */
static PyObject *xent_forward(PyObject *o, PyObject *args) {
  XentObject *self = (XentObject *)o;
  PyObject *lo_, *to, *off_o = NULL, *ignore_o = NULL;
  long long off = -1, ignore = -100;
  if (!PyArg_ParseTuple(args, "OO|OO:forward", &lo_, &to, &off_o, &ignore_o)) return NULL;
  if ((off_o && int_arg(off_o, "cross-entropy", "vocab_offset", -1, LLONG_MAX, &off) < 0) ||
      (ignore_o && int_arg(ignore_o, "cross-entropy", "ignore_index", LLONG_MIN, LLONG_MAX, &ignore) < 0))
    return NULL;
  if (!live(self->comm, "forward")) return NULL;
  if (self->device != TP_DEVICE_CPU) return xent_forward_device(self, lo_, to, off, ignore);
  buf_t b;
  if (get_host_buf(lo_, "cross-entropy", "logits", 0, &b) < 0) return NULL;
  if (b.dtype != TP_FLOAT32 || PyArray_NDIM((PyArrayObject *)lo_) != 2) {
    PyErr_SetString(PyExc_TypeError, "cross-entropy: logits must be a 2-D float32 array (rows, shard width)");
    return NULL;
  }
  int64_t M = PyArray_DIM((PyArrayObject *)lo_, 0), V = PyArray_DIM((PyArrayObject *)lo_, 1), Mt;
  if (tokens_arg(to, "cross-entropy", "targets", &Mt) < 0) return NULL;
  if (Mt != M) {
    PyErr_Format(PyExc_ValueError, "cross-entropy: %lld targets for %lld rows of logits", (long long)Mt, (long long)M);
    return NULL;
  }
  npy_intp d[1] = {(npy_intp)M};
  PyObject *losses = PyArray_SimpleNew(1, d, NPY_FLOAT32);
  if (!losses) return NULL;
  float *lp = PyArray_DATA((PyArrayObject *)losses);
  const float *xp = b.data;
  const int64_t *tp = PyArray_DATA((PyArrayObject *)to);
  int64_t valid = 0, vocab = 0;
  tp_status_t s;
  tp_tensor tl = tp_tensor_1d(lp, TP_FLOAT32, M), tx = tp_tensor_2d((void *)xp, TP_FLOAT32, M, V),
            tt = tp_tensor_1d((void *)tp, TP_INT64, M);
  COMM_CALL(self->comm, s,
            ((void)c_, tp_vocab_xent_forward(self->X, &tl, &tx, &tt, off, ignore, &valid, &vocab, NULL)));
  Py_CLEAR(self->logits);
  if (s != TP_SUCCESS) {
    Py_DECREF(losses);
    return layer_error(self->comm, s, "cross-entropy forward", 0);
  }
  Py_INCREF(lo_);
  self->logits = lo_;
  self->M = M;
  self->V = V;
  return Py_BuildValue("NLL", losses, (long long)valid, (long long)vocab);
}

/* backward(dloss=None, scale=1.0, out=None) -> dlogits[M, V] */
static PyObject *xent_backward(PyObject *o, PyObject *args) {
  XentObject *self = (XentObject *)o;
  PyObject *dlo = Py_None, *out = Py_None;
  float scale = 1.0f;
  if (!PyArg_ParseTuple(args, "|OfO:backward", &dlo, &scale, &out)) return NULL;
  if (!live(self->comm, "backward")) return NULL;
  if (!self->logits) {
    PyErr_SetString(PyExc_RuntimeError, "cross-entropy backward: called before forward");
    return NULL;
  }
  if (self->device != TP_DEVICE_CPU) return xent_backward_device(self, dlo, scale, out);
  const float *dl = NULL;
  if (dlo != Py_None) {
    buf_t b;
    if (get_host_buf(dlo, "cross-entropy backward", "dloss", 0, &b) < 0) return NULL;
    if (b.dtype != TP_FLOAT32 || (int64_t)b.count != self->M) {
      PyErr_Format(PyExc_ValueError, "cross-entropy backward: dloss must be float32 with one entry per row (%lld)",
                   (long long)self->M);
      return NULL;
    }
    dl = b.data;
  }
  PyObject *d = layer_output(out, "cross-entropy backward", self->M, self->V);
  if (!d) return NULL;
  float *dp = PyArray_DATA((PyArrayObject *)d);
  tp_status_t s;
  tp_tensor td = tp_tensor_2d(dp, TP_FLOAT32, self->M, self->V), tl = tp_tensor_1d((void *)dl, TP_FLOAT32, self->M);
  COMM_CALL(self->comm, s, ((void)c_, tp_vocab_xent_backward(self->X, &td, dl ? &tl : NULL, scale, NULL)));
  if (s != TP_SUCCESS) {
    Py_DECREF(d);
    return layer_error(self->comm, s, "cross-entropy backward", 1);
  }
  return d;
}

static PyObject *xent_memory(PyObject *o, PyObject *unused) {
  XentObject *self = (XentObject *)o;
  tp_layer_memory_t m;
  m.size = sizeof m;
  return layer_memory(o, tp_vocab_xent_memory(self->X, &m), &m, "memory");
}

static PyMethodDef xent_methods[] = {
    {"memory", xent_memory, METH_NOARGS,
     "memory() -> {device, params, grads, workspace, cache, cache_used, comm}: bytes this rank's layer holds"},
    {"forward", xent_forward, METH_VARARGS,
     "forward(logits[M, V], targets[M] int64, vocab_offset=-1, ignore_index=-100) -> (losses[M], valid, vocab)"},
    {"backward", xent_backward, METH_VARARGS, "backward(dloss=None, scale=1.0, out=None) -> dlogits[M, V]"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot xent_slots[] = {
    {Py_tp_new, xent_new},
    {Py_tp_dealloc, xent_dealloc},
    {Py_tp_methods, xent_methods},
    {Py_tp_doc, "VocabCrossEntropy(comm): use tpcore.VocabParallelCrossEntropy"},
    {0, NULL},
};

PyType_Spec xent_spec = {
    .name = "tpcore._C.VocabCrossEntropy",
    .basicsize = sizeof(XentObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = xent_slots,
};
