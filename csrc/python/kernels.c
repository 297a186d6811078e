/*
 * kernels.c: the core's kernels exposed to Python as module functions, for tests
 * and for the pure-Python model code: linear_forward/backward (tpcore's BLAS),
 * norm_forward/backward (layernorm, rmsnorm), act_forward/backward, and the
 * optimizer steps adamw_step and sgd_step (in place), and convert (float32, bfloat16,
 * float16).  Each checks its arrays and runs the kernel with the GIL released.
 */
#include "ext.h"

#define F32 TP_FLOAT32
#define T1(p, n) tp_tensor_1d((void *)(p), F32, (n))
#define T2(p, r, c) tp_tensor_2d((void *)(p), F32, (r), (c))

/* A kernel's status after the arrays were checked here: only a bug (or an allocation) fails. */
static PyObject *kernel_done(PyObject *mod, tp_status_t s, const char *op, PyObject *result) {
  if (s == TP_SUCCESS) return result;
  Py_XDECREF(result);
  return raise_status((module_state *)PyModule_GetState(mod), s, op);
}

/* o as a 2-D float32 array: its rows, columns and data. */
static int f32_matrix(PyObject *o, const char *op, const char *arg, int writable, int64_t *r, int64_t *c, float **p) {
  buf_t b;
  if (get_host_buf(o, op, arg, writable, &b) < 0) return -1;
  if (b.dtype != TP_FLOAT32 || PyArray_NDIM((PyArrayObject *)o) != 2) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be a 2-D float32 array", op, arg);
    return -1;
  }
  *r = PyArray_DIM((PyArrayObject *)o, 0);
  *c = PyArray_DIM((PyArrayObject *)o, 1);
  *p = b.data;
  return 0;
}

/* o as a 2-D weight matrix: float32, or bfloat16 / float16 storage (the 16-bit kernels). */
/* w as the kernels' weight: float32 / bfloat16 / float16 [N, K], or (fmt a quantized weight
 * format's name) uint8 raw rows [N, row_bytes] of K = k elements each. */
static int weight_matrix_fmt(PyObject *o, PyObject *fmt, int64_t k, const char *op, int64_t *r, int64_t *c,
                             tp_tensor *t) {
  if (!fmt || fmt == Py_None) return -2;
  tp_dtype_t f;
  size_t rb;
  if (parse_weight_dtype(fmt, op, &f) < 0) return -1;
  buf_t b;
  if (get_host_buf(o, op, "w", 0, &b) < 0) return -1;
  if (!tp_weight_is_quantized(f) || b.dtype != TP_UINT8 || PyArray_NDIM((PyArrayObject *)o) != 2) {
    PyErr_Format(PyExc_TypeError, "%s: with wfmt=%R, w must be a 2-D uint8 array of raw rows (a quantized format)", op,
                 fmt);
    return -1;
  }
  int64_t blk = 1;
  tp_weight_format(f, &blk, NULL, NULL);
  if (!tp_weight_row_bytes(f, k, &rb)) { /* (k >= 0: x's columns) */
    PyErr_Format(PyExc_ValueError, "%s: x has %lld columns, not whole blocks of %lld elements (%s weights)", op,
                 (long long)k, (long long)blk, tp_dtype_name(f));
    return -1;
  }
  if ((size_t)PyArray_DIM((PyArrayObject *)o, 1) != rb) {
    PyErr_Format(PyExc_ValueError, "%s: w's rows are %lld bytes, but %lld %s elements take %lld", op,
                 (long long)PyArray_DIM((PyArrayObject *)o, 1), (long long)k, tp_dtype_name(f), (long long)rb);
    return -1;
  }
  *r = PyArray_DIM((PyArrayObject *)o, 0);
  *c = k;
  *t = tp_tensor_2d(b.data, f, *r, k);
  return 0;
}

static int weight_matrix(PyObject *o, const char *op, int64_t *r, int64_t *c, tp_tensor *t) {
  buf_t b;
  if (get_host_buf(o, op, "w", 0, &b) < 0) return -1;
  if ((b.dtype != TP_FLOAT32 && b.dtype != TP_BFLOAT16 && b.dtype != TP_FLOAT16) ||
      PyArray_NDIM((PyArrayObject *)o) != 2) {
    PyErr_Format(PyExc_TypeError, "%s: w must be a 2-D float32, bfloat16 or float16 array", op);
    return -1;
  }
  *r = PyArray_DIM((PyArrayObject *)o, 0);
  *c = PyArray_DIM((PyArrayObject *)o, 1);
  *t = tp_tensor_2d(b.data, b.dtype, *r, *c);
  return 0;
}

