/*
 * kernels_attn.c: the attention kernel (tp_attention_forward / backward of
 * tpcore/kernels.h) as module functions, for the tests and for model code outside the C
 * layers:
 *   attention_forward(q, k, v, *, causal=False, scale=None, q_pos=None, k_len=None,
 *                     key_mask=None, softcap=0.0, window=0, kv_ring=0, keep=None, block_table=None)
 *       -> o, or (o, kept) with keep="probs" ([B, Hq, Tq, Tk]) or keep="lse" ([B, Hq, Tq]);
 *       with block_table (int64 [B, cols], a paged KV cache): k, v are the pool [blocks,
 *       block_size, Hk, D] and Tk = cols x block_size (kv_block_table of tp_attention_args)
 *   attention_backward(q, k, v, o, dout, kept, *, the same keywords but keep)
 *       -> (dq, dk, dv); kept: forward's probs (4-D) or lse (3-D; o must be forward's output)
 * q, o, dout [B, Tq, Hq, D] and k, v [B, Tk, Hk, D]: float32, C-contiguous (k, v: a cache of
 * Tk rows per sequence when decoding with q_pos and k_len, int64 [B]; with kv_ring, a ring
 * of Tk >= kv_ring rows); key_mask uint8 [B, Tk]; scale None: 1 / sqrt(D).  softcap, window
 * and kv_ring are the fields of tp_attention_args (0: off), checked by the core (a bad value
 * is a ValueError naming the field).  Tensors as in kernels.c: NumPy arrays, DeviceArrays or
 * DLPack tensors on one device; outputs of the first one's kind; the GIL released.
 */
#include <math.h>

#include "kcall.h"

typedef struct {
  int causal;
  PyObject *scale, *q_pos, *k_len, *key_mask;
  float softcap;
  long long window, kv_ring;
  PyObject *block_table; /* forward only: a paged KV cache */
} attn_opts;

/* t float32, 4-D, C-contiguous (shape: its shape must be that, when not NULL). */
static int f32_4d(kcall *c, const tp_tensor *t, const char *name, const int64_t *shape) {
  if (t->dtype != TP_FLOAT32 || t->ndim != 4 || !tp_tensor_is_contiguous(t)) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be a C-contiguous 4-D float32 array, got %d-D %s", c->op, name, t->ndim,
                 tp_dtype_name(t->dtype));
    return -1;
  }
  for (int i = 0; shape && i < 4; i++)
    if (t->shape[i] != shape[i]) {
      PyErr_Format(PyExc_ValueError, "%s: %s must have shape (%lld, %lld, %lld, %lld), got (%lld, %lld, %lld, %lld)",
                   c->op, name, (long long)shape[0], (long long)shape[1], (long long)shape[2], (long long)shape[3],
                   (long long)t->shape[0], (long long)t->shape[1], (long long)t->shape[2], (long long)t->shape[3]);
      return -1;
    }
  return 0;
}

/* An optional per-sequence tensor: dt, C-contiguous, shape (n0) or (n0, n1) (n1 < 0: 1-D). */
static int meta_arg(kcall *c, PyObject *o, const char *name, tp_dtype_t dt, int64_t n0, int64_t n1, const void **p) {
  tp_tensor t;
  const tp_tensor *tp;
  *p = NULL;
  if (kc_in(c, o, name, 0, 1, &t, &tp) < 0) return -1;
  if (!tp) return 0;
  int nd = n1 < 0 ? 1 : 2;
  if (t.dtype != dt || t.ndim != nd || t.shape[0] != n0 || (nd == 2 && t.shape[1] != n1) ||
      !tp_tensor_is_contiguous(&t)) {
    if (nd == 1)
      PyErr_Format(PyExc_ValueError, "%s: %s must be a C-contiguous %s array of shape (%lld,) (B), got %d-D %s", c->op,
                   name, tp_dtype_name(dt), (long long)n0, t.ndim, tp_dtype_name(t.dtype));
    else
      PyErr_Format(PyExc_ValueError,
                   "%s: %s must be a C-contiguous %s array of shape (%lld, %lld) (B, Tk), got %d-D %s", c->op, name,
                   tp_dtype_name(dt), (long long)n0, (long long)n1, t.ndim, tp_dtype_name(t.dtype));
    return -1;
  }
  *p = t.data;
  return 0;
}

