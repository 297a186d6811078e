/* The CUDA plugin's loader (cuda_load.c), beyond the public tp_cuda_load / tp_cuda_status
 * of tpcore/device.h: what build_info reports. */
#ifndef TPCORE_CUDA_LOAD_H
#define TPCORE_CUDA_LOAD_H

/* The loaded plugin's file and build line ("" before a successful tp_cuda_load). */
const char *tp_cuda_plugin_path(void);
const char *tp_cuda_plugin_build(void);

#endif
