/*
 * block.c: the TransformerBlock type (tpcore._C.TransformerBlock): norm,
 * tensor-parallel attention (heads split across ranks, an optional KV cache) and
 * the parallel MLP, forward and backward; its parameters as views.
 */
#include "ext.h"

typedef struct {
  PyObject_HEAD tp_block_t K;
  CommObject *comm;
  int64_t C, D;
  tp_device_t device; /* where its parameters, KV cache and tensors live */
  int device_id;
} BlockObject;

/* o: None (*out = NULL) or a sequence of n finite floats, copied into *out (PyMem_Malloc). */
static int float_vector(PyObject *o, const char *who, const char *name, int64_t n, float **out) {
  *out = NULL;
  if (o == Py_None) return 0;
  PyObject *seq = PySequence_Fast(o, "");
  if (!seq) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be None or a sequence of %lld floats, got %s", who, name, (long long)n,
                 Py_TYPE(o)->tp_name);
    return -1;
  }
  if (PySequence_Fast_GET_SIZE(seq) != n) {
    PyErr_Format(PyExc_ValueError, "%s: %s must hold head_dim / 2 = %lld values, got %zd", who, name, (long long)n,
                 PySequence_Fast_GET_SIZE(seq));
    Py_DECREF(seq);
    return -1;
  }
  float *v = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
  if (!v) {
    Py_DECREF(seq);
    PyErr_NoMemory();
    return -1;
  }
  for (int64_t i = 0; i < n; i++) {
    double d = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
    if (d == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "%s: %s[%lld] is not a number", who, name, (long long)i);
      PyMem_Free(v);
      Py_DECREF(seq);
      return -1;
    }
    v[i] = (float)d;
  }
  Py_DECREF(seq);
  *out = v;
  return 0;
}