/* o as float32 with n elements (like p). */
static int same_f32(PyObject *o, const char *op, const char *arg, size_t n, int writable, float **p) {
  buf_t b;
  if (get_host_buf(o, op, arg, writable, &b) < 0) return -1;
  if (b.dtype != TP_FLOAT32 || b.count != n) {
    PyErr_Format(PyExc_ValueError, "%s: %s must be float32 with %zu elements (like p), got %s with %zu", op, arg, n,
                 tp_dtype_name(b.dtype), b.count);
    return -1;
  }
  *p = b.data;
  return 0;
}

/* act_forward(name, h[M, F or 2F]) -> out[M, F]; act_backward(name, h, dout[M, F]) -> dh */
static PyObject *act_call(PyObject *mod, PyObject *args, int backward) {
  const char *name;
  PyObject *h, *dout = NULL, *outo = Py_None;
  if (backward ? !PyArg_ParseTuple(args, "sOO|O:act_backward", &name, &h, &dout, &outo)
               : !PyArg_ParseTuple(args, "sO|O:act_forward", &name, &h, &outo))
    return NULL;
  tp_activation_t act;
  if (parse_act(name, &act) < 0) return NULL;
  const char *op = backward ? "act_backward" : "act_forward";
  buf_t bd;
  int64_t M, C;
  float *hp;
  if (f32_matrix(h, op, "h", 0, &M, &C, &hp) < 0) return NULL;
  int64_t F = act == TP_ACT_SWIGLU ? C / 2 : C;
  if (act == TP_ACT_SWIGLU && C % 2) {
    PyErr_Format(PyExc_ValueError, "%s: swiglu needs an even number of columns [gate | up], got %zd", op, (Py_ssize_t)C);
    return NULL;
  }
  if (backward) {
    if (get_host_buf(dout, op, "dout", 0, &bd) < 0) return NULL;
    if (bd.dtype != TP_FLOAT32 || bd.count != (size_t)(M * F)) {
      PyErr_Format(PyExc_ValueError, "%s: dout must be float32 with %zd x %zd elements", op, (Py_ssize_t)M, (Py_ssize_t)F);
      return NULL;
    }
  }
  npy_intp dims[2] = {(npy_intp)M, (npy_intp)(backward ? C : F)};
  PyObject *out;
  if (outo != Py_None) { /* a workspace reused across steps */
    buf_t bo;
    if (get_host_buf(outo, op, "out", 1, &bo) < 0) return NULL;
    if (bo.dtype != TP_FLOAT32 || bo.count != (size_t)(dims[0] * dims[1])) {
      PyErr_Format(PyExc_ValueError, "%s: out must be float32 with %zd x %zd elements", op, (Py_ssize_t)dims[0],
                   (Py_ssize_t)dims[1]);
      return NULL;
    }
    Py_INCREF(outo);
    out = outo;
  } else {
    out = PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    if (!out) return NULL;
  }
  float *o = PyArray_DATA((PyArrayObject *)out);
  tp_tensor th = T2(hp, M, C), to = T2(o, M, backward ? C : F), tdo = T2(backward ? bd.data : NULL, M, F);
  tp_status_t s;
  Py_BEGIN_ALLOW_THREADS
  s = backward ? tp_act_backward(NULL, &to, &th, &tdo, act) : tp_act_forward(NULL, &to, &th, act);
  Py_END_ALLOW_THREADS
  return kernel_done(mod, s, op, out);
}

static PyObject *act_forward(PyObject *m, PyObject *args) { return act_call(m, args, 0); }
static PyObject *act_backward(PyObject *m, PyObject *args) { return act_call(m, args, 1); }

/* adamw_step(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step) and
 * sgd_step(p, g, buf_or_None, lr, momentum, weight_decay, first): in place. */
