/* Private to the CUDA plugin (csrc/cuda/plugin/): what its files share.  Included by C (entry.c,
 * host_shim.c) and C++ (device_cuda.cu). */
#ifndef TPCORE_CUDA_PLUGIN_IMPL_H
#define TPCORE_CUDA_PLUGIN_IMPL_H

#include "../plugin_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The host table given to the entry (host_shim.c forwards tp_set_error & co to it). */
extern const tp_cuda_host_api *tp_cuda_host;

/* device_cuda.cu: the device table and the status line ("2 devices (NVIDIA H200, driver
 * 13.0)", "no NVIDIA driver (libcuda.so.1 not found)", ...).  The probe runs once. */
extern const tp_device_ops tp_cuda_device_ops;
const char *tp_cuda_status_line(void);
/* "CUDA 13.0" of the runtime this plugin was built with. */
const char *tp_cuda_runtime_name(void);

#ifdef __cplusplus
}
#endif
#endif
