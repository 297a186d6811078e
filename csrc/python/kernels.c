/*
 * kernels.c: the core's tensor kernels as module functions, one binding each, for the
 * tests and for the Python model code outside the C layers: linear_forward/backward
 * (tpcore's BLAS; 16-bit and quantized weights), norm_forward/backward (layernorm,
 * rmsnorm), act_forward/backward, rope_apply, add, fill, embedding_forward/backward, the optimizer
 * steps adamw_step and sgd_step (in place) and convert (float32, bfloat16, float16).
 *
 * Every tensor argument is a NumPy array, a tpcore.DeviceArray or any DLPack tensor, all
 * on the device of the first one (another device is a TypeError naming the call and the
 * argument).  New outputs are of the first tensor's kind: NumPy arrays when it is one,
 * else DeviceArrays on its device.  The checks here (dtype, rank, sizes) are made on the
 * tensors, so their messages are the same on every device; each kernel runs through the
 * public tensor API with the GIL released, on the device's default stream (NULL: the
 * legacy stream on CUDA, as the GPU layers use).
 */
#include "ext.h"

#include "kcall.h"

void kc_release(kcall *c) {
  for (int i = 0; i < c->nkeep; i++) Py_DECREF(c->keep[i]);
  c->nkeep = 0;
}

/* o as a tensor on the call's device (the first tensor fixes it); optional: None gives
 * *tp = NULL.  A NumPy array is checked in place (get_host_buf); anything else goes
 * through DLPack.  0 / -1. */
