/*
 * site.c: the call site of a communicator call, "file.py:LINE" of the first Python
 * frame outside the tpcore package (the user's line; a layer's collectives get the
 * line that called the layer), handed to the C core (tp_comm_set_site) before each
 * call for its history and desync messages (csrc/comm/history.c, shm_desync.c).
 *
 * Cost: it runs on every call, so "is this code object inside tpcore, and what is
 * its file's base name" is cached per code object, and the site string per code
 * object and instruction (small direct-mapped tables that hold references, so an
 * address is never reused under them); a call then costs a frame walk of one or two
 * frames, two table look-ups and a 48-byte copy.  TPCORE_HISTORY=0 (no ring) skips it.
 */
#include "ext.h"

/* CPython 3.11: the interpreter's own frames are read directly (the public API would
 * first make a frame object for the innermost frame, a wrapper of tpcore's, on every
 * call: ~60 ns, most of this file's cost).  Other versions take the public API (as does a build
 * with -DTP_SITE_PUBLIC_FRAMES, to test it). */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && !defined(Py_LIMITED_API) && \
    !defined(TP_SITE_PUBLIC_FRAMES)
#define TP_SITE_FAST_FRAMES 1
#define Py_BUILD_CORE
#include "internal/pycore_frame.h"
#undef Py_BUILD_CORE
#endif

#define CODE_CACHE 64
#define LINE_CACHE 256

typedef struct {
  PyObject *code; /* a strong reference, or NULL */
  int internal;   /* the file lies in the tpcore package */
  char base[TP_COMM_SITE_MAX - 8];
} code_entry;

typedef struct {
  PyObject *code; /* a strong reference, or NULL */
  int lasti;
  char site[TP_COMM_SITE_MAX];
} line_entry;

static code_entry codes[CODE_CACHE];
static line_entry lines[LINE_CACHE];
static char pkg_dir[4096]; /* ".../tpcore/" of this extension; "" when unknown */
static size_t pkg_len;

void site_init(PyObject *module) {
  PyObject *f = PyModule_GetFilenameObject(module);
  if (!f) {
    PyErr_Clear();
    return;
  }
  Py_ssize_t n;
  const char *s = PyUnicode_AsUTF8AndSize(f, &n);
  if (s) {
    const char *slash = strrchr(s, '/');
    size_t len = slash ? (size_t)(slash - s) + 1 : 0;
    if (len < sizeof pkg_dir) {
      memcpy(pkg_dir, s, len);
      pkg_dir[len] = '\0';
      pkg_len = len;
    }
  } else {
    PyErr_Clear();
  }
  Py_DECREF(f);
}

/* Is code inside tpcore, and its file's base name (cached per code object). */
static code_entry *code_info(PyCodeObject *code) {
  code_entry *e = &codes[((uintptr_t)code >> 4) % CODE_CACHE];
  if (e->code == (PyObject *)code) return e;
  Py_ssize_t n;
  const char *fn = PyUnicode_AsUTF8AndSize(code->co_filename, &n);
  if (!fn) {
    PyErr_Clear();
    return NULL;
  }
  Py_XSETREF(e->code, Py_NewRef((PyObject *)code));
  e->internal = pkg_len ? (size_t)n >= pkg_len && memcmp(fn, pkg_dir, pkg_len) == 0 : strstr(fn, "/tpcore/") != NULL;
  const char *base = strrchr(fn, '/');
  snprintf(e->base, sizeof e->base, "%s", base ? base + 1 : fn);
  return e;
}

#ifndef TP_SITE_FAST_FRAMES
/* "file.py:LINE" of frame f running code (cached per code object and instruction). */
static const char *frame_site(PyFrameObject *f, PyCodeObject *code, const code_entry *ce) {
  int lasti = PyFrame_GetLasti(f);
  line_entry *e = &lines[(((uintptr_t)code >> 4) ^ (uintptr_t)lasti * 2654435761u) % LINE_CACHE];
  if (e->code != (PyObject *)code || e->lasti != lasti) {
    Py_XSETREF(e->code, Py_NewRef((PyObject *)code));
    e->lasti = lasti;
    snprintf(e->site, sizeof e->site, "%s:%d", ce->base, PyFrame_GetLineNumber(f));
  }
  return e->site;
}
#endif

