/*
 * devkernels.c: the tensor kernels a model needs outside its layers, on any device, as
 * module functions with a "d_" prefix (tpcore._C.d_norm_forward, ...).  They take
 * tpcore.DeviceArrays or any DLPack tensors (NumPy arrays included: the CPU), all on the
 * device of the first tensor (another device is a TypeError naming the call and the
 * argument); new outputs are DeviceArrays there.  A GPU model (python/tpcore/models.py)
 * keeps its final norm, position and type embeddings, the tied head's GEMMs and the
 * optimizer step on its GPU with these, so that training and decoding do not go through
 * the host.  Each runs through the public tensor API (argument checks there) with the
 * GIL released, on the device's default stream (NULL; the legacy stream on CUDA, as the
 * GPU layers use).
 */
#include "ext.h"

#define DK_MAX_ARGS 12

typedef struct {
  module_state *st;
  const char *op;
  tp_device_t dev;
  int id, have;
  PyObject *keep[DK_MAX_ARGS];
  int nkeep;
} dk_ctx;

static void dk_release(dk_ctx *c) {
  for (int i = 0; i < c->nkeep; i++) Py_DECREF(c->keep[i]);
  c->nkeep = 0;
}

/* o as a tensor on the call's device (the first tensor fixes it); optional: None gives
 * *tp = NULL.  0 / -1. */
static int dk_in(dk_ctx *c, PyObject *o, const char *name, int writable, int optional, tp_tensor *t,
                 const tp_tensor **tp) {
  if (optional && o == Py_None) {
    if (tp) *tp = NULL;
    return 0;
  }
  if (c->nkeep >= DK_MAX_ARGS) {
    PyErr_Format(PyExc_SystemError, "%s: too many arguments", c->op);
    return -1;
  }
  PyObject *keep;
  if (!c->have) { /* the first tensor: any device */
    PyObject *args = PyTuple_Pack(1, o);
    PyObject *kw = Py_BuildValue("{s:i,s:s,s:s}", "writable", writable, "op", c->op, "name", name);
    PyObject *fn = args && kw ? PyObject_GetAttrString(PyType_GetModule(c->st->DeviceArrayType), "from_dlpack") : NULL;
    keep = fn ? PyObject_Call(fn, args, kw) : NULL;
    Py_XDECREF(fn);
    Py_XDECREF(args);
    Py_XDECREF(kw);
    if (!keep) return -1;
    const tp_tensor *d = devarray_tensor(c->st, keep);
    if (!d) {
      Py_DECREF(keep);
      return -1;
    }
    *t = *d;
    c->dev = t->device, c->id = t->device_id, c->have = 1;
  } else if (device_input(c->st, o, c->op, name, writable, c->dev, c->id, t, &keep) < 0) {
    return -1;
  }
  c->keep[c->nkeep++] = keep;
  if (tp) *tp = t;
  return 0;
}

/* A new DeviceArray on the call's device: *t its tensor; the array is returned (new ref). */
static PyObject *dk_new(dk_ctx *c, tp_dtype_t dt, int ndim, const int64_t *shape, tp_tensor *t) {
  PyObject *a = devarray_empty(c->st, c->dev, c->id, dt, ndim, shape);
  if (a) *t = *devarray_tensor(c->st, a);
  return a;
}

static PyObject *dk_fail(dk_ctx *c, tp_status_t s, PyObject *result) {
  dk_release(c);
  if (s == TP_SUCCESS) return result;
  Py_XDECREF(result);
  return raise_status(c->st, s, c->op);
}

#define DK_CTX(name, mod) dk_ctx c = {(module_state *)PyModule_GetState(mod), name, TP_DEVICE_CPU, 0, 0, {0}, 0}
#define DK_RUN(s, expr)          \
  do {                           \
    Py_BEGIN_ALLOW_THREADS       \
    s = (expr);                  \
    Py_END_ALLOW_THREADS         \
  } while (0)

static int norm_kind_of(const char *kind, const char *op) {
  if (!strcmp(kind, "layernorm")) return 0;
  if (!strcmp(kind, "rmsnorm")) return 1;
  PyErr_Format(PyExc_ValueError, "%s: kind must be 'layernorm' or 'rmsnorm', got '%s'", op, kind);
  return -1;
}