int kc_in(kcall *c, PyObject *o, const char *name, int writable, int optional, tp_tensor *t, const tp_tensor **tp) {
  if (optional && o == Py_None) {
    if (tp) *tp = NULL;
    return 0;
  }
  if (c->nkeep >= KC_MAX_ARGS) {
    PyErr_Format(PyExc_SystemError, "%s: too many arguments", c->op);
    return -1;
  }
  PyObject *keep = NULL;
  if (PyArray_Check(o) && (!c->have || c->dev == TP_DEVICE_CPU)) {
    buf_t b;
    if (get_host_buf(o, c->op, name, writable, &b) < 0) return -1;
    *t = array_tensor(o, &b);
    keep = Py_NewRef(o);
    if (!c->have) c->numpy = 1;
    c->dev = TP_DEVICE_CPU, c->id = 0, c->have = 1;
  } else if (!c->have) { /* the first tensor: any device */
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

/* A new output of the call's kind (NumPy when the first tensor was NumPy, else a DeviceArray
 * on its device): *t its tensor; the array is returned (new ref). */
PyObject *kc_new(kcall *c, tp_dtype_t dt, int ndim, const int64_t *shape, tp_tensor *t) {
  if (!c->numpy) {
    PyObject *a = devarray_empty(c->st, c->dev, c->id, dt, ndim, shape);
    if (a) *t = *devarray_tensor(c->st, a);
    return a;
  }
  PyArray_Descr *d = numpy_descr(dt);
  if (!d) return NULL;
  npy_intp dims[TP_MAX_DIMS];
  for (int i = 0; i < ndim; i++) dims[i] = (npy_intp)shape[i];
  PyObject *a = PyArray_NewFromDescr(&PyArray_Type, d, ndim, dims, NULL, NULL, 0, NULL); /* steals d */
  if (a) *t = tp_tensor_nd(PyArray_DATA((PyArrayObject *)a), dt, ndim, shape);
  return a;
}

/* out (None: a new array, kc_new) checked as a writable dt tensor of shape; a new ref. */
static PyObject *kc_out(kcall *c, PyObject *out, tp_dtype_t dt, int ndim, const int64_t *shape, tp_tensor *t) {
  if (out == Py_None) return kc_new(c, dt, ndim, shape, t);
  if (kc_in(c, out, "out", 1, 0, t, NULL) < 0 || device_check(t, c->op, "out", dt, ndim, shape) < 0) return NULL;
  return Py_NewRef(out);
}

PyObject *kc_done(kcall *c, tp_status_t s, PyObject *result) {
  kc_release(c);
  if (s == TP_SUCCESS) return result;
  Py_XDECREF(result);
  return raise_status(c->st, s, c->op);
}

PyObject *kc_fail(kcall *c) { return kc_done(c, TP_SUCCESS, NULL); }

static int64_t numel(const tp_tensor *t) { return tp_tensor_numel(t); }

/* t viewed as shape (same element count, already checked) when it is contiguous; a strided
 * tensor is left as it is for the kernel's own shape check. */
static void view_as(tp_tensor *t, int ndim, const int64_t *shape) {
  if (!tp_tensor_is_contiguous(t)) return;
  tp_tensor v = tp_tensor_nd(t->data, t->dtype, ndim, shape);
  v.device = t->device, v.device_id = t->device_id;
  *t = v;
}

/* t a 2-D float32 tensor (TypeError naming arg otherwise). */
static int f32_matrix(kcall *c, const tp_tensor *t, const char *arg) {
  if (t->dtype == TP_FLOAT32 && t->ndim == 2) return 0;
  PyErr_Format(PyExc_TypeError, "%s: %s must be a 2-D float32 array", c->op, arg);
  return -1;
}

/* t float32 with n elements (like ref, e.g. "p"). */
static int f32_count(kcall *c, const tp_tensor *t, const char *arg, int64_t n, const char *like) {
  if (t->dtype == TP_FLOAT32 && numel(t) == n) return 0;
  PyErr_Format(PyExc_ValueError, "%s: %s must be float32 with %lld elements%s%s%s, got %s with %lld", c->op, arg,
               (long long)n, like ? " (like " : "", like ? like : "", like ? ")" : "", tp_dtype_name(t->dtype),
               (long long)numel(t));
  return -1;
}

/* ---- linear ------------------------------------------------------------------------ */

/* w as the kernels' weight [N, K]: float32 / bfloat16 / float16, or (fmt the name of a
 * quantized weight format) uint8 raw rows [N, row_bytes] of K elements each, re-typed in
 * place as the logical [N, K] view.  0 / -1. */
static int weight_arg(kcall *c, tp_tensor *w, PyObject *fmt, int64_t K) {
  if (!fmt || fmt == Py_None) {
    if ((w->dtype == TP_FLOAT32 || w->dtype == TP_BFLOAT16 || w->dtype == TP_FLOAT16) && w->ndim == 2) return 0;
    PyErr_Format(PyExc_TypeError, "%s: w must be a 2-D float32, bfloat16 or float16 array", c->op);
    return -1;
  }
  tp_dtype_t f;
  size_t rb;
  if (parse_weight_dtype(fmt, c->op, &f) < 0) return -1;
  if (!tp_weight_is_quantized(f) || w->dtype != TP_UINT8 || w->ndim != 2) {
    PyErr_Format(PyExc_TypeError, "%s: with wfmt=%R, w must be a 2-D uint8 array of raw rows (a quantized format)",
                 c->op, fmt);
    return -1;
  }
  int64_t blk = 1;
  tp_weight_format(f, &blk, NULL, NULL);
  if (!tp_weight_row_bytes(f, K, &rb)) { /* (K >= 0: x's columns) */
    PyErr_Format(PyExc_ValueError, "%s: x has %lld columns, not whole blocks of %lld elements (%s weights)", c->op,
                 (long long)K, (long long)blk, tp_dtype_name(f));
    return -1;
  }
  if (w->shape[1] != (int64_t)rb || (w->shape[0] > 1 && w->strides[0] != w->shape[1])) {
    PyErr_Format(PyExc_ValueError, "%s: w's rows are %lld bytes, but %lld %s elements take %lld (contiguous rows)",
                 c->op, (long long)w->shape[1], (long long)K, tp_dtype_name(f), (long long)rb);
    return -1;
  }
  w->dtype = f;
  w->shape[1] = K;
  w->strides[0] = K;
  w->strides[1] = 1;
  return 0;
}

/* linear_forward(x[M, K], w[N, K], b[N] | None, out | None, wfmt | None) -> y[M, N] = x w^T + b */
static PyObject *linear_forward(PyObject *mod, PyObject *args) {
  PyObject *xo, *wo, *bo = Py_None, *out = Py_None, *fmt = Py_None;
  if (!PyArg_ParseTuple(args, "OO|OOO:linear_forward", &xo, &wo, &bo, &out, &fmt)) return NULL;
  KCALL("linear_forward", mod);
  tp_tensor x, w, b, y;
  const tp_tensor *bp;
  if (kc_in(&c, xo, "x", 0, 0, &x, NULL) < 0 || f32_matrix(&c, &x, "x") < 0 || kc_in(&c, wo, "w", 0, 0, &w, NULL) < 0 ||
      weight_arg(&c, &w, fmt, x.shape[1]) < 0)
    return kc_fail(&c);
  if (w.shape[1] != x.shape[1] || x.shape[0] > INT_MAX || w.shape[0] > INT_MAX || x.shape[1] > INT_MAX) {
    PyErr_Format(PyExc_ValueError, "linear_forward: x is (%lld, %lld) but w is (%lld, %lld)", (long long)x.shape[0],
                 (long long)x.shape[1], (long long)w.shape[0], (long long)w.shape[1]);
    return kc_fail(&c);
  }
  if (kc_in(&c, bo, "b", 0, 1, &b, &bp) < 0 || (bp && f32_count(&c, bp, "b", w.shape[0], "w's rows") < 0))
    return kc_fail(&c);
  if (bp) view_as(&b, 1, &w.shape[0]);
  int64_t shape[2] = {x.shape[0], w.shape[0]};
  PyObject *yo = kc_out(&c, out, TP_FLOAT32, 2, shape, &y);
  if (!yo) return kc_fail(&c);
  tp_status_t s;
  KRUN(s, tp_linear_forward(NULL, &y, &x, &w, bp));
  return kc_done(&c, s, yo);
}

/* linear_backward(dy[M, N], x[M, K], w[N, K], dw[N, K] | None, out | None, wfmt | None)
 * -> dx[M, K] = dy w (dw += dy^T x) */
static PyObject *linear_backward(PyObject *mod, PyObject *args) {
  PyObject *dyo, *xo, *wo, *dwo = Py_None, *out = Py_None, *fmt = Py_None;
  if (!PyArg_ParseTuple(args, "OOO|OOO:linear_backward", &dyo, &xo, &wo, &dwo, &out, &fmt)) return NULL;
  KCALL("linear_backward", mod);
  tp_tensor dy, x, w, dw, dx;
  const tp_tensor *dwp;
  if (kc_in(&c, dyo, "dy", 0, 0, &dy, NULL) < 0 || f32_matrix(&c, &dy, "dy") < 0 ||
      kc_in(&c, xo, "x", 0, 0, &x, NULL) < 0 || f32_matrix(&c, &x, "x") < 0 || kc_in(&c, wo, "w", 0, 0, &w, NULL) < 0 ||
      weight_arg(&c, &w, fmt, x.shape[1]) < 0)
    return kc_fail(&c);
  int64_t M = dy.shape[0], N = dy.shape[1], K = x.shape[1];
  if (x.shape[0] != M || w.shape[0] != N || w.shape[1] != K || M > INT_MAX || N > INT_MAX || K > INT_MAX) {
    PyErr_SetString(PyExc_ValueError, "linear_backward: dy (M, N), x (M, K) and w (N, K) do not agree");
    return kc_fail(&c);
  }
  if (kc_in(&c, dwo, "dw", 1, 1, &dw, &dwp) < 0 || (dwp && f32_count(&c, dwp, "dw", N * K, "w") < 0))
    return kc_fail(&c);
  if (dwp) view_as(&dw, 2, w.shape);
  int64_t shape[2] = {M, K};
  PyObject *dxo = kc_out(&c, out, TP_FLOAT32, 2, shape, &dx);
  if (!dxo) return kc_fail(&c);
  tp_status_t s;
  KRUN(s, tp_linear_backward(NULL, &dx, dwp, NULL, &dy, &x, &w, 0));
  return kc_done(&c, s, dxo);
}

/* ---- norms ------------------------------------------------------------------------- */

static int norm_kind(const char *kind, const char *op) {
  if (!strcmp(kind, "layernorm")) return 0;
  if (!strcmp(kind, "rmsnorm")) return 1;
  PyErr_Format(PyExc_ValueError, "%s: kind must be 'layernorm' or 'rmsnorm', got '%s'", op, kind);
  return -1;
}

/* norm_forward(kind, x[M, C], w[C], b[C] | None, eps) -> (y, mean | None (rmsnorm), rstd) */
static PyObject *norm_forward(PyObject *mod, PyObject *args) {
  const char *kind;
  PyObject *xo, *wo, *bo;
  float eps;
  if (!PyArg_ParseTuple(args, "sOOOf:norm_forward", &kind, &xo, &wo, &bo, &eps)) return NULL;
  int rms = norm_kind(kind, "norm_forward");
  if (rms < 0) return NULL;
  KCALL("norm_forward", mod);
  tp_tensor x, w, b, y, mean, rstd;
  const tp_tensor *bp;
  if (kc_in(&c, xo, "x", 0, 0, &x, NULL) < 0 || f32_matrix(&c, &x, "x") < 0) return kc_fail(&c);
  int64_t M = x.shape[0], C = x.shape[1];
  if (kc_in(&c, wo, "w", 0, 0, &w, NULL) < 0 || f32_count(&c, &w, "w", C, "x's columns") < 0 ||
      kc_in(&c, bo, "b", 0, 1, &b, &bp) < 0 || (bp && f32_count(&c, bp, "b", C, "x's columns") < 0))
    return kc_fail(&c);
  view_as(&w, 1, &C);
  if (bp) view_as(&b, 1, &C);
  PyObject *yo = kc_new(&c, TP_FLOAT32, 2, x.shape, &y), *ro = yo ? kc_new(&c, TP_FLOAT32, 1, &M, &rstd) : NULL;
  PyObject *mo = ro && !rms ? kc_new(&c, TP_FLOAT32, 1, &M, &mean) : NULL;
  if (!ro || (!rms && !mo)) {
    Py_XDECREF(yo);
    Py_XDECREF(ro);
    return kc_fail(&c);
  }
  tp_status_t s;
  if (rms) KRUN(s, tp_rmsnorm_forward(NULL, &y, &rstd, &x, &w, eps));
  else KRUN(s, tp_layernorm_forward(NULL, &y, &mean, &rstd, &x, &w, bp, eps));
  if (s != TP_SUCCESS) {
    Py_DECREF(yo);
    Py_XDECREF(mo);
    Py_DECREF(ro);
    return kc_done(&c, s, NULL);
  }
  return kc_done(&c, s, Py_BuildValue("(NNN)", yo, mo ? mo : Py_NewRef(Py_None), ro));
}

/* norm_backward(kind, dy, x, w, mean | None, rstd, dw, db | None) -> dx (dw, db +=) */
static PyObject *norm_backward(PyObject *mod, PyObject *args) {
  const char *kind;
  PyObject *dyo, *xo, *wo, *mo, *ro, *dwo, *dbo;
  if (!PyArg_ParseTuple(args, "sOOOOOOO:norm_backward", &kind, &dyo, &xo, &wo, &mo, &ro, &dwo, &dbo)) return NULL;
  int rms = norm_kind(kind, "norm_backward");
  if (rms < 0) return NULL;
  KCALL("norm_backward", mod);
  tp_tensor dy, x, w, mean, rstd, dw, db, dx;
  const tp_tensor *mp, *dbp;
  if (kc_in(&c, dyo, "dy", 0, 0, &dy, NULL) < 0 || kc_in(&c, xo, "x", 0, 0, &x, NULL) < 0 ||
      f32_matrix(&c, &x, "x") < 0)
    return kc_fail(&c);
  int64_t M = x.shape[0], C = x.shape[1];
  if (f32_count(&c, &dy, "dy", M * C, "x") < 0 || kc_in(&c, wo, "w", 0, 0, &w, NULL) < 0 ||
      f32_count(&c, &w, "w", C, "x's columns") < 0 || kc_in(&c, mo, "mean", 0, 1, &mean, &mp) < 0 ||
      (mp && f32_count(&c, mp, "mean", M, "x's rows") < 0) || kc_in(&c, ro, "rstd", 0, 0, &rstd, NULL) < 0 ||
      f32_count(&c, &rstd, "rstd", M, "x's rows") < 0 || kc_in(&c, dwo, "dw", 1, 0, &dw, NULL) < 0 ||
      f32_count(&c, &dw, "dw", C, "x's columns") < 0 || kc_in(&c, dbo, "db", 1, 1, &db, &dbp) < 0 ||
      (dbp && f32_count(&c, dbp, "db", C, "x's columns") < 0))
    return kc_fail(&c);
  if (!rms && !mp) {
    PyErr_SetString(PyExc_ValueError, "norm_backward: layernorm needs the mean its forward gave");
    return kc_fail(&c);
  }
  int64_t rows[1] = {M}, cols[1] = {C};
  view_as(&dy, 2, x.shape);
  view_as(&w, 1, cols);
  view_as(&dw, 1, cols);
  view_as(&rstd, 1, rows);
  if (mp) view_as(&mean, 1, rows);
  if (dbp) view_as(&db, 1, cols);
  PyObject *dxo = kc_new(&c, TP_FLOAT32, 2, x.shape, &dx);
  if (!dxo) return kc_fail(&c);
  tp_status_t s;
  if (rms) KRUN(s, tp_rmsnorm_backward(NULL, &dx, &dw, &dy, &x, &w, &rstd));
  else KRUN(s, tp_layernorm_backward(NULL, &dx, &dw, dbp, &dy, &x, &w, mp, &rstd));
  return kc_done(&c, s, dxo);
}

/* ---- activations --------------------------------------------------------------------- */

/* act_forward(name, h[M, F or 2F], out=None) -> out[M, F];
 * act_backward(name, h, dout[M, F], out=None) -> dh[M, F or 2F] */
static PyObject *act_call(PyObject *mod, PyObject *args, int backward) {
  const char *name;
  PyObject *ho, *douto = Py_None, *out = Py_None;
  if (backward ? !PyArg_ParseTuple(args, "sOO|O:act_backward", &name, &ho, &douto, &out)
               : !PyArg_ParseTuple(args, "sO|O:act_forward", &name, &ho, &out))
    return NULL;
  tp_activation_t act;
  if (parse_act(name, &act) < 0) return NULL;
  KCALL(backward ? "act_backward" : "act_forward", mod);
  tp_tensor h, dout, y;
  if (kc_in(&c, ho, "h", 0, 0, &h, NULL) < 0 || f32_matrix(&c, &h, "h") < 0) return kc_fail(&c);
  int64_t M = h.shape[0], C = h.shape[1], F = tp_act_gated(act) ? C / 2 : C;
  if (tp_act_gated(act) && C % 2) {
    PyErr_Format(PyExc_ValueError, "%s: %s needs an even number of columns [gate | up], got %lld", c.op, name,
                 (long long)C);
    return kc_fail(&c);
  }
  int64_t dshape[2] = {M, F}, oshape[2] = {M, backward ? C : F};
  if (backward) {
    if (kc_in(&c, douto, "dout", 0, 0, &dout, NULL) < 0 || f32_count(&c, &dout, "dout", M * F, NULL) < 0)
      return kc_fail(&c);
    view_as(&dout, 2, dshape);
  }
  PyObject *yo = kc_out(&c, out, TP_FLOAT32, 2, oshape, &y);
  if (!yo) return kc_fail(&c);
  tp_status_t s;
  KRUN(s, backward ? tp_act_backward(NULL, &y, &h, &dout, act) : tp_act_forward(NULL, &y, &h, act));
  return kc_done(&c, s, yo);
}

static PyObject *act_forward(PyObject *m, PyObject *args) { return act_call(m, args, 0); }
static PyObject *act_backward(PyObject *m, PyObject *args) { return act_call(m, args, 1); }

/* ---- rotary positions ------------------------------------------------------------------ */

/* rope_apply(x[rows, >= heads * D], pos[rows] int64, heads, D, inv_freq=None, theta=10000.0,
 * factor=1.0, inverse=False) -> None: x turned in place (tp_rope_apply has the form). */
static PyObject *rope_apply(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"x", "pos", "heads", "D", "inv_freq", "theta", "factor", "inverse", NULL};
  PyObject *xo, *po, *fo = Py_None;
  long long heads, D;
  float theta = 10000.0f, factor = 1.0f;
  int inverse = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOLL|Offp:rope_apply", kwlist, &xo, &po, &heads, &D, &fo, &theta, &factor,
                                   &inverse))
    return NULL;
  KCALL("rope_apply", mod);
  tp_tensor x, pos, f;
  const tp_tensor *fp = NULL;
  if (kc_in(&c, xo, "x", 1, 0, &x, NULL) < 0 || kc_in(&c, po, "pos", 0, 0, &pos, NULL) < 0 ||
      kc_in(&c, fo, "inv_freq", 0, 1, &f, &fp) < 0)
    return kc_fail(&c);
  tp_status_t s;
  KRUN(s, tp_rope_apply(NULL, &x, &pos, heads, D, fp, theta, factor, inverse));
  return kc_done(&c, s, s == TP_SUCCESS ? Py_NewRef(Py_None) : NULL);
}