static PyObject *blk_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"comm",          "hidden",         "heads",      "kv_heads",       "head_dim",
                           "ffn_hidden",    "norm",           "eps",        "activation",     "pre_norm",
                           "bias",          "causal",         "rope_theta", "head_partition", "ffn_partition",
                           "seed",          "attention_only", "device",     "weight_dtype",   "bias_parts",
                           "qk_norm",       "post_norms",     "attn_scale", "attn_softcap",   "sliding_window",
                           "rope_inv_freq", "rope_factor",    NULL};
  PyObject *commo, *hpart = Py_None, *fpart = Py_None, *dim_o[5], *seed_o = NULL, *dev_o = Py_None, *wdt_o = Py_None;
  long long dims[5]; /* hidden, heads, kv_heads (0: = heads), head_dim, ffn_hidden */
  static const char *dim_names[5] = {"hidden", "heads", "kv_heads", "head_dim", "ffn_hidden"};
  const char *norm = "layernorm", *act = "gelu";
  float eps = 1e-5f, theta = 0.0f;
  int pre = 1, bias = 1, causal = 1, attn_only = 0, bias_parts = 0, qk_norm = 0, post_norms = 0;
  float attn_scale = 0.0f, softcap = 0.0f, rope_factor = 0.0f;
  PyObject *window_o = NULL, *freq_o = Py_None;
  uint64_t seed = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|sfspppfOOOpOOippffOOf:TransformerBlock", kwlist, &commo, &dim_o[0],
                                   &dim_o[1], &dim_o[2], &dim_o[3], &dim_o[4], &norm, &eps, &act, &pre, &bias, &causal,
                                   &theta, &hpart, &fpart, &seed_o, &attn_only, &dev_o, &wdt_o, &bias_parts, &qk_norm,
                                   &post_norms, &attn_scale, &softcap, &window_o, &freq_o, &rope_factor))
    return NULL;
  long long window = 0;
  if (window_o && int_arg(window_o, "TransformerBlock", "sliding_window", 0, LLONG_MAX, &window) < 0) return NULL;
  for (int i = 0; i < 5; i++)
    if (int_arg(dim_o[i], "TransformerBlock", dim_names[i], i == 2 || (i == 4 && attn_only) ? 0 : 1, DIM_MAX,
                &dims[i]) < 0)
      return NULL;
  if (seed_o && seed_arg(seed_o, "TransformerBlock", &seed) < 0) return NULL;
  long long C = dims[0], H = dims[1], Hk = dims[2], D = dims[3], F = dims[4];
  module_state *st = state_of_type(type);
  CommObject *co = layer_comm(st, commo, "TransformerBlock");
  if (!co) return NULL;
  tp_block_config_t cfg = TP_BLOCK_CONFIG_INITIALIZER;
  cfg.hidden = C, cfg.heads = H, cfg.kv_heads = Hk, cfg.head_dim = D, cfg.ffn_hidden = F;
  if (strcmp(norm, "layernorm") == 0) cfg.norm = TP_NORM_LAYER;
  else if (strcmp(norm, "rmsnorm") == 0) cfg.norm = TP_NORM_RMS;
  else {
    PyErr_Format(PyExc_ValueError, "TransformerBlock: norm must be 'layernorm' or 'rmsnorm', got '%s'", norm);
    return NULL;
  }
  if (parse_act(act, &cfg.activation) < 0) return NULL;
  cfg.eps = eps, cfg.pre_norm = pre, cfg.bias = bias, cfg.causal = causal, cfg.rope_theta = theta, cfg.seed = seed;
  cfg.attention_only = attn_only;
  cfg.bias_parts = bias_parts, cfg.qk_norm = qk_norm, cfg.post_norms = post_norms, cfg.attn_scale = attn_scale;
  cfg.attn_softcap = softcap, cfg.sliding_window = window, cfg.rope_factor = rope_factor;
  float *freq = NULL;
  if (float_vector(freq_o, "TransformerBlock", "rope_inv_freq", D / 2, &freq) < 0) return NULL;
  cfg.rope_inv_freq = freq;
  if (parse_device(dev_o, attn_only ? "ParallelAttention" : "TransformerBlock", &cfg.device, &cfg.device_id) < 0) {
    PyMem_Free(freq);
    return NULL;
  }
  const char *bname = attn_only ? "ParallelAttention" : "TransformerBlock";
  if (wdt_o && PyTuple_Check(wdt_o)) { /* (qkv, out, fc1, fc2): a GGUF file's mix of formats */
    if (PyTuple_GET_SIZE(wdt_o) != 4) {
      PyErr_Format(PyExc_ValueError, "%s: weight_dtype as a tuple must name 4 dtypes (qkv, out, fc1, fc2), got %zd",
                   bname, PyTuple_GET_SIZE(wdt_o));
      {
        PyMem_Free(freq);
        return NULL;
      }
    }
    cfg.weight_dtypes_set = 1;
    for (int i = 0; i < 4; i++)
      if (parse_weight_dtype(PyTuple_GET_ITEM(wdt_o, i), bname, &cfg.weight_dtypes[i]) < 0) {
        PyMem_Free(freq);
        return NULL;
      }
    cfg.weight_dtype = cfg.weight_dtypes[0];
  } else if (parse_weight_dtype(wdt_o, bname, &cfg.weight_dtype) < 0) {
    {
      PyMem_Free(freq);
      return NULL;
    }
  }
  int size;
  tp_comm_size(co->comm, &size);
  int64_t *hs = NULL, *fs = NULL;
  if (parse_partition(hpart, size, &hs) < 0 || parse_partition(fpart, size, &fs) < 0) {
    PyMem_Free(hs);
    {
      PyMem_Free(freq);
      return NULL;
    }
  }
  cfg.head_partition = hs, cfg.ffn_partition = fs;
  BlockObject *self = (BlockObject *)type->tp_alloc(type, 0);
  if (!self) {
    PyMem_Free(hs), PyMem_Free(fs);
    {
      PyMem_Free(freq);
      return NULL;
    }
  }
  tp_status_t s;
  COMM_CALL(co, s, tp_block_create(&self->K, c_, &cfg));
  PyMem_Free(hs), PyMem_Free(fs), PyMem_Free(freq);
  if (!layer_made((PyObject *)self, &self->comm, co, s, st, "TransformerBlock")) {
    PyMem_Free(freq);
    return NULL;
  }
  self->C = C, self->D = D;
  self->device = cfg.device;
  self->device_id = cfg.device_id;
  return (PyObject *)self;
}

static void blk_dealloc(PyObject *o) {
  BlockObject *self = (BlockObject *)o;
  tp_block_destroy(self->K);
  layer_free(o, self->comm);
}