static PyObject *adamw_step(PyObject *mod, PyObject *args) {
  PyObject *po, *go, *mo, *vo;
  float lr, b1, b2, eps, wd;
  long long step;
  if (!PyArg_ParseTuple(args, "OOOOfffffL:adamw_step", &po, &go, &mo, &vo, &lr, &b1, &b2, &eps, &wd, &step))
    return NULL;
  buf_t bp;
  float *p, *g, *m, *v;
  if (get_host_buf(po, "adamw_step", "p", 1, &bp) < 0) return NULL;
  if (bp.dtype != TP_FLOAT32) {
    PyErr_Format(PyExc_TypeError, "adamw_step: p must be float32, got %s", tp_dtype_name(bp.dtype));
    return NULL;
  }
  p = bp.data;
  if (same_f32(go, "adamw_step", "g", bp.count, 0, &g) < 0 || same_f32(mo, "adamw_step", "m", bp.count, 1, &m) < 0 ||
      same_f32(vo, "adamw_step", "v", bp.count, 1, &v) < 0)
    return NULL;
  if (step < 1) {
    PyErr_Format(PyExc_ValueError, "adamw_step: step counts from 1, got %lld", step);
    return NULL;
  }
  int64_t n = (int64_t)bp.count;
  tp_tensor tp = T1(p, n), tg = T1(g, n), tm = T1(m, n), tv = T1(v, n);
  tp_status_t s;
  Py_BEGIN_ALLOW_THREADS s = tp_adamw_step(NULL, &tp, &tg, &tm, &tv, lr, b1, b2, eps, wd, step);
  Py_END_ALLOW_THREADS
  Py_INCREF(Py_None);
  return kernel_done(mod, s, "adamw_step", Py_None);
}

static PyObject *sgd_step(PyObject *mod, PyObject *args) {
  PyObject *po, *go, *bo;
  float lr, mom, wd;
  int first;
  if (!PyArg_ParseTuple(args, "OOOfffp:sgd_step", &po, &go, &bo, &lr, &mom, &wd, &first)) return NULL;
  buf_t bp;
  float *g, *buf = NULL;
  if (get_host_buf(po, "sgd_step", "p", 1, &bp) < 0) return NULL;
  if (bp.dtype != TP_FLOAT32) {
    PyErr_Format(PyExc_TypeError, "sgd_step: p must be float32, got %s", tp_dtype_name(bp.dtype));
    return NULL;
  }
  if (same_f32(go, "sgd_step", "g", bp.count, 0, &g) < 0) return NULL;
  if (bo != Py_None && same_f32(bo, "sgd_step", "buf", bp.count, 1, &buf) < 0) return NULL;
  int64_t n = (int64_t)bp.count;
  tp_tensor tp = T1(bp.data, n), tg = T1(g, n), tb = T1(buf, n);
  tp_status_t s;
  Py_BEGIN_ALLOW_THREADS s = tp_sgd_step(NULL, &tp, &tg, buf ? &tb : NULL, lr, mom, wd, first);
  Py_END_ALLOW_THREADS
  Py_INCREF(Py_None);
  return kernel_done(mod, s, "sgd_step", Py_None);
}

/* linear_forward(x[M, K], w[N, K], b[N] or None, out=None) -> y[M, N] = x w^T + b (tpcore's BLAS);
 * linear_backward(dy[M, N], x[M, K], w[N, K], dw[N, K] or None, dx_out=None) -> dx (dw accumulates).
 * w may be bfloat16 or float16 (everything else float32: the 16-bit weight kernels). */
static PyObject *linear_forward_k(PyObject *mod, PyObject *args) {
  PyObject *xo, *wo, *bo = Py_None, *out = Py_None, *fmt = Py_None;
  if (!PyArg_ParseTuple(args, "OO|OOO:linear_forward", &xo, &wo, &bo, &out, &fmt)) return NULL;
  int64_t M, K, N, K2;
  float *x, *b = NULL;
  tp_tensor tw;
  if (f32_matrix(xo, "linear_forward", "x", 0, &M, &K, &x) < 0) return NULL;
  int wr = weight_matrix_fmt(wo, fmt, K, "linear_forward", &N, &K2, &tw);
  if (wr == -1 || (wr == -2 && weight_matrix(wo, "linear_forward", &N, &K2, &tw) < 0)) return NULL;
  if (K2 != K || M > INT_MAX || N > INT_MAX || K > INT_MAX) {
    PyErr_Format(PyExc_ValueError, "linear_forward: x is (%lld, %lld) but w is (%lld, %lld)", (long long)M,
                 (long long)K, (long long)N, (long long)K2);
    return NULL;
  }
  if (bo != Py_None && same_f32(bo, "linear_forward", "b", (size_t)N, 0, &b) < 0) return NULL;
  PyObject *y = layer_output(out, "linear_forward", M, N);
  if (!y) return NULL;
  float *yp = PyArray_DATA((PyArrayObject *)y);
  tp_tensor ty = T2(yp, M, N), tx = T2(x, M, K), tb = T1(b, N);
  tp_status_t s;
  Py_BEGIN_ALLOW_THREADS s = tp_linear_forward(NULL, &ty, &tx, &tw, b ? &tb : NULL);
  Py_END_ALLOW_THREADS
  return kernel_done(mod, s, "linear_forward", y);
}