/* ---- elementwise ------------------------------------------------------------------------ */

/* add(y, a, b): y = a + b in place (y may be a or b) -> None */
static PyObject *add(PyObject *mod, PyObject *args) {
  PyObject *yo, *ao, *bo;
  if (!PyArg_ParseTuple(args, "OOO:add", &yo, &ao, &bo)) return NULL;
  KCALL("add", mod);
  tp_tensor y, a, b;
  if (kc_in(&c, yo, "y", 1, 0, &y, NULL) < 0 || kc_in(&c, ao, "a", 0, 0, &a, NULL) < 0 ||
      kc_in(&c, bo, "b", 0, 0, &b, NULL) < 0)
    return kc_fail(&c);
  tp_status_t s;
  KRUN(s, tp_add(NULL, &y, &a, &b));
  return kc_done(&c, s, s == TP_SUCCESS ? Py_NewRef(Py_None) : NULL);
}

/* fill(y, value) -> None */
static PyObject *fill(PyObject *mod, PyObject *args) {
  PyObject *yo;
  float v;
  if (!PyArg_ParseTuple(args, "Of:fill", &yo, &v)) return NULL;
  KCALL("fill", mod);
  tp_tensor y;
  if (kc_in(&c, yo, "y", 1, 0, &y, NULL) < 0) return kc_fail(&c);
  tp_status_t s;
  KRUN(s, tp_fill(NULL, &y, v));
  return kc_done(&c, s, s == TP_SUCCESS ? Py_NewRef(Py_None) : NULL);
}