/* block_table: a C-contiguous int64 array of shape (B, cols), cols >= 1, into bt. */
static int block_table_arg(PyObject *t, long long B, tp_block_batch_t *bt) {
  buf_t b;
  if (get_host_buf(t, "block forward", "block_table", 0, &b) < 0) return -1;
  if (b.dtype != TP_INT64 || PyArray_NDIM((PyArrayObject *)t) != 2) {
    PyErr_Format(PyExc_TypeError, "block forward: block_table must be a 2-D int64 array of shape (B, cols)");
    return -1;
  }
  npy_intp *d = PyArray_DIMS((PyArrayObject *)t);
  if ((long long)d[0] != B || d[1] < 1) {
    PyErr_Format(PyExc_ValueError, "block forward: block_table must have shape (B = %lld, cols >= 1), got (%lld, %lld)",
                 B, (long long)d[0], (long long)d[1]);
    return -1;
  }
  bt->block_table = b.data, bt->block_cols = (int64_t)d[1];
  return 0;
}

/* forward(x[B*T, C], B, T, pos0=None, key_mask=None, use_cache=False, need_backward=False, out=None,
 *         slots=None, block_table=None) */
static PyObject *blk_forward(PyObject *o, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"x",   "B",     "T",           "pos0", "key_mask", "use_cache", "need_backward",
                           "out", "slots", "block_table", NULL};
  BlockObject *self = (BlockObject *)o;
  PyObject *x, *po = Py_None, *mo = Py_None, *out = Py_None, *so = Py_None, *to = Py_None, *B_o, *T_o;
  long long B, T, BT;
  int use_cache = 0, need_backward = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OOppOOO:forward", kwlist, &x, &B_o, &T_o, &po, &mo, &use_cache,
                                   &need_backward, &out, &so, &to))
    return NULL;
  if (int_arg(B_o, "block forward", "B", 0, LLONG_MAX, &B) < 0 ||
      int_arg(T_o, "block forward", "T", 0, LLONG_MAX, &T) < 0)
    return NULL;
  if (!live(self->comm, "forward")) return NULL;
  int64_t M;
  module_state *st = state_of_type(Py_TYPE(o));
  tp_tensor tx, ty;
  PyObject *kx = NULL, *ky = NULL; /* a GPU block: x imported, y a DeviceArray (or out) */
  int gpu = self->device != TP_DEVICE_CPU;
  if (gpu) {
    int64_t want[2] = {-1, self->C};
    if (device_input(st, x, "TransformerBlock.forward", "x", 0, self->device, self->device_id, &tx, &kx) < 0)
      return NULL;
    if (device_check(&tx, "TransformerBlock.forward", "x", TP_FLOAT32, 2, want) < 0) {
      Py_DECREF(kx);
      return NULL;
    }
    M = tx.shape[0];
  } else if (matrix_arg(x, "block forward", "x", self->C, &M) < 0) return NULL;
  PyObject *res = NULL; /* from here on, failures go to done (which drops kx) */
#define BLK_FAIL goto done
  if (__builtin_mul_overflow(B, T, &BT) || M != BT) {
    PyErr_Format(PyExc_ValueError, "block forward: x has %lld rows, not B * T = %lld x %lld", (long long)M,
                 (long long)B, (long long)T);
    BLK_FAIL;
  }
  tp_block_batch_t bt = {B, T, NULL, NULL, use_cache, need_backward, NULL, NULL, 0};
  if (to != Py_None && block_table_arg(to, B, &bt) < 0) BLK_FAIL;
  if (po != Py_None) {
    int64_t n;
    if (tokens_arg(po, "block forward", "pos0", &n) < 0) BLK_FAIL;
    if (n != B) {
      PyErr_Format(PyExc_ValueError, "block forward: pos0 needs %lld entries, got %lld", (long long)B, (long long)n);
      BLK_FAIL;
    }
    bt.pos0 = PyArray_DATA((PyArrayObject *)po);
  }
  if (so != Py_None) {
    int64_t n;
    if (tokens_arg(so, "block forward", "slots", &n) < 0) BLK_FAIL;
    if (n != B) {
      PyErr_Format(PyExc_ValueError, "block forward: slots needs %lld entries, got %lld", (long long)B, (long long)n);
      BLK_FAIL;
    }
    bt.slots = PyArray_DATA((PyArrayObject *)so);
  }
  if (mo != Py_None) {
    buf_t b;
    if (get_host_buf(mo, "block forward", "key_mask", 0, &b) < 0) BLK_FAIL;
    if (b.dtype != TP_UINT8 || (int64_t)b.count != M) {
      PyErr_Format(PyExc_ValueError, "block forward: key_mask must be uint8 with B * T = %lld entries", (long long)M);
      BLK_FAIL;
    }
    bt.key_mask = b.data;
  }
  PyObject *y;
  if (gpu) {
    int64_t shape[2] = {M, self->C};
    if (device_output(st, out, "TransformerBlock.forward", self->device, self->device_id, TP_FLOAT32, 2, shape, &ty,
                      &ky) < 0)
      BLK_FAIL;
    y = ky;
  } else {
    y = layer_output(out, "block forward", M, self->C);
    if (!y) BLK_FAIL;
    tx = tp_tensor_2d(PyArray_DATA((PyArrayObject *)x), TP_FLOAT32, M, self->C);
    ty = tp_tensor_2d(PyArray_DATA((PyArrayObject *)y), TP_FLOAT32, M, self->C);
  }
  tp_status_t s;
  COMM_CALL(self->comm, s, ((void)c_, tp_block_forward(self->K, &ty, &tx, &bt, NULL)));
  if (s != TP_SUCCESS) {
    Py_DECREF(y);
    if (s == TP_ERR_INVALID_USAGE) PyErr_SetString(PyExc_ValueError, tp_last_error());
    else layer_error(self->comm, s, "block forward", 0);
    BLK_FAIL;
  }
  res = y;