static PyObject *linear_backward_k(PyObject *mod, PyObject *args) {
  PyObject *dyo, *xo, *wo, *dwo = Py_None, *out = Py_None, *fmt = Py_None;
  if (!PyArg_ParseTuple(args, "OOO|OOO:linear_backward", &dyo, &xo, &wo, &dwo, &out, &fmt)) return NULL;
  int64_t M, N, M2, K, N2, K2;
  float *dy, *x, *dw = NULL;
  tp_tensor tw;
  if (f32_matrix(dyo, "linear_backward", "dy", 0, &M, &N, &dy) < 0 ||
      f32_matrix(xo, "linear_backward", "x", 0, &M2, &K, &x) < 0)
    return NULL;
  int wr = weight_matrix_fmt(wo, fmt, K, "linear_backward", &N2, &K2, &tw);
  if (wr == -1 || (wr == -2 && weight_matrix(wo, "linear_backward", &N2, &K2, &tw) < 0)) return NULL;
  if (M2 != M || N2 != N || K2 != K || M > INT_MAX || N > INT_MAX || K > INT_MAX) {
    PyErr_SetString(PyExc_ValueError, "linear_backward: dy (M, N), x (M, K) and w (N, K) do not agree");
    return NULL;
  }
  if (dwo != Py_None && same_f32(dwo, "linear_backward", "dw", (size_t)(N * K), 1, &dw) < 0) return NULL;
  PyObject *dx = layer_output(out, "linear_backward", M, K);
  if (!dx) return NULL;
  float *dxp = PyArray_DATA((PyArrayObject *)dx);
  tp_tensor tdx = T2(dxp, M, K), tdw = T2(dw, N, K), tdy = T2(dy, M, N), tx = T2(x, M, K);
  tp_status_t s;
  Py_BEGIN_ALLOW_THREADS s = tp_linear_backward(NULL, &tdx, dw ? &tdw : NULL, NULL, &tdy, &tx, &tw, 0);
  Py_END_ALLOW_THREADS
  return kernel_done(mod, s, "linear_backward", dx);
}

/* norm_forward(kind, x[M, C], w[C], b[C] or None, eps) -> (y, mean, rstd);
 * norm_backward(kind, dy, x, w, mean, rstd, dw, db or None) -> dx (dw, db accumulate) */
static int norm_kind(const char *k) {
  if (strcmp(k, "layernorm") == 0) return 0;
  if (strcmp(k, "rmsnorm") == 0) return 1;
  PyErr_Format(PyExc_ValueError, "norm must be 'layernorm' or 'rmsnorm', got '%s'", k);
  return -1;
}

static PyObject *norm_forward(PyObject *mod, PyObject *args) {
  const char *kind;
  PyObject *xo, *wo, *bo;
  float eps;
  if (!PyArg_ParseTuple(args, "sOOOf:norm_forward", &kind, &xo, &wo, &bo, &eps)) return NULL;
  int rms = norm_kind(kind);
  if (rms < 0) return NULL;
  int64_t M, C;
  float *xp;
  if (f32_matrix(xo, "norm", "x", 0, &M, &C, &xp) < 0) return NULL;
  float *w, *b = NULL;
  if (same_f32(wo, "norm", "w", (size_t)C, 0, &w) < 0) return NULL;
  if (bo != Py_None && same_f32(bo, "norm", "b", (size_t)C, 0, &b) < 0) return NULL;
  npy_intp d2[2] = {(npy_intp)M, (npy_intp)C}, d1[1] = {(npy_intp)M};
  PyObject *y = PyArray_SimpleNew(2, d2, NPY_FLOAT32), *mu = PyArray_SimpleNew(1, d1, NPY_FLOAT32),
           *rs = PyArray_SimpleNew(1, d1, NPY_FLOAT32);
  if (!y || !mu || !rs) {
    Py_XDECREF(y), Py_XDECREF(mu), Py_XDECREF(rs);
    return NULL;
  }
  float *yp = PyArray_DATA((PyArrayObject *)y), *mp = PyArray_DATA((PyArrayObject *)mu),
        *rp = PyArray_DATA((PyArrayObject *)rs);
  tp_tensor ty = T2(yp, M, C), tm = T1(mp, M), tr = T1(rp, M), tx = T2(xp, M, C), tw = T1(w, C), tb = T1(b, C);
  tp_status_t s;
  Py_BEGIN_ALLOW_THREADS
  s = rms ? tp_rmsnorm_forward(NULL, &ty, &tr, &tx, &tw, eps)
          : tp_layernorm_forward(NULL, &ty, &tm, &tr, &tx, &tw, b ? &tb : NULL, eps);
  Py_END_ALLOW_THREADS
  return kernel_done(mod, s, "norm_forward", Py_BuildValue("NNN", y, mu, rs));
}

