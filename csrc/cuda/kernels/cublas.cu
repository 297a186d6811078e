/* cuBLAS at run time: opened once by the library finder, its symbols resolved, its
 * version checked; one handle per (thread, device), created on a thread's first GEMM on
 * that device and destroyed when the thread exits (a pthread key: the main thread's
 * handles live until the process ends, as the CUDA context does).  The stream is set
 * on every call, so a handle serves every stream of its thread. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "common.cuh"
#include "cublas_api.h"

extern "C" {
#include "../../core/dynlib.h"
}

#define TP_CUBLAS_MAX_DEVICES 64

static pthread_mutex_t open_lock = PTHREAD_MUTEX_INITIALIZER;
static int opened;        /* 1: api is usable; 0: not yet, or the last try failed */
static char refused[512]; /* a library found but refused (too old): said on every call */
static tp_cublas_api api;
static pthread_key_t handles_key;

typedef struct {
  cublasHandle_t h[TP_CUBLAS_MAX_DEVICES];
} thread_handles;

static void destroy_handles(void *p) {
  thread_handles *t = (thread_handles *)p;
  for (int d = 0; d < TP_CUBLAS_MAX_DEVICES; d++)
    if (t->h[d]) {
      cudaSetDevice(d);
      api.Destroy(t->h[d]);
    }
  free(t);
}

static const char *library_path(void *sym) {
  Dl_info info;
  return sym && dladdr(sym, &info) && info.dli_fname ? info.dli_fname : "?";
}

/* Under open_lock. */
static tp_status_t open_cublas(void) {
  static const char *const sonames[] = {"libcublas.so.13", "libcublas.so.12", "libcublas.so"};
  static const char *const lt_sonames[] = {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"};
  /* cuBLASLt first, by the same search: libcublas needs it (DT_NEEDED by soname), and the
   * wheels keep it beside libcublas where the loader path may not reach.  Its absence
   * is not an error here: libcublas's own dlopen error then names it. */
  if (!tp_dynlib_open("cuBLASLt", "TPCORE_CUBLASLT_LIBRARY", lt_sonames, 3)) tp_clear_error();
  void *lib = tp_dynlib_open("cuBLAS", "TPCORE_CUBLAS_LIBRARY", sonames, 3);
  if (!lib) return TP_ERR_UNSUPPORTED; /* the finder's sentence names every place tried */
  tp_cublas_api a;
  struct {
    void **slot;
    const char *name;
    int required;
  } syms[] = {{(void **)&a.Create, "cublasCreate_v2", 1},
              {(void **)&a.Destroy, "cublasDestroy_v2", 1},
              {(void **)&a.SetStream, "cublasSetStream_v2", 1},
              {(void **)&a.GetProperty, "cublasGetProperty", 1},
              {(void **)&a.GetStatusString, "cublasGetStatusString", 0},
              {(void **)&a.Sgemm, "cublasSgemm_v2", 1},
              {(void **)&a.Sgemv, "cublasSgemv_v2", 1},
              {(void **)&a.GemmEx, "cublasGemmEx", 1}};
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
    *syms[i].slot = dlsym(lib, syms[i].name);
    if (!*syms[i].slot && syms[i].required) {
      tp_status_t st = tp_set_error(TP_ERR_UNSUPPORTED, "cuBLAS at %s has no symbol %s (not a cuBLAS 12 or newer)",
                                    library_path(dlsym(lib, "cublasCreate_v2")), syms[i].name);
      dlclose(lib);
      return st;
    }
  }
  int major = -1, minor = -1, patch = -1;
  if (a.GetProperty(TP_CUDA_LIB_MAJOR_VERSION, &major) != TP_CUBLAS_STATUS_SUCCESS ||
      a.GetProperty(TP_CUDA_LIB_MINOR_VERSION, &minor) != TP_CUBLAS_STATUS_SUCCESS ||
      a.GetProperty(TP_CUDA_LIB_PATCH_LEVEL, &patch) != TP_CUBLAS_STATUS_SUCCESS) {
    snprintf(refused, sizeof refused, "cuBLAS at %s does not tell its version (cublasGetProperty failed)",
             library_path((void *)a.Create));
  } else if (major < TP_CUBLAS_MIN_MAJOR) {
    snprintf(refused, sizeof refused,
             "cuBLAS %d.%d.%d at %s is too old: tpcore needs cuBLAS %d or newer (set TPCORE_CUBLAS_LIBRARY to "
             "a newer libcublas.so, or install the nvidia-cublas wheel of CUDA 12 or 13)",
             major, minor, patch, library_path((void *)a.Create), TP_CUBLAS_MIN_MAJOR);
  }
  if (refused[0]) {
    dlclose(lib);
    return tp_set_error(TP_ERR_UNSUPPORTED, "%s", refused);
  }
  if (pthread_key_create(&handles_key, destroy_handles) != 0)
    return tp_set_error(TP_ERR_SYSTEM, "cuBLAS: pthread_key_create failed");
  api = a;
  __atomic_store_n(&opened, 1, __ATOMIC_RELEASE); /* the library stays open for the process */
  return TP_SUCCESS;
}