/* ---- embedding --------------------------------------------------------------------------- */

/* embedding_forward(tokens[M] int64, table[V, C], lo=0) -> out[M, C] (rows outside [lo, lo + V)
 * zero) */
static PyObject *embedding_forward(PyObject *mod, PyObject *args) {
  PyObject *to, *wo;
  long long lo = 0;
  if (!PyArg_ParseTuple(args, "OO|L:embedding_forward", &to, &wo, &lo)) return NULL;
  KCALL("embedding_forward", mod);
  tp_tensor tok, w, out;
  if (kc_in(&c, wo, "table", 0, 0, &w, NULL) < 0 || kc_in(&c, to, "tokens", 0, 0, &tok, NULL) < 0) return kc_fail(&c);
  if (tok.ndim != 1 || w.ndim != 2) {
    PyErr_SetString(PyExc_ValueError, "embedding_forward: tokens must be 1-D and table 2-D (V, C)");
    return kc_fail(&c);
  }
  int64_t shape[2] = {tok.shape[0], w.shape[1]};
  PyObject *oo = kc_new(&c, TP_FLOAT32, 2, shape, &out);
  if (!oo) return kc_fail(&c);
  tp_status_t s;
  KRUN(s, tp_embedding_forward(NULL, &out, &tok, &w, (int64_t)lo));
  return kc_done(&c, s, oo);
}