/* d_norm_forward(kind, x[M, C], w[C], b[C] | None, eps) -> (y, mean | None, rstd) */
static PyObject *d_norm_forward(PyObject *mod, PyObject *args) {
  const char *kind;
  PyObject *xo, *wo, *bo;
  float eps;
  if (!PyArg_ParseTuple(args, "sOOOf:d_norm_forward", &kind, &xo, &wo, &bo, &eps)) return NULL;
  int rms = norm_kind_of(kind, "d_norm_forward");
  if (rms < 0) return NULL;
  DK_CTX("d_norm_forward", mod);
  tp_tensor x, w, b, y, mean, rstd;
  const tp_tensor *bp;
  if (dk_in(&c, xo, "x", 0, 0, &x, NULL) < 0 || dk_in(&c, wo, "w", 0, 0, &w, NULL) < 0 ||
      dk_in(&c, bo, "b", 0, 1, &b, &bp) < 0)
    return dk_fail(&c, TP_SUCCESS, NULL);
  if (x.ndim != 2) {
    PyErr_Format(PyExc_ValueError, "d_norm_forward: x must be 2-D (rows, C), got %d dimensions", x.ndim);
    return dk_fail(&c, TP_SUCCESS, NULL);
  }
  int64_t M = x.shape[0];
  PyObject *yo = dk_new(&c, TP_FLOAT32, 2, x.shape, &y), *ro = yo ? dk_new(&c, TP_FLOAT32, 1, &M, &rstd) : NULL;
  PyObject *mo = ro && !rms ? dk_new(&c, TP_FLOAT32, 1, &M, &mean) : NULL;
  if (!ro || (!rms && !mo)) {
    Py_XDECREF(yo);
    Py_XDECREF(ro);
    return dk_fail(&c, TP_SUCCESS, NULL);
  }
  tp_status_t s;
  if (rms) DK_RUN(s, tp_rmsnorm_forward(NULL, &y, &rstd, &x, &w, eps));
  else DK_RUN(s, tp_layernorm_forward(NULL, &y, &mean, &rstd, &x, &w, bp, eps));
  PyObject *res = s == TP_SUCCESS ? Py_BuildValue("(NNN)", yo, mo ? mo : Py_NewRef(Py_None), ro) : NULL;
  if (s != TP_SUCCESS) {
    Py_DECREF(yo);
    Py_XDECREF(mo);
    Py_DECREF(ro);
  }
  return dk_fail(&c, s, res);
}

/* d_norm_backward(kind, dy, x, w, mean | None, rstd, dw, db | None) -> dx (dw, db +=) */
static PyObject *d_norm_backward(PyObject *mod, PyObject *args) {
  const char *kind;
  PyObject *dyo, *xo, *wo, *mo, *ro, *dwo, *dbo;
  if (!PyArg_ParseTuple(args, "sOOOOOOO:d_norm_backward", &kind, &dyo, &xo, &wo, &mo, &ro, &dwo, &dbo)) return NULL;
  int rms = norm_kind_of(kind, "d_norm_backward");
  if (rms < 0) return NULL;
  DK_CTX("d_norm_backward", mod);
  tp_tensor dy, x, w, mean, rstd, dw, db, dx;
  const tp_tensor *mp, *dbp;
  if (dk_in(&c, dyo, "dy", 0, 0, &dy, NULL) < 0 || dk_in(&c, xo, "x", 0, 0, &x, NULL) < 0 ||
      dk_in(&c, wo, "w", 0, 0, &w, NULL) < 0 || dk_in(&c, mo, "mean", 0, 1, &mean, &mp) < 0 ||
      dk_in(&c, ro, "rstd", 0, 0, &rstd, NULL) < 0 || dk_in(&c, dwo, "dw", 1, 0, &dw, NULL) < 0 ||
      dk_in(&c, dbo, "db", 1, 1, &db, &dbp) < 0)
    return dk_fail(&c, TP_SUCCESS, NULL);
  if (!rms && !mp) {
    PyErr_SetString(PyExc_ValueError, "d_norm_backward: layernorm needs the mean forward kept");
    return dk_fail(&c, TP_SUCCESS, NULL);
  }
  PyObject *dxo = dk_new(&c, TP_FLOAT32, x.ndim, x.shape, &dx);
  if (!dxo) return dk_fail(&c, TP_SUCCESS, NULL);
  tp_status_t s;
  if (rms) DK_RUN(s, tp_rmsnorm_backward(NULL, &dx, &dw, &dy, &x, &w, &rstd));
  else DK_RUN(s, tp_layernorm_backward(NULL, &dx, &dw, dbp, &dy, &x, &w, mp, &rstd));
  return dk_fail(&c, s, dxo);
}

/* A quantized weight's raw rows (a uint8 [N, row_bytes] tensor) as the kernels' logical [N, K]
 * view in format fmt (None: w as it is). */
