/* The kernel registry: the CPU's table is built in; another device's (CUDA's, from the
 * plugin: cuda/cuda_load.c) is registered at run time with tp_kernels_register, once per
 * type, under a lock, before its first use. */
#include <pthread.h>

#include "kernels_impl.h"
#include "tpcore/device.h"

static const tp_kernel_ops *registry_slots[TP_NUM_DEVICE_TYPES] = {
    [TP_DEVICE_CPU] = &tp_cpu_kernel_ops,
};
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;

tp_status_t tp_kernels_register(tp_device_t device, const tp_kernel_ops *ops) {
  if ((unsigned)device >= TP_NUM_DEVICE_TYPES || device == TP_DEVICE_CPU || !ops)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "kernels_register: device type %d or its table is invalid",
                        (int)device);
  /* Every entry is required: the parity harness runs each of them. */
  const char *missing = NULL;
#define TP_REG_CHECK_(name) \
  if (!missing && !ops->name) missing = #name;
  TP_KERNEL_ENTRIES(TP_REG_CHECK_)
#undef TP_REG_CHECK_
  if (missing)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "kernels_register: the %s kernel table lacks %s",
                        tp_device_name(device), missing);
  pthread_mutex_lock(&registry_lock);
  const tp_kernel_ops *cur = registry_slots[device];
  if (!cur) __atomic_store_n(&registry_slots[device], ops, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&registry_lock);
  if (cur && cur != ops)
    return tp_set_error(TP_ERR_INVALID_USAGE, "kernels_register: a %s kernel table is registered already",
                        tp_device_name(device));
  return TP_SUCCESS;
}

const tp_kernel_ops *tp_kernels_of(tp_device_t device) {
  if ((unsigned)device >= TP_NUM_DEVICE_TYPES) return NULL;
  const tp_kernel_ops *ops = __atomic_load_n(&registry_slots[device], __ATOMIC_ACQUIRE);
  return ops && tp_device_available(device) ? ops : NULL;
}