/* embedding_backward(dtable[V, C], tokens[M], dout[M, C], lo=0) -> None (dtable +=) */
static PyObject *embedding_backward(PyObject *mod, PyObject *args) {
  PyObject *dwo, *to, *dyo;
  long long lo = 0;
  if (!PyArg_ParseTuple(args, "OOO|L:embedding_backward", &dwo, &to, &dyo, &lo)) return NULL;
  KCALL("embedding_backward", mod);
  tp_tensor dw, tok, dy;
  if (kc_in(&c, dwo, "dtable", 1, 0, &dw, NULL) < 0 || kc_in(&c, to, "tokens", 0, 0, &tok, NULL) < 0 ||
      kc_in(&c, dyo, "dout", 0, 0, &dy, NULL) < 0)
    return kc_fail(&c);
  tp_status_t s;
  KRUN(s, tp_embedding_backward(NULL, &dw, &tok, &dy, (int64_t)lo));
  return kc_done(&c, s, s == TP_SUCCESS ? Py_NewRef(Py_None) : NULL);
}

/* ---- optimizer steps ------------------------------------------------------------------- */

/* p float32 (TypeError otherwise); the others float32 with p's count, viewed as p's shape. */
static int step_args(kcall *c, const tp_tensor *p, tp_tensor *const *others, const char *const *names, int n) {
  if (p->dtype != TP_FLOAT32) {
    PyErr_Format(PyExc_TypeError, "%s: p must be float32, got %s", c->op, tp_dtype_name(p->dtype));
    return -1;
  }
  for (int i = 0; i < n; i++) {
    if (!others[i]) continue;
    if (f32_count(c, others[i], names[i], numel(p), "p") < 0) return -1;
    if (tp_tensor_is_contiguous(p)) view_as(others[i], p->ndim, p->shape);
  }
  return 0;
}