done:
  Py_XDECREF(kx);
  return res;
#undef BLK_FAIL
}

static tp_status_t blk_bwd(void *k, const tp_tensor *dx, const tp_tensor *dy) {
  return tp_block_backward((tp_block_t)k, dx, dy, NULL);
}

static PyObject *blk_backward(PyObject *o, PyObject *args) {
  BlockObject *self = (BlockObject *)o;
  PyObject *dy, *out = Py_None;
  if (!PyArg_ParseTuple(args, "O|O:backward", &dy, &out)) return NULL;
  if (!live(self->comm, "backward")) return NULL;
  if (self->device != TP_DEVICE_CPU)
    return device_layer_call(state_of_type(Py_TYPE(o)), self->comm, "TransformerBlock.backward", "dy", self->device,
                             self->device_id, self->C, self->C, dy, out, blk_bwd, self->K, 1);
  int64_t M;
  if (matrix_arg(dy, "block backward", "dy", self->C, &M) < 0) return NULL;
  PyObject *dx = layer_output(out, "block backward", M, self->C);
  if (!dx) return NULL;
  const float *dp = PyArray_DATA((PyArrayObject *)dy);
  float *xp = PyArray_DATA((PyArrayObject *)dx);
  tp_status_t s;
  tp_tensor tdy = tp_tensor_2d((void *)dp, TP_FLOAT32, M, self->C), tdx = tp_tensor_2d(xp, TP_FLOAT32, M, self->C);
  COMM_CALL(self->comm, s, ((void)c_, tp_block_backward(self->K, &tdx, &tdy, NULL)));
  if (s != TP_SUCCESS) {
    Py_DECREF(dx);
    return layer_error(self->comm, s, "block backward", 1);
  }
  return dx;
}

static PyObject *blk_cache(PyObject *o, PyObject *args) {
  BlockObject *self = (BlockObject *)o;
  PyObject *batch_o, *len_o;
  long long batch, len;
  if (!PyArg_ParseTuple(args, "OO:cache", &batch_o, &len_o)) return NULL;
  if (int_arg(batch_o, "TransformerBlock.cache", "batch", 1, DIM_MAX, &batch) < 0 ||
      int_arg(len_o, "TransformerBlock.cache", "max_len", 1, DIM_MAX, &len) < 0)
    return NULL;
  tp_status_t s = tp_block_cache(self->K, batch, len);
  if (s != TP_SUCCESS) return raise_status(cstate((PyObject *)self->comm), s, "cache");
  Py_RETURN_NONE;
}

/* set_rope(inv_freq: None or head_dim / 2 floats, factor: float) */
static PyObject *blk_cache_paged(PyObject *o, PyObject *args) {
  BlockObject *self = (BlockObject *)o;
  PyObject *n_o, *bs_o;
  long long n, bs;
  if (!PyArg_ParseTuple(args, "OO:cache_paged", &n_o, &bs_o)) return NULL;
  if (int_arg(n_o, "TransformerBlock.cache_paged", "num_blocks", 1, DIM_MAX, &n) < 0 ||
      int_arg(bs_o, "TransformerBlock.cache_paged", "block_size", 1, DIM_MAX, &bs) < 0)
    return NULL;
  tp_status_t s = tp_block_cache_paged(self->K, n, bs);
  if (s != TP_SUCCESS) return raise_status(cstate((PyObject *)self->comm), s, "cache_paged");
  Py_RETURN_NONE;
}

