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
  const char *name;                                   /* "cpu", "cuda" */
  /* 1 when devices of this type can be used in this process (runtime found, >= 1 device). */
  int (*available)(void);
  int (*count)(void);                                 /* devices of this type */
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
/* Which device a pointer's memory belongs to: a registered device that claims it,
 * else the host (TP_DEVICE_CPU, 0). */
TP_API void tp_pointer_device(const void *ptr, tp_device_t *device, int *device_id);

#ifdef __cplusplus
}
#endif
#endif /* TPCORE_DEVICE_H */