#ifdef TP_SITE_FAST_FRAMES
/* The site of interpreter frame f (cached per code object and instruction). */
static const char *iframe_site(struct _PyInterpreterFrame *f, const code_entry *ce) {
  PyCodeObject *code = f->f_code;
  int lasti = _PyInterpreterFrame_LASTI(f);
  line_entry *e = &lines[(((uintptr_t)code >> 4) ^ (uintptr_t)lasti * 2654435761u) % LINE_CACHE];
  if (e->code != (PyObject *)code || e->lasti != lasti) {
    Py_XSETREF(e->code, Py_NewRef((PyObject *)code));
    e->lasti = lasti;
    snprintf(e->site, sizeof e->site, "%s:%d", ce->base, PyCode_Addr2Line(code, lasti * (int)sizeof(_Py_CODEUNIT)));
  }
  return e->site;
}

static struct _PyInterpreterFrame *complete(struct _PyInterpreterFrame *f) {
  while (f && _PyFrame_IsIncomplete(f)) f = f->previous;
  return f;
}

/* The last site found one frame out (a wrapper of tpcore's called from a user's line):
 * the same wrapper instruction called from the same instruction of the same frame again,
 * as in a loop, gives the same site without the look-ups.  It holds references to both
 * code objects, so their addresses cannot be reused under it. */
static struct {
  PyObject *inner_code, *outer_code;
  _Py_CODEUNIT *inner_ip, *outer_ip;
  struct _PyInterpreterFrame *outer;
  char site[TP_COMM_SITE_MAX];
} memo;
#endif

void comm_set_call_site(tp_comm_t c) {
  int cap = 0;
  if (!c || tp_comm_history_capacity(c, &cap) != TP_SUCCESS || cap == 0) return;
#ifdef TP_SITE_FAST_FRAMES
  PyThreadState *ts = PyThreadState_Get();
  struct _PyInterpreterFrame *inner = complete(ts->cframe ? ts->cframe->current_frame : NULL), *f = inner;
  if (inner && (PyObject *)inner->f_code == memo.inner_code && inner->prev_instr == memo.inner_ip) {
    struct _PyInterpreterFrame *o = complete(inner->previous);
    if (o && o == memo.outer && (PyObject *)o->f_code == memo.outer_code && o->prev_instr == memo.outer_ip) {
      tp_comm_set_site(c, memo.site);
      return;
    }
  }
  for (int depth = 0; f && depth < 64; depth++, f = complete(f->previous)) {
    code_entry *e = code_info(f->f_code);
    if (e && !e->internal) {
      const char *site = iframe_site(f, e);
      if (depth == 1) { /* remember it for the next call */
        Py_XSETREF(memo.inner_code, Py_NewRef((PyObject *)inner->f_code));
        Py_XSETREF(memo.outer_code, Py_NewRef((PyObject *)f->f_code));
        memo.inner_ip = inner->prev_instr;
        memo.outer_ip = f->prev_instr;
        memo.outer = f;
        memcpy(memo.site, site, sizeof memo.site);
      }
      tp_comm_set_site(c, site);
      return;
    }
  }
  code_entry *e = inner ? code_info(inner->f_code) : NULL; /* called from tpcore only: the innermost line */
  if (e) tp_comm_set_site(c, iframe_site(inner, e));
#else
  PyFrameObject *f = PyEval_GetFrame(); /* borrowed */
  if (!f) return;
  Py_INCREF(f);
  Py_INCREF(f);
  PyFrameObject *inner = f; /* its own reference */
  for (int depth = 0; f && depth < 64; depth++) {
    PyCodeObject *code = PyFrame_GetCode(f);
    code_entry *e = code_info(code);
    if (e && !e->internal) {
      tp_comm_set_site(c, frame_site(f, code, e));
      Py_DECREF(code);
      Py_DECREF(f);
      Py_DECREF(inner);
      return;
    }
    Py_DECREF(code);
    PyFrameObject *back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
  /* Called from tpcore itself only (its benchmarks): the innermost line. */
  PyCodeObject *code = PyFrame_GetCode(inner);
  code_entry *e = code_info(code);
  if (e) tp_comm_set_site(c, frame_site(inner, code, e));
  Py_DECREF(code);
  Py_DECREF(inner);
#endif
}