static PyObject *blk_set_rope(PyObject *o, PyObject *args) {
  BlockObject *self = (BlockObject *)o;
  PyObject *freq_o;
  float factor = 1.0f, *freq = NULL;
  if (!PyArg_ParseTuple(args, "Of:set_rope", &freq_o, &factor)) return NULL;
  if (float_vector(freq_o, "TransformerBlock.set_rope", "inv_freq", self->D / 2, &freq) < 0) return NULL;
  tp_status_t s = tp_block_set_rope(self->K, freq, factor);
  PyMem_Free(freq);
  if (s != TP_SUCCESS) return raise_status(cstate((PyObject *)self->comm), s, "set_rope");
  Py_RETURN_NONE;
}

/* {name: (param view, grad view)} of this rank's shard */
static PyObject *blk_params(PyObject *o, PyObject *unused) {
  BlockObject *self = (BlockObject *)o;
  module_state *st = state_of_type(Py_TYPE(o));
  tp_param_t p[32];
  int n = tp_block_params(self->K, p, 32);
  PyObject *d = PyDict_New();
  if (!d) return NULL;
  for (int i = 0; i < n && i < 32; i++) {
    int nd = p[i].ndim;
    PyObject *a, *g;
    if (self->device != TP_DEVICE_CPU) { /* DeviceArray views of the GPU's memory */
      a = device_param_view_dt(st, o, p[i].data, p[i].dtype, nd, p[i].rows, p[i].cols, self->device, self->device_id);
      g = a ? device_param_view(st, o, p[i].grad, nd, p[i].rows, p[i].cols, self->device, self->device_id) : NULL;
    } else {
      a = owned_view_dt(o, p[i].data, p[i].dtype, nd, p[i].rows, p[i].cols);
      g = owned_view(o, p[i].grad, nd, p[i].rows, p[i].cols);
    }
    PyObject *t = (a && g) ? PyTuple_Pack(2, a, g) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(g);
    if (!t || PyDict_SetItemString(d, p[i].name, t) < 0) {
      Py_XDECREF(t);
      Py_DECREF(d);
      return NULL;
    }
    Py_DECREF(t);
  }
  return d;
}

static PyObject *blk_info(PyObject *o, void *unused) {
  tp_block_info_t i;
  tp_block_info(((BlockObject *)o)->K, &i);
  return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L,s:O,s:L}", "q0", (long long)i.q0, "nq", (long long)i.nq, "k0",
                       (long long)i.k0, "nk", (long long)i.nk, "cache_batch", (long long)i.cache_batch, "cache_len",
                       (long long)i.cache_len, "kv_replicated", i.kv_replicated ? Py_True : Py_False,
                       "cache_block_size", (long long)i.cache_block_size);
}

static PyObject *blk_device(PyObject *o, void *unused) {
  BlockObject *self = (BlockObject *)o;
  return PyUnicode_FromFormat("%s:%d", tp_device_name(self->device), self->device_id);
}

/* share_workspace(other): this block's inference forwards use other's shared workspace (made
 * there when it has none; other may be this block) */
static PyObject *blk_share_workspace(PyObject *o, PyObject *arg) {
  BlockObject *self = (BlockObject *)o;
  if (!PyObject_TypeCheck(arg, Py_TYPE(o))) {
    PyErr_Format(PyExc_TypeError, "share_workspace: expected a TransformerBlock, got %s", Py_TYPE(arg)->tp_name);
    return NULL;
  }
  BlockObject *other = (BlockObject *)arg;
  module_state *st = cstate((PyObject *)self->comm);
  tp_workspace_t w = tp_block_get_workspace(other->K);
  tp_status_t s;
  if (!w) {
    if ((s = tp_workspace_create(&w, other->device, other->device_id)) != TP_SUCCESS)
      return raise_status(st, s, "share_workspace");
    s = tp_block_set_workspace(other->K, w);
    tp_workspace_destroy(w); /* the block holds it now */
    if (s != TP_SUCCESS) return raise_status(st, s, "share_workspace");
  }
  if (self != other && (s = tp_block_set_workspace(self->K, w)) != TP_SUCCESS)
    return raise_status(st, s, "share_workspace");
  Py_RETURN_NONE;
}

