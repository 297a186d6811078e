/*
 * quant.c: the CPU's block-quantized weight rows (csrc/kernels/cpu/quant.c) as module
 * functions, for tests and for Python code that reads or writes GGUF tensors:
 *   quant_dequantize(raw: uint8 [rows, row_bytes], fmt, cols) -> float32 [rows, cols]
 *   quant_quantize(x: float32 [rows, cols], fmt) -> uint8 [rows, row_bytes]
 * fmt: q8_0, q4_0, q4_1, q4_k, q5_k, q6_k (any case) or int8 (rows of a float32 scale, then
 * cols int8).  Arguments are checked here; the work runs with the GIL released.
 */
#include <ctype.h>
#include <math.h>

#include "ext.h"
#include "../kernels/cpu/quant_impl.h"

/* fmt as one of quant.c's formats, with its block; a ValueError naming it otherwise. */
static int parse_qfmt(PyObject *o, const char *op, tp_dtype_t *f, int64_t *blk) {
  const char *s = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
  if (!s) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s: fmt must be a str (q8_0, q4_0, q4_1, q4_k, q5_k, q6_k or int8), got %s", op,
                 Py_TYPE(o)->tp_name);
    return -1;
  }
  char low[16];
  size_t n = strlen(s);
  for (size_t i = 0; i < n && i < sizeof low - 1; i++) low[i] = (char)tolower((unsigned char)s[i]);
  low[n < sizeof low - 1 ? n : sizeof low - 1] = 0;
  if (n >= sizeof low || !tp_dtype_from_name(low, f) || !tp_q_format(*f)) {
    PyErr_Format(PyExc_ValueError, "%s: fmt must be one of q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, int8, got %R", op, o);
    return -1;
  }
  tp_weight_format(*f, blk, NULL, NULL);
  return 0;
}

/* The bytes of a row of cols elements of f; a ValueError naming cols when it cannot be one. */
static int qrow_bytes(tp_dtype_t f, int64_t blk, int64_t cols, const char *op, size_t *rb) {
  if (cols < 0 || cols % blk) {
    PyErr_Format(PyExc_ValueError, "%s: cols must be a non-negative multiple of %s's block of %lld, got %lld", op,
                 tp_dtype_name(f), (long long)blk, (long long)cols);
    return -1;
  }
  if (!tp_weight_row_bytes(f, cols, rb) || *rb > (size_t)PY_SSIZE_T_MAX) {
    PyErr_Format(PyExc_ValueError, "%s: cols = %lld overflows a row's size", op, (long long)cols);
    return -1;
  }
  return 0;
}

/* a rows x b elements of `size` bytes fit in a NumPy array (and in memory's address range) */
static int fits(int64_t a, int64_t b, size_t size, const char *op, const char *what) {
  if (a > 0 && b > 0 && (uint64_t)a > (uint64_t)PY_SSIZE_T_MAX / (uint64_t)b / size) {
    PyErr_Format(PyExc_ValueError, "%s: %s of %lld x %lld elements overflows the address space", op, what, (long long)a,
                 (long long)b);
    return -1;
  }
  return 0;
}

static PyObject *quant_dequantize(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"raw", "fmt", "cols", NULL};
  static const char *op = "quant_dequantize";
  PyObject *raw, *fmto, *colso;
  long long cols;
  tp_dtype_t f;
  int64_t blk;
  size_t rb;
  buf_t b;
  (void)mod;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO:quant_dequantize", kwlist, &raw, &fmto, &colso)) return NULL;
  if (!PyLong_Check(colso) || PyBool_Check(colso)) {
    PyErr_Format(PyExc_TypeError, "%s: cols must be an int, got %s", op, Py_TYPE(colso)->tp_name);
    return NULL;
  }
  int overflow;
  cols = PyLong_AsLongLongAndOverflow(colso, &overflow);
  if (overflow) {
    PyErr_Format(PyExc_ValueError, "%s: cols = %R overflows a row's size", op, colso);
    return NULL;
  }
  if (get_host_buf(raw, op, "raw", 0, &b) < 0) return NULL;
  if (b.dtype != TP_UINT8 || PyArray_NDIM((PyArrayObject *)raw) != 2) {
    PyErr_Format(PyExc_TypeError, "%s: raw must be a 2-D uint8 array [rows, row_bytes], got %d-D %s", op,
                 PyArray_NDIM((PyArrayObject *)raw), tp_dtype_name(b.dtype));
    return NULL;
  }
  if (parse_qfmt(fmto, op, &f, &blk) < 0 || qrow_bytes(f, blk, (int64_t)cols, op, &rb) < 0) return NULL;
  int64_t rows = PyArray_DIM((PyArrayObject *)raw, 0);
  if ((size_t)PyArray_DIM((PyArrayObject *)raw, 1) != rb) {
    PyErr_Format(PyExc_ValueError, "%s: raw's rows must be %zu bytes for cols = %lld of %s, got %zd", op, rb, cols,
                 tp_dtype_name(f), (Py_ssize_t)PyArray_DIM((PyArrayObject *)raw, 1));
    return NULL;
  }
  if (fits(rows, cols, sizeof(float), op, "the result") < 0) return NULL;
  npy_intp dims[2] = {(npy_intp)rows, (npy_intp)cols};
  PyObject *y = PyArray_SimpleNew(2, dims, NPY_FLOAT32);
  if (!y) return NULL;
  float *yp = PyArray_DATA((PyArrayObject *)y);
  const uint8_t *rp = b.data;
  Py_BEGIN_ALLOW_THREADS for (int64_t r = 0; r < rows; r++)
      tp_q_dequant_row(f, yp + r * cols, rp + (size_t)r * rb, cols);
  Py_END_ALLOW_THREADS return y;
}