static PyObject *norm_backward(PyObject *mod, PyObject *args) {
  const char *kind;
  PyObject *dyo, *xo, *wo, *mo, *ro, *dwo, *dbo;
  if (!PyArg_ParseTuple(args, "sOOOOOOO:norm_backward", &kind, &dyo, &xo, &wo, &mo, &ro, &dwo, &dbo)) return NULL;
  int rms = norm_kind(kind);
  if (rms < 0) return NULL;
  int64_t M, C;
  float *xp;
  if (f32_matrix(xo, "norm", "x", 0, &M, &C, &xp) < 0) return NULL;
  float *dy, *w, *mu, *rs, *dw, *db = NULL;
  if (same_f32(dyo, "norm", "dy", (size_t)(M * C), 0, &dy) < 0 || same_f32(wo, "norm", "w", (size_t)C, 0, &w) < 0 ||
      same_f32(mo, "norm", "mean", (size_t)M, 0, &mu) < 0 || same_f32(ro, "norm", "rstd", (size_t)M, 0, &rs) < 0 ||
      same_f32(dwo, "norm", "dw", (size_t)C, 1, &dw) < 0 ||
      (dbo != Py_None && same_f32(dbo, "norm", "db", (size_t)C, 1, &db) < 0))
    return NULL;
  npy_intp d2[2] = {(npy_intp)M, (npy_intp)C};
  PyObject *dx = PyArray_SimpleNew(2, d2, NPY_FLOAT32);
  if (!dx) return NULL;
  float *dxp = PyArray_DATA((PyArrayObject *)dx);
  tp_tensor tdx = T2(dxp, M, C), tdw = T1(dw, C), tdb = T1(db, C), tdy = T2(dy, M, C), tx = T2(xp, M, C),
            tw = T1(w, C), tm = T1(mu, M), tr = T1(rs, M);
  tp_status_t s;
  Py_BEGIN_ALLOW_THREADS
  s = rms ? tp_rmsnorm_backward(NULL, &tdx, &tdw, &tdy, &tx, &tw, &tr)
          : tp_layernorm_backward(NULL, &tdx, &tdw, db ? &tdb : NULL, &tdy, &tx, &tw, &tm, &tr);
  Py_END_ALLOW_THREADS
  return kernel_done(mod, s, "norm_backward", dx);
}

/* convert(x, dtype, out=None) -> x as dtype (float32, bfloat16 or float16; NumPy's float16 and
 * ml_dtypes' bfloat16 casts bit for bit).  dtype: anything numpy.dtype takes, or "bfloat16"
 * (ml_dtypes' type, imported on demand). */
