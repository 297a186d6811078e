/* Private side of the device table: the registry (device.c: the CPU built in, others
 * registered at run time) and the checks layers and kernels share. */
#ifndef TPCORE_DEVICE_IMPL_H
#define TPCORE_DEVICE_IMPL_H

#include "../core/core_impl.h"
#include "tpcore/device.h"

extern const tp_device_ops tp_cpu_device_ops;

/* Registers the table of a device type other than the CPU (the CUDA plugin's, by
 * cuda/cuda_load.c): once per type; the same table again is a no-op, another one an error.
 * Required entries: everything up to owns (the stream entries may be NULL). */
tp_status_t tp_device_register(const tp_device_ops *ops);

/* TP_SUCCESS when t lives on `device`, else an argument error naming op and arg. */
tp_status_t tp_check_device(const char *op, const char *arg, const tp_tensor *t, tp_device_t device, int device_id);

/* A stream belongs to a device that queues work; the CPU runs every call synchronously and
 * takes NULL only (a stream there is a caller's mistake, e.g. a CUDA stream with host tensors). */
static inline tp_status_t tp_check_stream(const char *op, tp_device_t device, tp_stream_t stream) {
  if (!stream || device != TP_DEVICE_CPU) return TP_SUCCESS;
  return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                      "%s: a stream was given for cpu memory, which runs every call "
                      "synchronously; pass NULL",
                      op);
}

#endif