static int dk_weight_fmt(PyObject *fmt, tp_tensor *w, int64_t K, const char *op) {
  if (!fmt || fmt == Py_None) return 0;
  tp_dtype_t f;
  size_t rb;
  if (parse_weight_dtype(fmt, op, &f) < 0) return -1;
  int64_t blk = 1;
  tp_weight_format(f, &blk, NULL, NULL);
  if (tp_weight_is_quantized(f) && !tp_weight_row_bytes(f, K, &rb)) { /* (K >= 0: x's columns) */
    PyErr_Format(PyExc_ValueError, "%s: x has %lld columns, not whole blocks of %lld elements (%s weights)", op,
                 (long long)K, (long long)blk, tp_dtype_name(f));
    return -1;
  }
  if (!tp_weight_is_quantized(f) || w->dtype != TP_UINT8 || w->ndim != 2 || !tp_weight_row_bytes(f, K, &rb) ||
      w->shape[1] != (int64_t)rb || (w->shape[0] > 1 && w->strides[0] != w->shape[1])) {
    PyErr_Format(PyExc_ValueError, "%s: with wfmt=%R, w must be contiguous uint8 raw rows of %lld elements", op, fmt,
                 (long long)K);
    return -1;
  }
  w->dtype = f;
  w->shape[1] = K;
  w->strides[0] = K;
  w->strides[1] = 1;
  return 0;
}

/* d_linear_forward(x[M, K], w[N, K], b[N] | None, wfmt | None) -> y[M, N] (w float32, bfloat16,
 * float16, or a quantized format's raw rows with wfmt) */
static PyObject *d_linear_forward(PyObject *mod, PyObject *args) {
  PyObject *xo, *wo, *bo = Py_None, *fmt = Py_None;
  if (!PyArg_ParseTuple(args, "OO|OO:d_linear_forward", &xo, &wo, &bo, &fmt)) return NULL;
  DK_CTX("d_linear_forward", mod);
  tp_tensor x, w, b, y;
  const tp_tensor *bp;
  if (dk_in(&c, xo, "x", 0, 0, &x, NULL) < 0 || dk_in(&c, wo, "w", 0, 0, &w, NULL) < 0 ||
      dk_in(&c, bo, "b", 0, 1, &b, &bp) < 0)
    return dk_fail(&c, TP_SUCCESS, NULL);
  if (x.ndim != 2 || w.ndim != 2) {
    PyErr_SetString(PyExc_ValueError, "d_linear_forward: x (M, K) and w (N, K) must be 2-D");
    return dk_fail(&c, TP_SUCCESS, NULL);
  }
  if (dk_weight_fmt(fmt, &w, x.shape[1], "d_linear_forward") < 0) return dk_fail(&c, TP_SUCCESS, NULL);
  int64_t shape[2] = {x.shape[0], w.shape[0]};
  PyObject *yo = dk_new(&c, TP_FLOAT32, 2, shape, &y);
  if (!yo) return dk_fail(&c, TP_SUCCESS, NULL);
  tp_status_t s;
  DK_RUN(s, tp_linear_forward(NULL, &y, &x, &w, bp));
  return dk_fail(&c, s, yo);
}

/* d_linear_backward(dy[M, N], x[M, K], w[N, K], dw[N, K] | None, wfmt | None) -> dx[M, K] (dw +=) */
static PyObject *d_linear_backward(PyObject *mod, PyObject *args) {
  PyObject *dyo, *xo, *wo, *dwo = Py_None, *fmt = Py_None;
  if (!PyArg_ParseTuple(args, "OOO|OO:d_linear_backward", &dyo, &xo, &wo, &dwo, &fmt)) return NULL;
  DK_CTX("d_linear_backward", mod);
  tp_tensor dy, x, w, dw, dx;
  const tp_tensor *dwp;
  if (dk_in(&c, dyo, "dy", 0, 0, &dy, NULL) < 0 || dk_in(&c, xo, "x", 0, 0, &x, NULL) < 0 ||
      dk_in(&c, wo, "w", 0, 0, &w, NULL) < 0 || dk_in(&c, dwo, "dw", 1, 1, &dw, &dwp) < 0)
    return dk_fail(&c, TP_SUCCESS, NULL);
  if (x.ndim != 2) {
    PyErr_SetString(PyExc_ValueError, "d_linear_backward: x must be 2-D (M, K)");
    return dk_fail(&c, TP_SUCCESS, NULL);
  }
  if (dk_weight_fmt(fmt, &w, x.shape[1], "d_linear_backward") < 0) return dk_fail(&c, TP_SUCCESS, NULL);
  PyObject *dxo = dk_new(&c, TP_FLOAT32, 2, x.shape, &dx);
  if (!dxo) return dk_fail(&c, TP_SUCCESS, NULL);
  tp_status_t s;
  DK_RUN(s, tp_linear_backward(NULL, &dx, dwp, NULL, &dy, &x, &w, 0));
  return dk_fail(&c, s, dxo);
}