/* adamw_step(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step) -> None (in place) */
static PyObject *adamw_step(PyObject *mod, PyObject *args) {
  PyObject *po, *go, *mo, *vo;
  float lr, b1, b2, eps, wd;
  long long step;
  if (!PyArg_ParseTuple(args, "OOOOfffffL:adamw_step", &po, &go, &mo, &vo, &lr, &b1, &b2, &eps, &wd, &step))
    return NULL;
  KCALL("adamw_step", mod);
  tp_tensor p, g, m, v;
  tp_tensor *others[] = {&g, &m, &v};
  const char *names[] = {"g", "m", "v"};
  if (kc_in(&c, po, "p", 1, 0, &p, NULL) < 0 || kc_in(&c, go, "g", 0, 0, &g, NULL) < 0 ||
      kc_in(&c, mo, "m", 1, 0, &m, NULL) < 0 || kc_in(&c, vo, "v", 1, 0, &v, NULL) < 0 ||
      step_args(&c, &p, others, names, 3) < 0)
    return kc_fail(&c);
  if (step < 1) {
    PyErr_Format(PyExc_ValueError, "adamw_step: step counts from 1, got %lld", step);
    return kc_fail(&c);
  }
  tp_status_t s;
  KRUN(s, tp_adamw_step(NULL, &p, &g, &m, &v, lr, b1, b2, eps, wd, (int64_t)step));
  return kc_done(&c, s, s == TP_SUCCESS ? Py_NewRef(Py_None) : NULL);
}