/* The arguments of q, k, v and the options (q_ld = Hq D, kv rows of Hk D, o unset). */
static int attn_args(kcall *c, PyObject *qo, PyObject *ko, PyObject *vo, const attn_opts *op, tp_attention_args *a,
                     tp_tensor *q, tp_tensor *k) {
  tp_tensor v;
  memset(a, 0, sizeof *a);
  if (kc_in(c, qo, "q", 0, 0, q, NULL) < 0 || f32_4d(c, q, "q", NULL) < 0 || kc_in(c, ko, "k", 0, 0, k, NULL) < 0 ||
      f32_4d(c, k, "k", NULL) < 0 || kc_in(c, vo, "v", 0, 0, &v, NULL) < 0 || f32_4d(c, &v, "v", k->shape) < 0)
    return -1;
  const int paged = op->block_table != Py_None;
  if ((!paged && k->shape[0] != q->shape[0]) || k->shape[3] != q->shape[3]) {
    PyErr_Format(PyExc_ValueError,
                 "%s: q is (B, Tq, Hq, D) = (%lld, %lld, %lld, %lld) but k is (%lld, %lld, %lld, %lld): "
                 "B and D must agree",
                 c->op, (long long)q->shape[0], (long long)q->shape[1], (long long)q->shape[2], (long long)q->shape[3],
                 (long long)k->shape[0], (long long)k->shape[1], (long long)k->shape[2], (long long)k->shape[3]);
    return -1;
  }
  a->B = q->shape[0], a->Tq = q->shape[1], a->Hq = q->shape[2], a->D = q->shape[3];
  a->Tk = k->shape[1], a->Hk = k->shape[2];
  a->q = q->data, a->k = k->data, a->v = v.data;
  a->q_ld = a->o_ld = a->Hq * a->D, a->kv_ld = a->Hk * a->D, a->kv_bstride = a->Tk * a->kv_ld;
  if (paged) { /* k, v: the pool (blocks, block_size, Hk, D); the table (B, cols) places key j */
    tp_tensor t;
    const tp_tensor *tp;
    if (kc_in(c, op->block_table, "block_table", 0, 0, &t, &tp) < 0) return -1;
    if (t.dtype != TP_INT64 || t.ndim != 2 || t.shape[0] != a->B || t.shape[1] < 1 || !tp_tensor_is_contiguous(&t)) {
      PyErr_Format(PyExc_ValueError,
                   "%s: block_table must be a C-contiguous int64 array of shape (B = %lld, cols >= 1), got %d-D %s",
                   c->op, (long long)a->B, t.ndim, tp_dtype_name(t.dtype));
      return -1;
    }
    if (__builtin_mul_overflow(t.shape[1], k->shape[1], &a->Tk)) a->Tk = -1; /* refused by the core */
    a->kv_block_table = t.data, a->kv_block_cols = t.shape[1], a->kv_block_size = k->shape[1];
    a->kv_batch = k->shape[0];
  }
  a->causal = op->causal;
  double scale = op->scale == Py_None ? 1.0 / sqrt(a->D > 0 ? (double)a->D : 1.0) : PyFloat_AsDouble(op->scale);
  if (scale == -1.0 && PyErr_Occurred()) return -1;
  a->scale = (float)scale;
  a->softcap = op->softcap, a->window = op->window, a->kv_ring = op->kv_ring;
  a->device = c->dev, a->device_id = c->id;
  const void *p;
  if (meta_arg(c, op->q_pos, "q_pos", TP_INT64, a->B, -1, &p) < 0) return -1;
  a->q_pos = p;
  if (meta_arg(c, op->k_len, "k_len", TP_INT64, a->B, -1, &p) < 0) return -1;
  a->k_len = p;
  if (meta_arg(c, op->key_mask, "key_mask", TP_UINT8, a->B, a->Tk, &p) < 0) return -1;
  a->key_mask = p;
  return 0;
}

