/* Private side of the device table: the registry's entries (one line per device in
 * device.c) and the checks layers and kernels share. */
#ifndef TPCORE_DEVICE_IMPL_H
#define TPCORE_DEVICE_IMPL_H

#include "../core/core_impl.h"
#include "tpcore/device.h"

extern const tp_device_ops tp_cpu_device_ops;

/* TP_SUCCESS when t lives on `device`, else an argument error naming op and arg. */
tp_status_t tp_check_device(const char *op, const char *arg, const tp_tensor *t, tp_device_t device, int device_id);

#endif