extern "C" tp_status_t tp_cublas_get(const char *op, tp_stream_t s, const tp_cublas_api **out, cublasHandle_t *handle) {
  if (!__atomic_load_n(&opened, __ATOMIC_ACQUIRE)) {
    pthread_mutex_lock(&open_lock);
    tp_status_t st = TP_SUCCESS;
    if (refused[0]) st = tp_set_error(TP_ERR_UNSUPPORTED, "%s", refused);
    else if (!opened) st = open_cublas();
    pthread_mutex_unlock(&open_lock);
    if (st != TP_SUCCESS) {
      tp_error_prefix("%s", op);
      return st;
    }
  }
  int dev = -1;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return tp_set_error(TP_ERR_SYSTEM, "%s: cudaGetDevice: %s", op, cudaGetErrorString(e));
  if (dev < 0 || dev >= TP_CUBLAS_MAX_DEVICES)
    return tp_set_error(TP_ERR_UNSUPPORTED, "%s: device %d is past the %d devices tpcore's cuBLAS handles cover", op,
                        dev, TP_CUBLAS_MAX_DEVICES);
  thread_handles *t = (thread_handles *)pthread_getspecific(handles_key);
  if (!t) {
    t = (thread_handles *)calloc(1, sizeof *t);
    if (!t) return tp_set_error(TP_ERR_NOMEM, "%s: out of memory for the cuBLAS handles", op);
    if (pthread_setspecific(handles_key, t) != 0) {
      free(t);
      return tp_set_error(TP_ERR_SYSTEM, "%s: pthread_setspecific failed", op);
    }
  }
  if (!t->h[dev]) {
    cublasStatus_t cs = api.Create(&t->h[dev]);
    if (cs != TP_CUBLAS_STATUS_SUCCESS) {
      t->h[dev] = NULL;
      return tp_cublas_error(op, "cublasCreate_v2", cs);
    }
  }
  cublasStatus_t cs = api.SetStream(t->h[dev], tpk_stream(s));
  if (cs != TP_CUBLAS_STATUS_SUCCESS) return tp_cublas_error(op, "cublasSetStream_v2", cs);
  *out = &api;
  *handle = t->h[dev];
  return TP_SUCCESS;
}

extern "C" tp_status_t tp_cublas_error(const char *op, const char *fn, cublasStatus_t st) {
  const char *what = api.GetStatusString ? api.GetStatusString(st) : NULL;
  return tp_set_error(st == 3 ? TP_ERR_NOMEM : TP_ERR_SYSTEM, "%s: %s failed: %s (cuBLAS status %d)", op, fn,
                      what ? what : "cuBLAS error", (int)st);
}
