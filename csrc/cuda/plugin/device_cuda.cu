/* The CUDA device table (tp_device_ops of include/tpcore/device.h) and the plugin's status
 * line.  A tp_stream_t is a cudaStream_t (NULL: the legacy default stream of the current
 * device).  Every CUDA call's status is checked; a failure becomes tp_set_error with the
 * wrapper's name, the call, the device and cudaGetErrorString, and the runtime's
 * non-sticky last error is cleared so it never leaks into a later call.
 *
 * Decisions: a copy that involves host memory synchronizes its stream before it returns
 * (the host side is ready or reusable then, as on the CPU); device-to-device copies and
 * memset stay asynchronous on the stream.  stream_wait records one event per device
 * (created once, reused under a lock: cudaStreamWaitEvent captures the record current at
 * its call, so re-recording it later is safe). */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "../../core/core_impl.h"
#include "cuda_plugin_impl.h"

#define TP_CUDA_MAX_DEVICES 64

/* ------------------------------------------------------------------ the probe */

static pthread_once_t probe_once = PTHREAD_ONCE_INIT;
static int probe_count;      /* usable devices (0 when CUDA is not usable) */
static char probe_line[320]; /* the status line */

static void version_text(int v, char *buf, size_t cap) { snprintf(buf, cap, "%d.%d", v / 1000, (v % 1000) / 10); }

static void probe(void) {
  char rt[16], drv[16];
  version_text(CUDART_VERSION, rt, sizeof rt);
  /* The driver is libcuda.so.1 (cudart opens it too); absent means no NVIDIA driver. */
  void *libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!libcuda) {
    snprintf(probe_line, sizeof probe_line, "no NVIDIA driver (libcuda.so.1 not found)");
    return;
  }
  int dv = 0;
  if (cudaDriverGetVersion(&dv) != cudaSuccess) dv = 0;
  (void)cudaGetLastError();
  version_text(dv, drv, sizeof drv);
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  (void)cudaGetLastError();
  const char *vis = getenv("CUDA_VISIBLE_DEVICES");
  char visible[160];
  if (vis) snprintf(visible, sizeof visible, "CUDA_VISIBLE_DEVICES='%.120s'", vis);
  else snprintf(visible, sizeof visible, "CUDA_VISIBLE_DEVICES unset");
  if (e == cudaErrorInsufficientDriver) {
    snprintf(probe_line, sizeof probe_line, "driver too old: supports CUDA %s, this build needs %s", drv, rt);
  } else if (e == cudaErrorStubLibrary) {
    snprintf(probe_line, sizeof probe_line, "no NVIDIA driver (libcuda.so.1 is the CUDA toolkit's stub library)");
  } else if (e == cudaErrorNoDevice || (e == cudaSuccess && n <= 0)) {
    snprintf(probe_line, sizeof probe_line, "no device (%s)", visible);
  } else if (e != cudaSuccess) {
    snprintf(probe_line, sizeof probe_line, "CUDA is not usable: cudaGetDeviceCount failed: %s (driver %s, %s)",
             cudaGetErrorString(e), drv, visible);
  } else {
    cudaDeviceProp prop;
    const char *name = "unknown device";
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) name = prop.name;
    else (void)cudaGetLastError();
    if (n > TP_CUDA_MAX_DEVICES) n = TP_CUDA_MAX_DEVICES;
    snprintf(probe_line, sizeof probe_line, "%d device%s (%.100s, driver %s)", n, n == 1 ? "" : "s", name, drv);
    probe_count = n;
  }
}

extern "C" const char *tp_cuda_status_line(void) {
  pthread_once(&probe_once, probe);
  return probe_line;
}

extern "C" const char *tp_cuda_runtime_name(void) {
  static char name[32];
  char rt[16];
  version_text(CUDART_VERSION, rt, sizeof rt);
  snprintf(name, sizeof name, "CUDA %s", rt);
  return name;
}

static int cuda_count(void) {
  pthread_once(&probe_once, probe);
  return probe_count;
}

static int cuda_available(void) { return cuda_count() > 0; }

/* ------------------------------------------------------------------ helpers */

static tp_status_t fail(tp_status_t code, cudaError_t e, const char *op, const char *call, int device_id) {
  (void)cudaGetLastError(); /* a non-sticky error must not surface in a later call */
  if (device_id >= 0)
    return tp_set_error(code, "%s: %s failed on cuda:%d: %s (%s)", op, call, device_id, cudaGetErrorName(e),
                        cudaGetErrorString(e));
  return tp_set_error(code, "%s: %s failed: %s (%s)", op, call, cudaGetErrorName(e), cudaGetErrorString(e));
}

