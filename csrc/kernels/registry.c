/* The kernel registry: one line per device type.  A device's kernels are a file that
 * fills a tp_kernel_ops (cpu/table.c; cuda/table.c in CUDA builds) plus its line here. */
#include "kernels_impl.h"
#include "tpcore/device.h"

#ifdef TP_WITH_CUDA
extern const tp_kernel_ops tp_cuda_kernel_ops;
#endif

static const tp_kernel_ops *const registry[TP_NUM_DEVICE_TYPES] = {
    [TP_DEVICE_CPU] = &tp_cpu_kernel_ops,
#ifdef TP_WITH_CUDA
    [TP_DEVICE_CUDA] = &tp_cuda_kernel_ops,
#endif
};

const tp_kernel_ops *tp_kernels_of(tp_device_t device) {
  if ((unsigned)device >= TP_NUM_DEVICE_TYPES || !registry[device]) return NULL;
  return tp_device_available(device) ? registry[device] : NULL;
}