/* sgd_step(p, g, buf | None, lr, momentum, weight_decay, first) -> None (in place) */
static PyObject *sgd_step(PyObject *mod, PyObject *args) {
  PyObject *po, *go, *bo;
  float lr, mom, wd;
  int first;
  if (!PyArg_ParseTuple(args, "OOOfffp:sgd_step", &po, &go, &bo, &lr, &mom, &wd, &first)) return NULL;
  KCALL("sgd_step", mod);
  tp_tensor p, g, b;
  const tp_tensor *bp;
  if (kc_in(&c, po, "p", 1, 0, &p, NULL) < 0 || kc_in(&c, go, "g", 0, 0, &g, NULL) < 0 ||
      kc_in(&c, bo, "buf", 1, 1, &b, &bp) < 0)
    return kc_fail(&c);
  tp_tensor *others[] = {&g, bp ? &b : NULL};
  const char *names[] = {"g", "buf"};
  if (step_args(&c, &p, others, names, 2) < 0) return kc_fail(&c);
  tp_status_t s;
  KRUN(s, tp_sgd_step(NULL, &p, &g, bp, lr, mom, wd, first));
  return kc_done(&c, s, s == TP_SUCCESS ? Py_NewRef(Py_None) : NULL);
}

/* ---- convert --------------------------------------------------------------------------- */

static int is_float_storage(tp_dtype_t d) { return d == TP_FLOAT32 || d == TP_BFLOAT16 || d == TP_FLOAT16; }

/* dtype (anything numpy.dtype takes, or "bfloat16": ml_dtypes' type, imported on demand) as a
 * tp_dtype_t of float storage.  0 / -1. */
static int convert_dtype(PyObject *o, tp_dtype_t *out) {
  PyObject *bf = NULL;
  PyArray_Descr *d = NULL;
  if (PyUnicode_Check(o) && PyUnicode_CompareWithASCIIString(o, "bfloat16") == 0) {
    PyObject *m = PyImport_ImportModule("ml_dtypes");
    if (!m) {
      PyErr_Clear();
      PyErr_SetString(PyExc_TypeError,
                      "convert: bfloat16 needs the ml_dtypes package for its NumPy dtype "
                      "(pip install ml_dtypes)");
      return -1;
    }
    bf = PyObject_GetAttrString(m, "bfloat16");
    Py_DECREF(m);
    if (!bf) return -1;
    o = bf;
  }
  int ok = PyArray_DescrConverter(o, &d);
  Py_XDECREF(bf);
  if (!ok) return -1;
  int known = descr_dtype(d, out);
  if (!known || !is_float_storage(*out)) {
    PyErr_Format(PyExc_TypeError, "convert: dtype must be float32, bfloat16 or float16, got %R", (PyObject *)d);
    Py_DECREF(d);
    return -1;
  }
  Py_DECREF(d);
  return 0;
}

/* convert(x, dtype=None, out=None) -> x as dtype (float32, bfloat16 or float16; NumPy's float16
 * and ml_dtypes' bfloat16 casts bit for bit): into out when given (dtype None: out's), else a
 * new array of x's kind. */
static PyObject *convert(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"x", "dtype", "out", NULL};
  PyObject *xo, *dto = Py_None, *out = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OO:convert", kwlist, &xo, &dto, &out)) return NULL;
  KCALL("convert", mod);
  tp_tensor x, y;
  tp_dtype_t dt = TP_FLOAT32;
  if (kc_in(&c, xo, "x", 0, 0, &x, NULL) < 0) return kc_fail(&c);
  if (!is_float_storage(x.dtype)) {
    PyErr_Format(PyExc_TypeError, "convert: x must be float32, bfloat16 or float16, got %s", tp_dtype_name(x.dtype));
    return kc_fail(&c);
  }
  if (dto == Py_None && out == Py_None) {
    PyErr_SetString(PyExc_TypeError, "convert: give dtype, out or both");
    return kc_fail(&c);
  }
  if (dto != Py_None && convert_dtype(dto, &dt) < 0) return kc_fail(&c);
  PyObject *yo;
  if (out == Py_None) {
    yo = kc_new(&c, dt, x.ndim, x.shape, &y);
  } else {
    if (kc_in(&c, out, "out", 1, 0, &y, NULL) < 0) return kc_fail(&c);
    if (!is_float_storage(y.dtype)) {
      PyErr_Format(PyExc_TypeError, "convert: dtype must be float32, bfloat16 or float16, got out of %s",
                   tp_dtype_name(y.dtype));
      return kc_fail(&c);
    }
    int same = y.ndim == x.ndim && (dto == Py_None || y.dtype == dt);
    for (int i = 0; same && i < x.ndim; i++) same = y.shape[i] == x.shape[i];
    if (!same) {
      PyErr_SetString(PyExc_ValueError, "convert: out must be an array of x's shape and the requested dtype");
      return kc_fail(&c);
    }
    yo = Py_NewRef(out);
  }
  if (!yo) return kc_fail(&c);
  tp_status_t s;
  KRUN(s, tp_convert(NULL, &y, &x));
  return kc_done(&c, s, yo);
}