static tp_status_t check_id(const char *op, int id) {
  int n = cuda_count();
  if (id < 0 || id >= n)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: device id %d is out of range (%d CUDA device%s)", op, id, n,
                        n == 1 ? "" : "s");
  return TP_SUCCESS;
}

/* Makes `id` current for one call; *prev is restored by leave(). */
static tp_status_t enter(const char *op, int id, int *prev) {
  TP_CHECK(check_id(op, id));
  cudaError_t e = cudaGetDevice(prev);
  if (e != cudaSuccess) return fail(TP_ERR_SYSTEM, e, op, "cudaGetDevice", id);
  if (*prev == id) return TP_SUCCESS;
  e = cudaSetDevice(id);
  if (e != cudaSuccess) return fail(TP_ERR_SYSTEM, e, op, "cudaSetDevice", id);
  return TP_SUCCESS;
}

static void leave(int prev, int id) {
  if (prev != id && cudaSetDevice(prev) != cudaSuccess) (void)cudaGetLastError();
}

/* ------------------------------------------------------------------ the table */

static tp_status_t cuda_alloc(int id, size_t nbytes, void **ptr) {
  *ptr = NULL;
  int prev;
  TP_CHECK(enter("device_alloc", id, &prev));
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, nbytes);
  tp_status_t s = TP_SUCCESS;
  if (e != cudaSuccess) {
    size_t fr = 0, tot = 0;
    (void)cudaGetLastError();
    if (cudaMemGetInfo(&fr, &tot) != cudaSuccess) (void)cudaGetLastError();
    s = tp_set_error(e == cudaErrorMemoryAllocation ? TP_ERR_NOMEM : TP_ERR_SYSTEM,
                     "device_alloc: cudaMalloc of %zu bytes failed on cuda:%d: %s (%zu of %zu MiB free)", nbytes, id,
                     cudaGetErrorString(e), fr >> 20, tot >> 20);
  } else if ((uintptr_t)p % TP_DEVICE_ALIGN) {
    cudaFree(p);
    s = tp_set_error(TP_ERR_INTERNAL, "device_alloc: cudaMalloc returned %p, not aligned to %d bytes", p,
                     TP_DEVICE_ALIGN);
  } else {
    *ptr = p;
  }
  leave(prev, id);
  return s;
}

static void cuda_free(int id, void *ptr) {
  if (ptr && cudaFree(ptr) != cudaSuccess) (void)cudaGetLastError(); /* nothing to report to: free is void */
}

static cudaMemcpyKind kind_of(int dst_host, int src_host) {
  if (dst_host && src_host) return cudaMemcpyHostToHost;
  if (dst_host) return cudaMemcpyDeviceToHost;
  if (src_host) return cudaMemcpyHostToDevice;
  return cudaMemcpyDefault; /* device to device, possibly between two devices (UVA) */
}

static const char *kind_name(int dst_host, int src_host) {
  return dst_host ? (src_host ? "host to host" : "device to host") : (src_host ? "host to device" : "device to device");
}

/* A copy that touches host memory is finished when it returns (see the top). */
static tp_status_t finish_host_copy(const char *op, int dst_host, int src_host, cudaStream_t st) {
  if (!dst_host && !src_host) return TP_SUCCESS;
  cudaError_t e = cudaStreamSynchronize(st);
  return e == cudaSuccess ? TP_SUCCESS : fail(TP_ERR_SYSTEM, e, op, "cudaStreamSynchronize", -1);
}

static tp_status_t cuda_copy(void *dst, int dst_host, const void *src, int src_host, size_t nbytes,
                             tp_stream_t stream) {
  cudaStream_t st = (cudaStream_t)stream;
  cudaError_t e = cudaMemcpyAsync(dst, src, nbytes, kind_of(dst_host, src_host), st);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return tp_set_error(TP_ERR_SYSTEM, "device_copy: cudaMemcpyAsync of %zu bytes (%s) failed: %s", nbytes,
                        kind_name(dst_host, src_host), cudaGetErrorString(e));
  }
  return finish_host_copy("device_copy", dst_host, src_host, st);
}

static tp_status_t cuda_copy_2d(void *dst, size_t dpitch, int dst_host, const void *src, size_t spitch, int src_host,
                                size_t width, size_t rows, tp_stream_t stream) {
  cudaStream_t st = (cudaStream_t)stream;
  cudaError_t e = cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, kind_of(dst_host, src_host), st);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return tp_set_error(TP_ERR_SYSTEM,
                        "device_copy_2d: cudaMemcpy2DAsync of %zu rows of %zu bytes (pitches %zu, %zu; "
                        "%s) failed: %s",
                        rows, width, dpitch, spitch, kind_name(dst_host, src_host), cudaGetErrorString(e));
  }
  return finish_host_copy("device_copy_2d", dst_host, src_host, st);
}

