/* The plugin's one exported symbol, TP_CUDA_PLUGIN_ENTRY (plugin_abi.h): checks the
 * host's ABI, keeps its table (host_shim.c forwards the error record and the library
 * finder to it) and hands back the device table, the kernel table and the status. */
#include <stdio.h>

#include "cuda_plugin_impl.h"

#define TP_ENTRY_STR2_(x) #x
#define TP_ENTRY_STR_(x) TP_ENTRY_STR2_(x)
#define TP_PLUGIN_VERSION \
  TP_ENTRY_STR_(TP_VERSION_MAJOR) "." TP_ENTRY_STR_(TP_VERSION_MINOR) "." TP_ENTRY_STR_(TP_VERSION_PATCH)
#ifndef TP_CUDA_ARCH_STR /* set by the build (setup.py, Makefile): the machine code it holds */
#define TP_CUDA_ARCH_STR "unknown archs"
#endif

/* The kernel table: csrc/cuda/kernels/table.c. */
extern const struct tp_kernel_ops tp_cuda_kernel_ops __attribute__((visibility("hidden")));

const tp_cuda_host_api *tp_cuda_host;

__attribute__((visibility("default"))) tp_status_t tp_cuda_plugin_init_v1(const tp_cuda_host_api *host,
                                                                          tp_cuda_plugin *out);

tp_status_t tp_cuda_plugin_init_v1(const tp_cuda_host_api *host, tp_cuda_plugin *out) {
  static char build[160];
  if (!out) return TP_ERR_INVALID_ARGUMENT;
  out->abi_version = TP_CUDA_PLUGIN_ABI; /* first: the host reads it even when we refuse */
  out->size = sizeof(tp_cuda_plugin);
  out->tpcore_version = TP_PLUGIN_VERSION;
  /* A host of another ABI: its table's layout is unknown, so nothing of it is used. */
  if (!host || host->abi_version != TP_CUDA_PLUGIN_ABI || host->size < sizeof(tp_cuda_host_api))
    return TP_ERR_UNSUPPORTED;
  if (!host->set_error_v || !host->error_prefix_v || !host->clear_error || !host->open_library || !host->now)
    return TP_ERR_INVALID_ARGUMENT;
  tp_cuda_host = host;
  snprintf(build, sizeof build, "%s, %s, cudart static", tp_cuda_runtime_name(), TP_CUDA_ARCH_STR);
  out->build = build;
  out->device = &tp_cuda_device_ops;
  out->kernels = &tp_cuda_kernel_ops;
  out->status = tp_cuda_status_line;
  return TP_SUCCESS;
}