static PyObject *convert_k(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"x", "dtype", "out", NULL};
  PyObject *xo, *dto, *out = Py_None, *bf = NULL, *y = NULL;
  PyArray_Descr *d = NULL;
  buf_t xb, yb;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O:convert", kwlist, &xo, &dto, &out)) return NULL;
  if (get_host_buf(xo, "convert", "x", 0, &xb) < 0) return NULL;
  if (xb.dtype != TP_FLOAT32 && xb.dtype != TP_BFLOAT16 && xb.dtype != TP_FLOAT16) {
    PyErr_Format(PyExc_TypeError, "convert: x must be float32, bfloat16 or float16, got %s", tp_dtype_name(xb.dtype));
    return NULL;
  }
  if (PyUnicode_Check(dto) && PyUnicode_CompareWithASCIIString(dto, "bfloat16") == 0) {
    PyObject *m = PyImport_ImportModule("ml_dtypes");
    if (!m) {
      PyErr_Clear();
      PyErr_SetString(PyExc_TypeError, "convert: bfloat16 needs the ml_dtypes package for its NumPy dtype "
                      "(pip install ml_dtypes)");
      return NULL;
    }
    bf = PyObject_GetAttrString(m, "bfloat16");
    Py_DECREF(m);
    if (!bf) return NULL;
    dto = bf;
  }
  if (!PyArray_DescrConverter(dto, &d)) goto fail;
  PyArrayObject *xa = (PyArrayObject *)xo;
  if (out == Py_None) {
    y = PyArray_NewFromDescr(&PyArray_Type, d, PyArray_NDIM(xa), PyArray_DIMS(xa), NULL, NULL, 0, NULL);
    d = NULL; /* stolen */
    if (!y) goto fail;
  } else {
    if (!PyArray_Check(out) || !PyArray_EquivTypes(PyArray_DESCR((PyArrayObject *)out), d) ||
        !PyArray_SAMESHAPE((PyArrayObject *)out, xa)) {
      PyErr_SetString(PyExc_ValueError, "convert: out must be a NumPy array of x's shape and the requested dtype");
      goto fail;
    }
    y = out;
    Py_INCREF(y);
  }
  if (get_host_buf(y, "convert", "out", 1, &yb) < 0) goto fail;
  if (yb.dtype != TP_FLOAT32 && yb.dtype != TP_BFLOAT16 && yb.dtype != TP_FLOAT16) {
    PyErr_Format(PyExc_TypeError, "convert: dtype must be float32, bfloat16 or float16, got %s",
                 tp_dtype_name(yb.dtype));
    goto fail;
  }
  /* both C-contiguous and of one shape: flat views (any ndim) */
  tp_tensor ty = tp_tensor_1d(yb.data, yb.dtype, (int64_t)yb.count), tx = tp_tensor_1d(xb.data, xb.dtype,
                                                                                           (int64_t)xb.count);
  tp_status_t s;
  Py_BEGIN_ALLOW_THREADS s = tp_convert(NULL, &ty, &tx);
  Py_END_ALLOW_THREADS
  Py_XDECREF(bf);
  Py_XDECREF(d);
  return kernel_done(mod, s, "convert", y);
fail:
  Py_XDECREF(bf);
  Py_XDECREF(d);
  Py_XDECREF(y);
  return NULL;
}


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
  Py_BEGIN_ALLOW_THREADS
  size_t i = 0;
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
  Py_END_ALLOW_THREADS
  uint64_t sum = 0;
  for (int j = 0; j < 8; j++) sum += acc[j];
  return PyLong_FromUnsignedLongLong((unsigned long long)sum);
}

PyMethodDef kernel_methods[] = {
    {"convert", (PyCFunction)(void (*)(void))convert_k, METH_VARARGS | METH_KEYWORDS,
     "convert(x, dtype, out=None) -> x as float32, bfloat16 or float16 (round to nearest even)"},
    {"act_forward", act_forward, METH_VARARGS, "act_forward(name, h) -> act(h)"},
    {"adamw_step", adamw_step, METH_VARARGS, "adamw_step(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step)"},
    {"sgd_step", sgd_step, METH_VARARGS, "sgd_step(p, g, buf, lr, momentum, weight_decay, first)"},
    {"act_backward", act_backward, METH_VARARGS, "act_backward(name, h, dout) -> dh"},
    {"read_bytes", read_bytes, METH_VARARGS, "read_bytes(a) -> the sum of a's bytes as 64-bit words (GIL released)"},
    {"linear_forward", linear_forward_k, METH_VARARGS, "linear_forward(x, w, b=None, out=None) -> x @ w.T + b"},
    {"linear_backward", linear_backward_k, METH_VARARGS,
     "linear_backward(dy, x, w, dw=None, out=None) -> dy @ w; dw += dy.T @ x"},
    {"norm_forward", norm_forward, METH_VARARGS, "norm_forward(kind, x, w, b, eps) -> (y, mean, rstd)"},
    {"norm_backward", norm_backward, METH_VARARGS,
     "norm_backward(kind, dy, x, w, mean, rstd, dw, db) -> dx; dw and db accumulate"},
    {NULL, NULL, 0, NULL},
};