/* The workspace the call needs (a new array of the call's kind in *keep, NULL when none):
 * *ws its tensor, *wp NULL when none.  0 / -1. */
static int workspace(kcall *c, const tp_attention_args *a, int backward, PyObject **keep, tp_tensor *ws,
                     const tp_tensor **wp) {
  size_t need = 0;
  *keep = NULL, *wp = NULL;
  tp_status_t s = tp_attention_workspace_size(a, backward, &need);
  if (s != TP_SUCCESS) {
    raise_status(c->st, s, c->op);
    return -1;
  }
  if (!need) return 0;
  int64_t n = (int64_t)need;
  *keep = kc_new(c, TP_UINT8, 1, &n, ws);
  if (!*keep) return -1;
  *wp = ws;
  return 0;
}

#define ATTN_KWLIST "causal", "scale", "q_pos", "k_len", "key_mask", "softcap", "window", "kv_ring"
#define ATTN_KWARGS(o) \
  &(o).causal, &(o).scale, &(o).q_pos, &(o).k_len, &(o).key_mask, &(o).softcap, &(o).window, &(o).kv_ring
#define ATTN_DEFAULTS {0, Py_None, Py_None, Py_None, Py_None, 0.0f, 0, 0, Py_None}

static PyObject *attention_forward(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"q", "k", "v", ATTN_KWLIST, "keep", "block_table", NULL};
  PyObject *qo, *ko, *vo, *keepo = Py_None;
  attn_opts op = ATTN_DEFAULTS;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|$pOOOOfLLOO:attention_forward", kwlist, &qo, &ko, &vo,
                                   ATTN_KWARGS(op), &keepo, &op.block_table))
    return NULL;
  KCALL("attention_forward", mod);
  tp_attention_args a;
  tp_tensor q, k, o, kept, ws;
  const tp_tensor *wp;
  int keep = 0; /* 1: probs, 2: lse */
  if (keepo != Py_None) {
    const char *s = PyUnicode_Check(keepo) ? PyUnicode_AsUTF8(keepo) : NULL;
    keep = s && !strcmp(s, "probs") ? 1 : s && !strcmp(s, "lse") ? 2 : -1;
    if (keep < 0) {
      PyErr_Format(PyExc_ValueError, "attention_forward: keep must be None, \"probs\" or \"lse\", got %R", keepo);
      return NULL;
    }
  }
  if (attn_args(&c, qo, ko, vo, &op, &a, &q, &k) < 0) return kc_fail(&c);
  PyObject *oo = kc_new(&c, TP_FLOAT32, 4, q.shape, &o), *ko2 = NULL, *wso = NULL;
  if (!oo) return kc_fail(&c);
  a.o = o.data;
  if (keep) {
    int64_t shape[4] = {a.B, a.Hq, a.Tq, a.Tk};
    ko2 = kc_new(&c, TP_FLOAT32, keep == 1 ? 4 : 3, shape, &kept);
    if (!ko2) goto fail;
    if (keep == 1) a.probs = kept.data;
    else a.lse = kept.data;
  }
  if (workspace(&c, &a, 0, &wso, &ws, &wp) < 0) goto fail;
  tp_status_t s;
  KRUN(s, tp_attention_forward(NULL, &a, wp));
  Py_XDECREF(wso);
  if (s != TP_SUCCESS) {
    Py_XDECREF(ko2);
    return kc_done(&c, s, oo);
  }
  return kc_done(&c, s, ko2 ? Py_BuildValue("(NN)", oo, ko2) : oo);
fail:
  Py_XDECREF(oo);
  Py_XDECREF(ko2);
  return kc_fail(&c);
}