static tp_status_t cuda_memset(void *dst, int value, size_t nbytes, tp_stream_t stream) {
  cudaError_t e = cudaMemsetAsync(dst, value, nbytes, (cudaStream_t)stream);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return tp_set_error(TP_ERR_SYSTEM, "device_memset: cudaMemsetAsync of %zu bytes failed: %s", nbytes,
                        cudaGetErrorString(e));
  }
  return TP_SUCCESS;
}

static tp_status_t cuda_sync(int id, tp_stream_t stream) {
  int prev;
  TP_CHECK(enter("device_sync", id, &prev)); /* the legacy stream (NULL) is the current device's */
  cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
  leave(prev, id);
  return e == cudaSuccess ? TP_SUCCESS : fail(TP_ERR_SYSTEM, e, "device_sync", "cudaStreamSynchronize", id);
}

static int cuda_owns(const void *ptr, int *device_id) {
  if (!ptr) return 0;
  cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, ptr);
  if (e != cudaSuccess) { /* not a pointer CUDA knows: clear the error it left */
    (void)cudaGetLastError();
    return 0;
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) return 0; /* host, pinned, unregistered */
  if (device_id) *device_id = a.device;
  return 1;
}

static tp_status_t cuda_set_current(int id) {
  TP_CHECK(check_id("device_set_current", id));
  cudaError_t e = cudaSetDevice(id);
  return e == cudaSuccess ? TP_SUCCESS : fail(TP_ERR_SYSTEM, e, "device_set_current", "cudaSetDevice", id);
}

static tp_status_t cuda_query(int id, tp_stream_t stream, int *done) {
  *done = 0;
  int prev;
  TP_CHECK(enter("device_query", id, &prev));
  cudaError_t e = cudaStreamQuery((cudaStream_t)stream);
  leave(prev, id);
  if (e == cudaSuccess) {
    *done = 1;
    return TP_SUCCESS;
  }
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return TP_SUCCESS;
  }
  return fail(TP_ERR_SYSTEM, e, "device_query", "cudaStreamQuery (an error of earlier work on the stream)", id);
}

static pthread_mutex_t event_lock = PTHREAD_MUTEX_INITIALIZER;
static cudaEvent_t events[TP_CUDA_MAX_DEVICES]; /* one per device, created on first use */

static tp_status_t cuda_stream_wait(int id, tp_stream_t waiter, tp_stream_t producer) {
  if (waiter == producer) return TP_SUCCESS;
  int prev;
  TP_CHECK(enter("device_stream_wait", id, &prev));
  tp_status_t s = TP_SUCCESS;
  pthread_mutex_lock(&event_lock);
  cudaError_t e = cudaSuccess;
  if (!events[id]) {
    e = cudaEventCreateWithFlags(&events[id], cudaEventDisableTiming);
    if (e != cudaSuccess) {
      events[id] = NULL;
      s = fail(TP_ERR_SYSTEM, e, "device_stream_wait", "cudaEventCreateWithFlags", id);
    }
  }
  if (s == TP_SUCCESS && (e = cudaEventRecord(events[id], (cudaStream_t)producer)) != cudaSuccess)
    s = fail(TP_ERR_SYSTEM, e, "device_stream_wait", "cudaEventRecord (on the producer stream)", id);
  if (s == TP_SUCCESS && (e = cudaStreamWaitEvent((cudaStream_t)waiter, events[id], 0)) != cudaSuccess)
    s = fail(TP_ERR_SYSTEM, e, "device_stream_wait", "cudaStreamWaitEvent (on the waiting stream)", id);
  pthread_mutex_unlock(&event_lock);
  leave(prev, id);
  return s;
}

static tp_status_t cuda_mem_info(int id, size_t *free_bytes, size_t *total_bytes) {
  int prev;
  TP_CHECK(enter("device_mem_info", id, &prev));
  cudaError_t e = cudaMemGetInfo(free_bytes, total_bytes);
  leave(prev, id);
  return e == cudaSuccess ? TP_SUCCESS : fail(TP_ERR_SYSTEM, e, "device_mem_info", "cudaMemGetInfo", id);
}

/* In struct order (device.h); C++17 has no designated initializers. */
extern "C" const tp_device_ops tp_cuda_device_ops = {
    TP_DEVICE_CUDA, "cuda",           cuda_available, cuda_count,       cuda_alloc,
    cuda_free,      cuda_copy,        cuda_copy_2d,   cuda_memset,      cuda_sync,
    cuda_owns,      cuda_set_current, cuda_query,     cuda_stream_wait, cuda_mem_info,
};