static PyObject *quant_quantize(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"x", "fmt", NULL};
  static const char *op = "quant_quantize";
  PyObject *xo, *fmto;
  tp_dtype_t f;
  int64_t blk;
  size_t rb;
  buf_t b;
  (void)mod;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO:quant_quantize", kwlist, &xo, &fmto)) return NULL;
  if (get_host_buf(xo, op, "x", 0, &b) < 0) return NULL;
  if (b.dtype != TP_FLOAT32 || PyArray_NDIM((PyArrayObject *)xo) != 2) {
    PyErr_Format(PyExc_TypeError, "%s: x must be a 2-D float32 array [rows, cols], got %d-D %s", op,
                 PyArray_NDIM((PyArrayObject *)xo), tp_dtype_name(b.dtype));
    return NULL;
  }
  int64_t rows = PyArray_DIM((PyArrayObject *)xo, 0), cols = PyArray_DIM((PyArrayObject *)xo, 1);
  if (parse_qfmt(fmto, op, &f, &blk) < 0 || qrow_bytes(f, blk, cols, op, &rb) < 0) return NULL;
  const float *xp = b.data;
  int64_t bad = -1;
  Py_BEGIN_ALLOW_THREADS for (size_t i = 0; i < b.count; i++) if (!isfinite(xp[i])) {
    bad = (int64_t)i;
    break;
  }
  Py_END_ALLOW_THREADS if (bad >= 0) {
    PyObject *v = PyFloat_FromDouble(xp[bad]);
    if (v)
      PyErr_Format(PyExc_ValueError, "%s: x must be finite; x[%lld, %lld] is %R", op, (long long)(bad / cols),
                   (long long)(bad % cols), v);
    Py_XDECREF(v);
    return NULL;
  }
  npy_intp dims[2] = {(npy_intp)rows, (npy_intp)rb};
  PyObject *y = PyArray_SimpleNew(2, dims, NPY_UINT8);
  if (!y) return NULL;
  uint8_t *yp = PyArray_DATA((PyArrayObject *)y);
  Py_BEGIN_ALLOW_THREADS for (int64_t r = 0; r < rows; r++) tp_q_quant_row(f, yp + (size_t)r * rb, xp + r * cols, cols);
  Py_END_ALLOW_THREADS return y;
}

/* The C core's dtype table (csrc/core/dtype.c), for tpcore.utils.dtypes: one entry per
 * tp_dtype_t value, in enum order, (name, size, weight) with size the bytes of a tensor
 * element (0: a weight-only format) and weight (block, block_bytes, row_header, quantized)
 * from tp_weight_format and tp_weight_is_quantized (None: not a weight storage format). */
static PyObject *dtype_table(PyObject *mod, PyObject *unused) {
  (void)mod, (void)unused;
  PyObject *out = PyList_New(0);
  if (!out) return NULL;
  for (int i = 0; i < TP_WEIGHT_FORMAT_END; i++) {
    tp_dtype_t d = (tp_dtype_t)i;
    int64_t blk;
    size_t bb, hdr;
    int weight = tp_weight_format(d, &blk, &bb, &hdr);
    if (!weight && !tp_dtype_size(d)) continue; /* a gap in the enum */
    PyObject *w = weight ? Py_BuildValue("(LnnO)", (long long)blk, (Py_ssize_t)bb, (Py_ssize_t)hdr,
                                         tp_weight_is_quantized(d) ? Py_True : Py_False)
                         : Py_NewRef(Py_None);
    PyObject *e = w ? Py_BuildValue("(snN)", tp_dtype_name(d), (Py_ssize_t)tp_dtype_size(d), w) : NULL;
    if (!e || PyList_Append(out, e) < 0) {
      Py_XDECREF(e);
      Py_DECREF(out);
      return NULL;
    }
    Py_DECREF(e);
  }
  PyObject *t = PyList_AsTuple(out);
  Py_DECREF(out);
  return t;
}

PyMethodDef quant_methods[] = {
    {"dtype_table", dtype_table, METH_NOARGS,
     "dtype_table() -> tuple of (name, size, weight): the C core's dtypes in enum order; size the bytes of a "
     "tensor element (0: a weight-only format), weight (block, block_bytes, row_header, quantized) or None"},
    {"quant_dequantize", (PyCFunction)(void (*)(void))quant_dequantize, METH_VARARGS | METH_KEYWORDS,
     "quant_dequantize(raw, fmt, cols) -> float32 [rows, cols]: rows of a GGUF block format (or int8 rows) "
     "decoded, bit for bit as gguf-py's dequantizers"},
    {"quant_quantize", (PyCFunction)(void (*)(void))quant_quantize, METH_VARARGS | METH_KEYWORDS,
     "quant_quantize(x, fmt) -> uint8 [rows, row_bytes]: float32 rows in a GGUF block format (or int8 rows)"},
    {NULL, NULL, 0, NULL},
};
