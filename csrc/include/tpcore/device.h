/*
 * The device table: where a layer's bytes come from and how they move.
 *
 * One tp_device_ops per kind of device (ggml's backend buffer type, NCCL's
 * transport table): the CPU's is always there; CUDA's is registered when the
 * build has it and its runtime loads.  Layers get every byte they own from
 * here (parameters and gradients in one allocation, workspaces in an arena),
 * so a layer on another device is the same code with another table.
 *
 * Copies name the device of each side; a copy between two devices of
 * different kinds goes through the non-host side's table.  On the CPU the
 * stream is ignored and every call has finished when it returns.
 */
#ifndef TPCORE_DEVICE_H
#define TPCORE_DEVICE_H

#include "tpcore/tpcore.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Default alignment of tp_device_alloc and of arena slices (bytes). */
#define TP_DEVICE_ALIGN 64

typedef struct tp_device_ops {
  tp_device_t type;
  const char *name; /* "cpu", "cuda" */
  /* 1 when devices of this type can be used in this process (runtime found, >= 1 device). */
  int (*available)(void);
  int (*count)(void); /* devices of this type */
  /* nbytes > 0, aligned to TP_DEVICE_ALIGN; contents undefined. */
  tp_status_t (*alloc)(int device_id, size_t nbytes, void **ptr);
  void (*free)(int device_id, void *ptr);
  /* dst and src are memory of this device or of the host (dst_host/src_host say which). */
  tp_status_t (*copy)(void *dst, int dst_host, const void *src, int src_host, size_t nbytes, tp_stream_t stream);
  /* rows of width bytes: dst + r * dpitch <- src + r * spitch (cudaMemcpy2DAsync). */
  tp_status_t (*copy_2d)(void *dst, size_t dpitch, int dst_host, const void *src, size_t spitch, int src_host,
                         size_t width, size_t rows, tp_stream_t stream);
  tp_status_t (*memset)(void *dst, int value, size_t nbytes, tp_stream_t stream);
  /* Waits until the work queued on stream has finished. */
  tp_status_t (*sync)(int device_id, tp_stream_t stream);
  /* 1 when ptr is memory of this device type (its id in *device_id); may be NULL (never). */
  int (*owns)(const void *ptr, int *device_id);
  /* The entries below may be NULL on a device without streams (the CPU): the wrappers
   * then succeed at once (set_current, stream_wait), report done (query) or host
   * memory figures (mem_info). */
  /* Makes device_id the calling thread's current device (cudaSetDevice). */
  tp_status_t (*set_current)(int device_id);
  /* *done = 1 when all work queued so far on stream has finished, without blocking
   * (cudaStreamQuery); an asynchronous error of that work is returned as the status. */
  tp_status_t (*query)(int device_id, tp_stream_t stream, int *done);
  /* Work queued on `waiter` after this call starts only after the work queued on
   * `producer` so far (an event recorded on producer, waited on by waiter; nothing
   * when they are the same stream).  The DLPack stream handshake. */
  tp_status_t (*stream_wait)(int device_id, tp_stream_t waiter, tp_stream_t producer);
  /* Free and total bytes of the device (cudaMemGetInfo). */
  tp_status_t (*mem_info)(int device_id, size_t *free_bytes, size_t *total_bytes);
} tp_device_ops;

/* The table of a device type, or NULL when this build or this machine has none. */
TP_API const tp_device_ops *tp_device_ops_of(tp_device_t device);
/* 1 when tensors may live on `device` in this process. */
TP_API int tp_device_available(tp_device_t device);

/* Convenience wrappers over the tables; errors name the device and the size. */
TP_API tp_status_t tp_device_alloc(tp_device_t device, int device_id, size_t nbytes, void **ptr);
TP_API void tp_device_free(tp_device_t device, int device_id, void *ptr);
TP_API tp_status_t tp_device_copy(tp_device_t dst_device, void *dst, tp_device_t src_device, const void *src,
                                  size_t nbytes, tp_stream_t stream);
TP_API tp_status_t tp_device_copy_2d(tp_device_t dst_device, void *dst, size_t dpitch, tp_device_t src_device,
                                     const void *src, size_t spitch, size_t width, size_t rows, tp_stream_t stream);
TP_API tp_status_t tp_device_memset(tp_device_t device, void *dst, int value, size_t nbytes, tp_stream_t stream);
TP_API tp_status_t tp_device_sync(tp_device_t device, int device_id, tp_stream_t stream);
TP_API tp_status_t tp_device_set_current(tp_device_t device, int device_id);
TP_API tp_status_t tp_device_query(tp_device_t device, int device_id, tp_stream_t stream, int *done);
TP_API tp_status_t tp_device_stream_wait(tp_device_t device, int device_id, tp_stream_t waiter, tp_stream_t producer);
TP_API tp_status_t tp_device_mem_info(tp_device_t device, int device_id, size_t *free_bytes, size_t *total_bytes);

/* CUDA support lives in a plugin, libtpcore_cuda.so, built by nvcc beside the core
 * (csrc/cuda/plugin_abi.h); the core itself links no CUDA.  tp_cuda_load loads it
 * once per process and registers its device and kernel tables: path NULL means
 * $TPCORE_CUDA_PLUGIN, else the file beside the loaded core (tpcore/.libs), else the
 * loader path.  It succeeds when the plugin loads, even on a machine without a GPU:
 * tp_device_available(TP_DEVICE_CUDA) then says 0 and tp_cuda_status() says why.
 * Later calls return the first call's result. */
TP_API tp_status_t tp_cuda_load(const char *path);
/* One line: why CUDA is usable or not ("not loaded", "this build has no CUDA
 * plugin", "no NVIDIA driver (...)", "driver too old: ...", "no device", "2 devices
 * (NVIDIA H200, ...)").  Never NULL. */
TP_API const char *tp_cuda_status(void);

/* Directories searched (after the override variable, before CUDA_HOME and the loader
 * path) for the run-time libraries tpcore loads with dlopen: cuBLAS, NCCL (the Python
 * side registers the nvidia-* wheels' lib directories).  Copied; n = 0 clears. */
TP_API tp_status_t tp_set_library_dirs(const char *const *dirs, int n);

/* Which device a pointer's memory belongs to: a registered device that claims it,
 * else the host (TP_DEVICE_CPU, 0). */
TP_API void tp_pointer_device(const void *ptr, tp_device_t *device, int *device_id);

#ifdef __cplusplus
}
#endif
#endif /* TPCORE_DEVICE_H */