/* (activation bytes, communication bytes) of the shared workspace ((0, 0): none) */
static PyObject *blk_workspace_bytes(PyObject *o, void *unused) {
  tp_workspace_t w = tp_block_get_workspace(((BlockObject *)o)->K);
  tp_layer_memory_t m;
  memset(&m, 0, sizeof m);
  m.size = sizeof m;
  if (w) tp_workspace_memory(w, &m);
  return Py_BuildValue("(nn)", (Py_ssize_t)m.workspace, (Py_ssize_t)m.comm);
}

static PyObject *blk_workspace_id(PyObject *o, void *unused) {
  return PyLong_FromVoidPtr(tp_block_get_workspace(((BlockObject *)o)->K));
}

static PyGetSetDef blk_getset[] = {
    {"shared_workspace_bytes", blk_workspace_bytes, NULL,
     "(activation, communication) bytes of the shared inference workspace", NULL},
    {"shared_workspace_id", blk_workspace_id, NULL, "which shared workspace it uses (0: none; equal: the same one)",
     NULL},
    {"info", blk_info, NULL, "this rank's heads and the KV cache's capacity", NULL},
    {"device", blk_device, NULL, "'cpu:0' or 'cuda:N'", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* The block's gradients (QKV, norms, output projection, MLP), zeroed: idempotent. */
static PyObject *blk_alloc_grads(PyObject *o, PyObject *unused) {
  BlockObject *self = (BlockObject *)o;
  tp_status_t s = tp_block_alloc_grads(self->K);
  if (s != TP_SUCCESS) return raise_status(cstate(o), s, "alloc_grads"); /* local: a closed comm is no matter */
  Py_RETURN_NONE;
}

static PyObject *blk_memory(PyObject *o, PyObject *unused) {
  BlockObject *self = (BlockObject *)o;
  tp_layer_memory_t m;
  m.size = sizeof m;
  return layer_memory(o, tp_block_memory(self->K, &m), &m, "memory");
}

static PyMethodDef blk_methods[] = {
    {"alloc_grads", blk_alloc_grads, METH_NOARGS, "alloc_grads(): allocate every gradient (zeroed) now; idempotent"},
    {"memory", blk_memory, METH_NOARGS,
     "memory() -> {device, params, grads, workspace, cache, cache_used, comm}: bytes this rank's layer holds"},
    {"forward", (PyCFunction)(void (*)(void))blk_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(x[B*T, C], B, T, pos0=None, key_mask=None, use_cache=False, need_backward=False, out=None, slots=None, "
     "block_table=None) -> y"},
    {"backward", blk_backward, METH_VARARGS, "backward(dy[B*T, C], out=None) -> dx; accumulates the gradients"},
    {"cache", blk_cache, METH_VARARGS, "cache(batch, max_len): (re)allocate the KV cache"},
    {"cache_paged", blk_cache_paged, METH_VARARGS,
     "cache_paged(num_blocks, block_size): (re)allocate the KV cache as a pool of blocks (forwards with use_cache "
     "then take block_table)"},
    {"set_rope", blk_set_rope, METH_VARARGS,
     "set_rope(inv_freq, factor): the rotary frequencies (None: rope_theta's) and cos/sin factor from now on"},
    {"params", blk_params, METH_NOARGS,
     "{name: (param, grad)} views of this rank's shard (grad None until "
     "alloc_grads / backward, and for a quantized weight)"},
    {"share_workspace", blk_share_workspace, METH_O,
     "share_workspace(other): inference forwards carve other's shared workspace (made when it has none)"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot blk_slots[] = {
    {Py_tp_new, blk_new},
    {Py_tp_dealloc, blk_dealloc},
    {Py_tp_methods, blk_methods},
    {Py_tp_getset, blk_getset},
    {Py_tp_doc,
     "TransformerBlock(comm, hidden, heads, kv_heads, head_dim, ffn_hidden, ...): use tpcore.TransformerBlock"},
    {0, NULL},
};

PyType_Spec blk_spec = {
    .name = "tpcore._C.TransformerBlock",
    .basicsize = sizeof(BlockObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = blk_slots,
};