/* d_add(y, a, b): y = a + b in place (y may be a or b) -> None */
static PyObject *d_add(PyObject *mod, PyObject *args) {
  PyObject *yo, *ao, *bo;
  if (!PyArg_ParseTuple(args, "OOO:d_add", &yo, &ao, &bo)) return NULL;
  DK_CTX("d_add", mod);
  tp_tensor y, a, b;
  if (dk_in(&c, yo, "y", 1, 0, &y, NULL) < 0 || dk_in(&c, ao, "a", 0, 0, &a, NULL) < 0 ||
      dk_in(&c, bo, "b", 0, 0, &b, NULL) < 0)
    return dk_fail(&c, TP_SUCCESS, NULL);
  tp_status_t s;
  DK_RUN(s, tp_add(NULL, &y, &a, &b));
  return dk_fail(&c, s, s == TP_SUCCESS ? Py_NewRef(Py_None) : NULL);
}

/* d_fill(y, value) -> None */
static PyObject *d_fill(PyObject *mod, PyObject *args) {
  PyObject *yo;
  float v;
  if (!PyArg_ParseTuple(args, "Of:d_fill", &yo, &v)) return NULL;
  DK_CTX("d_fill", mod);
  tp_tensor y;
  if (dk_in(&c, yo, "y", 1, 0, &y, NULL) < 0) return dk_fail(&c, TP_SUCCESS, NULL);
  tp_status_t s;
  DK_RUN(s, tp_fill(NULL, &y, v));
  return dk_fail(&c, s, s == TP_SUCCESS ? Py_NewRef(Py_None) : NULL);
}

/* d_embedding_forward(tokens[M] int64, table[V, C], lo=0) -> out[M, C] (rows outside
 * [lo, lo + V) zero) */
static PyObject *d_embedding_forward(PyObject *mod, PyObject *args) {
  PyObject *to, *wo;
  long long lo = 0;
  if (!PyArg_ParseTuple(args, "OO|L:d_embedding_forward", &to, &wo, &lo)) return NULL;
  DK_CTX("d_embedding_forward", mod);
  tp_tensor tok, w, out;
  if (dk_in(&c, wo, "table", 0, 0, &w, NULL) < 0 || dk_in(&c, to, "tokens", 0, 0, &tok, NULL) < 0)
    return dk_fail(&c, TP_SUCCESS, NULL);
  if (tok.ndim != 1 || w.ndim != 2) {
    PyErr_SetString(PyExc_ValueError, "d_embedding_forward: tokens must be 1-D and table 2-D (V, C)");
    return dk_fail(&c, TP_SUCCESS, NULL);
  }
  int64_t shape[2] = {tok.shape[0], w.shape[1]};
  PyObject *oo = dk_new(&c, TP_FLOAT32, 2, shape, &out);
  if (!oo) return dk_fail(&c, TP_SUCCESS, NULL);
  tp_status_t s;
  DK_RUN(s, tp_embedding_forward(NULL, &out, &tok, &w, (int64_t)lo));
  return dk_fail(&c, s, oo);
}

/* d_embedding_backward(dtable[V, C], tokens[M], dout[M, C], lo=0) -> None (dtable +=) */
static PyObject *d_embedding_backward(PyObject *mod, PyObject *args) {
  PyObject *dwo, *to, *dyo;
  long long lo = 0;
  if (!PyArg_ParseTuple(args, "OOO|L:d_embedding_backward", &dwo, &to, &dyo, &lo)) return NULL;
  DK_CTX("d_embedding_backward", mod);
  tp_tensor dw, tok, dy;
  if (dk_in(&c, dwo, "dtable", 1, 0, &dw, NULL) < 0 || dk_in(&c, to, "tokens", 0, 0, &tok, NULL) < 0 ||
      dk_in(&c, dyo, "dout", 0, 0, &dy, NULL) < 0)
    return dk_fail(&c, TP_SUCCESS, NULL);
  tp_status_t s;
  DK_RUN(s, tp_embedding_backward(NULL, &dw, &tok, &dy, (int64_t)lo));
  return dk_fail(&c, s, s == TP_SUCCESS ? Py_NewRef(Py_None) : NULL);
}