/* ---- read_bytes ------------------------------------------------------------------------ */

/* read_bytes(a): the sum of a's bytes read as 64-bit words (a checksum nobody can skip), with the
 * GIL released: the memory-read bandwidth probe of the benchmarks (python -m tpcore.bench report),
 * run by one thread per core at once.  Eight independent accumulators keep the loads in flight. */
static PyObject *read_bytes(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *ao;
  if (!PyArg_ParseTuple(args, "O:read_bytes", &ao)) return NULL;
  buf_t b;
  if (get_host_buf(ao, "read_bytes", "a", 0, &b) < 0) return NULL;
  size_t n = b.count * tp_dtype_size(b.dtype), words = n / 8; /* count x size: the array's own bytes */
  const unsigned char *p = b.data;
  uint64_t acc[8] = {0};
  Py_BEGIN_ALLOW_THREADS size_t i = 0;
  for (; i + 8 <= words; i += 8)
    for (int j = 0; j < 8; j++) {
      uint64_t w;
      memcpy(&w, p + (i + (size_t)j) * 8, 8);
      acc[j] += w;
    }
  for (; i < words; i++) {
    uint64_t w;
    memcpy(&w, p + i * 8, 8);
    acc[0] += w;
  }
  for (size_t k = words * 8; k < n; k++) acc[1] += p[k];
  Py_END_ALLOW_THREADS uint64_t sum = 0;
  for (int j = 0; j < 8; j++) sum += acc[j];
  return PyLong_FromUnsignedLongLong((unsigned long long)sum);
}

PyMethodDef kernel_methods[] = {
    {"linear_forward", linear_forward, METH_VARARGS,
     "linear_forward(x, w, b=None, out=None, wfmt=None) -> x @ w.T + b"},
    {"linear_backward", linear_backward, METH_VARARGS,
     "linear_backward(dy, x, w, dw=None, out=None, wfmt=None) -> dy @ w; dw += dy.T @ x"},
    {"norm_forward", norm_forward, METH_VARARGS, "norm_forward(kind, x, w, b, eps) -> (y, mean, rstd)"},
    {"norm_backward", norm_backward, METH_VARARGS,
     "norm_backward(kind, dy, x, w, mean, rstd, dw, db) -> dx; dw and db accumulate"},
    {"act_forward", act_forward, METH_VARARGS, "act_forward(name, h, out=None) -> act(h)"},
    {"act_backward", act_backward, METH_VARARGS, "act_backward(name, h, dout, out=None) -> dh"},
    {"rope_apply", (PyCFunction)(void (*)(void))rope_apply, METH_VARARGS | METH_KEYWORDS,
     "rope_apply(x, pos, heads, D, inv_freq=None, theta=10000.0, factor=1.0, inverse=False): x turned in place"},
    {"add", add, METH_VARARGS, "add(y, a, b): y = a + b"},
    {"fill", fill, METH_VARARGS, "fill(y, value)"},
    {"embedding_forward", embedding_forward, METH_VARARGS, "embedding_forward(tokens, table, lo=0) -> rows"},
    {"embedding_backward", embedding_backward, METH_VARARGS,
     "embedding_backward(dtable, tokens, dout, lo=0): dtable +="},
    {"adamw_step", adamw_step, METH_VARARGS, "adamw_step(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step)"},
    {"sgd_step", sgd_step, METH_VARARGS, "sgd_step(p, g, buf, lr, momentum, weight_decay, first)"},
    {"convert", (PyCFunction)(void (*)(void))convert, METH_VARARGS | METH_KEYWORDS,
     "convert(x, dtype=None, out=None) -> x as float32, bfloat16 or float16 (round to nearest even)"},
    {"read_bytes", read_bytes, METH_VARARGS, "read_bytes(a) -> the sum of a's bytes as 64-bit words (GIL released)"},
    {NULL, NULL, 0, NULL},
};
