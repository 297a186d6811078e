/*
 * The CUDA plugin's ABI (private): the contract between the host side of tpcore (the
 * C core inside tpcore._C or a C program's libtpcore.a, which never links CUDA) and
 * libtpcore_cuda.so (built by nvcc from csrc/cuda/plugin/ and csrc/cuda/kernels/, the CUDA
 * runtime linked statically).
 *
 * Loading (csrc/cuda/cuda_load.c, tp_cuda_load in include/tpcore/device.h, through the
 * core's plugin opener csrc/core/plugin.h): the host dlopens the plugin (RTLD_LOCAL), looks up the one symbol TP_CUDA_PLUGIN_ENTRY, and
 * calls it with its tp_cuda_host_api.  The plugin checks abi_version, keeps the host
 * table, and fills a tp_cuda_plugin with its tables.  The host then registers them:
 * the device table in the device registry (csrc/devices/device.c), the kernel table
 * in the kernel registry (csrc/kernels/registry.c).  Nothing else crosses.
 *
 * Why a host table: _C is built with hidden visibility and Python loads extensions
 * RTLD_LOCAL, so the plugin cannot link against the core's symbols.  Everything the
 * plugin needs from the core comes through tp_cuda_host_api: the error record (so a
 * CUDA error becomes tp_last_error() of the caller's thread, like every other error)
 * and the library finder (so cuBLAS is searched for exactly as NCCL is).  Stateless
 * helpers (csrc/core/dtype.c, static inlines of core_impl.h) are compiled into the
 * plugin as well; csrc/cuda/plugin/host_shim.c defines tp_set_error / tp_error_prefix /
 * tp_clear_error in the plugin as forwarders to the host table, so kernel and device
 * code is written exactly like the CPU's.
 *
 * Versioning: TP_CUDA_PLUGIN_ABI is bumped on any change of these structs or of
 * tp_device_ops / tp_kernel_ops; a plugin of another ABI, or of another tpcore
 * version (tp_cuda_plugin.tpcore_version), is refused with a sentence naming both.
 */
#ifndef TPCORE_CUDA_PLUGIN_ABI_H
#define TPCORE_CUDA_PLUGIN_ABI_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "tpcore/device.h"
#include "tpcore/tpcore.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TP_CUDA_PLUGIN_ABI 3
#define TP_CUDA_PLUGIN_ENTRY "tp_cuda_plugin_init_v1"
#define TP_CUDA_PLUGIN_SONAME "libtpcore_cuda.so"

struct tp_kernel_ops; /* csrc/kernels/kernels_impl.h */

/* What the host gives the plugin. */
typedef struct tp_cuda_host_api {
  uint32_t abi_version; /* TP_CUDA_PLUGIN_ABI */
  uint32_t size;        /* sizeof(tp_cuda_host_api) */
  const char *tpcore_version;
  /* The caller thread's error record (tp_set_error semantics: returns status). */
  tp_status_t (*set_error_v)(tp_status_t status, const char *fmt, va_list ap);
  void (*error_prefix_v)(const char *fmt, va_list ap);
  void (*clear_error)(void);
  /* The library finder of csrc/core/dynlib.h: opens a library by its search order
   * (override variable, directories the Python side registered (nvidia-* wheels),
   * CUDA_HOME / CUDA_PATH, /usr/local/cuda, the loader path), RTLD_NOW | RTLD_LOCAL.
   * NULL with the error set (every place tried, in order) when none loads. */
  void *(*open_library)(const char *what, const char *override_env, const char *const *sonames, int nsonames);
  double (*now)(void);
} tp_cuda_host_api;

/* What the plugin gives back. */
typedef struct tp_cuda_plugin {
  uint32_t abi_version;        /* TP_CUDA_PLUGIN_ABI */
  uint32_t size;               /* sizeof(tp_cuda_plugin) */
  const char *tpcore_version;  /* TP_VERSION_STRING the plugin was built from */
  const char *build;           /* "CUDA 13.0, sm_80 sm_90 + compute_90 PTX, cudart static" */
  const tp_device_ops *device; /* type TP_DEVICE_CUDA */
  const struct tp_kernel_ops *kernels;
  /* Why CUDA is usable or not, one line: "2 devices (NVIDIA H200, driver 13.0)",
   * "no NVIDIA driver (libcuda.so.1 not found)", "driver too old: it supports CUDA 12.4,
   * this build needs 13.0", "no device (CUDA_VISIBLE_DEVICES='')".  Never NULL. */
  const char *(*status)(void);
} tp_cuda_plugin;

/* The plugin's one exported symbol (named TP_CUDA_PLUGIN_ENTRY). */
typedef tp_status_t (*tp_cuda_plugin_init_fn)(const tp_cuda_host_api *host, tp_cuda_plugin *out);

#ifdef __cplusplus
}
#endif
#endif /* TPCORE_CUDA_PLUGIN_ABI_H */