/* d_adamw_step(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step) -> None */
static PyObject *d_adamw_step(PyObject *mod, PyObject *args) {
  PyObject *po, *go, *mo, *vo;
  float lr, b1, b2, eps, wd;
  long long step;
  if (!PyArg_ParseTuple(args, "OOOOfffffL:d_adamw_step", &po, &go, &mo, &vo, &lr, &b1, &b2, &eps, &wd, &step))
    return NULL;
  DK_CTX("d_adamw_step", mod);
  tp_tensor p, g, m, v;
  if (dk_in(&c, po, "p", 1, 0, &p, NULL) < 0 || dk_in(&c, go, "g", 0, 0, &g, NULL) < 0 ||
      dk_in(&c, mo, "m", 1, 0, &m, NULL) < 0 || dk_in(&c, vo, "v", 1, 0, &v, NULL) < 0)
    return dk_fail(&c, TP_SUCCESS, NULL);
  tp_status_t s;
  DK_RUN(s, tp_adamw_step(NULL, &p, &g, &m, &v, lr, b1, b2, eps, wd, (int64_t)step));
  return dk_fail(&c, s, s == TP_SUCCESS ? Py_NewRef(Py_None) : NULL);
}

/* d_sgd_step(p, g, buf | None, lr, momentum, weight_decay, first) -> None */
static PyObject *d_sgd_step(PyObject *mod, PyObject *args) {
  PyObject *po, *go, *bo;
  float lr, mom, wd;
  int first;
  if (!PyArg_ParseTuple(args, "OOOfffp:d_sgd_step", &po, &go, &bo, &lr, &mom, &wd, &first)) return NULL;
  DK_CTX("d_sgd_step", mod);
  tp_tensor p, g, b;
  const tp_tensor *bp;
  if (dk_in(&c, po, "p", 1, 0, &p, NULL) < 0 || dk_in(&c, go, "g", 0, 0, &g, NULL) < 0 ||
      dk_in(&c, bo, "buf", 1, 1, &b, &bp) < 0)
    return dk_fail(&c, TP_SUCCESS, NULL);
  tp_status_t s;
  DK_RUN(s, tp_sgd_step(NULL, &p, &g, bp, lr, mom, wd, first));
  return dk_fail(&c, s, s == TP_SUCCESS ? Py_NewRef(Py_None) : NULL);
}

/* d_convert(y, x): y = x converted (float32 / bfloat16 / float16, one shape) -> None */
static PyObject *d_convert(PyObject *mod, PyObject *args) {
  PyObject *yo, *xo;
  if (!PyArg_ParseTuple(args, "OO:d_convert", &yo, &xo)) return NULL;
  DK_CTX("d_convert", mod);
  tp_tensor y, x;
  if (dk_in(&c, yo, "y", 1, 0, &y, NULL) < 0 || dk_in(&c, xo, "x", 0, 0, &x, NULL) < 0)
    return dk_fail(&c, TP_SUCCESS, NULL);
  tp_status_t s;
  DK_RUN(s, tp_convert(NULL, &y, &x));
  return dk_fail(&c, s, s == TP_SUCCESS ? Py_NewRef(Py_None) : NULL);
}

PyMethodDef devkernel_methods[] = {
    {"d_norm_forward", d_norm_forward, METH_VARARGS, "d_norm_forward(kind, x, w, b, eps) -> (y, mean, rstd)"},
    {"d_norm_backward", d_norm_backward, METH_VARARGS,
     "d_norm_backward(kind, dy, x, w, mean, rstd, dw, db) -> dx; dw, db +="},
    {"d_linear_forward", d_linear_forward, METH_VARARGS, "d_linear_forward(x, w, b=None) -> x @ w.T + b"},
    {"d_linear_backward", d_linear_backward, METH_VARARGS, "d_linear_backward(dy, x, w, dw=None) -> dy @ w; dw +="},
    {"d_add", d_add, METH_VARARGS, "d_add(y, a, b): y = a + b"},
    {"d_fill", d_fill, METH_VARARGS, "d_fill(y, value)"},
    {"d_embedding_forward", d_embedding_forward, METH_VARARGS, "d_embedding_forward(tokens, table, lo=0) -> rows"},
    {"d_embedding_backward", d_embedding_backward, METH_VARARGS,
     "d_embedding_backward(dtable, tokens, dout, lo=0): dtable +="},
    {"d_adamw_step", d_adamw_step, METH_VARARGS, "d_adamw_step(p, g, m, v, lr, beta1, beta2, eps, wd, step)"},
    {"d_sgd_step", d_sgd_step, METH_VARARGS, "d_sgd_step(p, g, buf, lr, momentum, wd, first)"},
    {"d_convert", d_convert, METH_VARARGS, "d_convert(y, x): y = x in y's dtype"},
    {NULL, NULL, 0, NULL},
};