static PyObject *attention_backward(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"q", "k", "v", "o", "dout", "kept", ATTN_KWLIST, NULL};
  PyObject *qo, *ko, *vo, *oo, *dyo, *kepto;
  attn_opts op = ATTN_DEFAULTS;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|$pOOOOfLL:attention_backward", kwlist, &qo, &ko, &vo, &oo, &dyo,
                                   &kepto, ATTN_KWARGS(op)))
    return NULL;
  KCALL("attention_backward", mod);
  tp_attention_args a;
  tp_tensor q, k, o, dy, kept, dq, dk, dv, ws;
  const tp_tensor *wp;
  if (attn_args(&c, qo, ko, vo, &op, &a, &q, &k) < 0 || kc_in(&c, oo, "o", 0, 0, &o, NULL) < 0 ||
      f32_4d(&c, &o, "o", q.shape) < 0 || kc_in(&c, dyo, "dout", 0, 0, &dy, NULL) < 0 ||
      f32_4d(&c, &dy, "dout", q.shape) < 0 || kc_in(&c, kepto, "kept", 0, 0, &kept, NULL) < 0)
    return kc_fail(&c);
  const int64_t pshape[4] = {a.B, a.Hq, a.Tq, a.Tk};
  int nd = kept.ndim == 3 ? 3 : 4, same = kept.dtype == TP_FLOAT32 && kept.ndim == nd && tp_tensor_is_contiguous(&kept);
  for (int i = 0; same && i < nd; i++) same = kept.shape[i] == pshape[i];
  if (!same) {
    PyErr_Format(PyExc_ValueError,
                 "attention_backward: kept must be forward's probs, float32 (B, Hq, Tq, Tk) = (%lld, %lld, %lld, "
                 "%lld), or its lse, float32 (B, Hq, Tq), C-contiguous; got %d-D %s",
                 (long long)a.B, (long long)a.Hq, (long long)a.Tq, (long long)a.Tk, kept.ndim,
                 tp_dtype_name(kept.dtype));
    return kc_fail(&c);
  }
  a.o = o.data;
  if (nd == 4) a.probs = kept.data;
  else a.lse = kept.data;
  PyObject *dqo = kc_new(&c, TP_FLOAT32, 4, q.shape, &dq);
  PyObject *dko = dqo ? kc_new(&c, TP_FLOAT32, 4, k.shape, &dk) : NULL;
  PyObject *dvo = dko ? kc_new(&c, TP_FLOAT32, 4, k.shape, &dv) : NULL, *wso = NULL;
  if (!dvo || workspace(&c, &a, 1, &wso, &ws, &wp) < 0) {
    Py_XDECREF(dqo);
    Py_XDECREF(dko);
    Py_XDECREF(dvo);
    return kc_fail(&c);
  }
  tp_status_t s;
  KRUN(s, tp_attention_backward(NULL, &a, dq.data, dk.data, dv.data, dy.data, wp));
  Py_XDECREF(wso);
  if (s != TP_SUCCESS) {
    Py_DECREF(dko);
    Py_DECREF(dvo);
    return kc_done(&c, s, dqo);
  }
  return kc_done(&c, s, Py_BuildValue("(NNN)", dqo, dko, dvo));
}

PyMethodDef attention_methods[] = {
    {"attention_forward", (PyCFunction)(void (*)(void))attention_forward, METH_VARARGS | METH_KEYWORDS,
     "attention_forward(q, k, v, *, causal=False, scale=None, q_pos=None, k_len=None, key_mask=None, softcap=0.0, "
     "window=0, kv_ring=0, keep=None, block_table=None) -> o, or (o, probs | lse)"},
    {"attention_backward", (PyCFunction)(void (*)(void))attention_backward, METH_VARARGS | METH_KEYWORDS,
     "attention_backward(q, k, v, o, dout, kept, *, causal=False, scale=None, q_pos=None, k_len=None, "
     "key_mask=None, softcap=0.0, window=0, kv_ring=0) -> (dq, dk, dv)"},
    {NULL, NULL, 0, NULL},
};
