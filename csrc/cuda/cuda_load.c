/* The host side of the CUDA device: loading libtpcore_cuda.so (its ABI: plugin_abi.h)
 * and registering its tables.  Part of the core (it links no CUDA); the plugin itself is
 * built from plugin/ and kernels/ beside this file.
 *
 * tp_cuda_load(path) runs once per process (later calls return the first result): the
 * plugin opener (core/plugin.h) tries, in order, the path argument, $TPCORE_CUDA_PLUGIN
 * (either one, when given, is the only place tried), the file beside the loaded core
 * (tpcore/.libs/ for the extension, build/ for a C program built by the Makefile) and the
 * loader path, starts the plugin with the host table and checks its ABI and tpcore
 * version; then its kernel table goes to the kernel registry and its device table to the
 * device registry. */
#include <stdio.h>
#include <string.h>

#include "../core/dynlib.h"
#include "../core/plugin.h"
#include "../devices/device_impl.h"
#include "../kernels/kernels_impl.h"
#include "cuda_load.h"
#include "plugin_abi.h"

static tp_plugin_once once = TP_PLUGIN_ONCE_INIT;
static char plugin_path[1024];
static char plugin_build[256];
static tp_cuda_plugin plugin; /* the plugin's tables, valid when the load succeeded */

static const tp_cuda_host_api host_api = {
    .abi_version = TP_CUDA_PLUGIN_ABI,
    .size = sizeof(tp_cuda_host_api),
    .tpcore_version = TP_HOST_VERSION,
    .set_error_v = tp_plugin_set_error_v,
    .error_prefix_v = tp_plugin_error_prefix_v,
    .clear_error = tp_clear_error,
    .open_library = tp_dynlib_open,
    .now = tp_now,
};

static const tp_plugin_spec spec = {
    .what = "CUDA plugin",
    .env_name = "TPCORE_CUDA_PLUGIN",
    .soname = TP_CUDA_PLUGIN_SONAME,
    .entry = TP_CUDA_PLUGIN_ENTRY,
    .abi = TP_CUDA_PLUGIN_ABI,
    .reply_size = sizeof(tp_cuda_plugin),
    .rebuild = "pip install . or make CUDA=1",
};

static tp_status_t load_once(void *arg) {
  union {
    tp_cuda_plugin p;
    unsigned char room[TP_PLUGIN_REPLY_MAX];
  } out;
  const char *file;
  TP_CHECK(tp_plugin_load(&spec, (const char *)arg, &host_api, &out, &file));
  if (!out.p.device || !out.p.status || out.p.device->type != TP_DEVICE_CUDA)
    return tp_set_error(TP_ERR_UNSUPPORTED, "the CUDA plugin %s gave no CUDA device table", file);
  plugin = out.p;
  snprintf(plugin_path, sizeof plugin_path, "%s", file);
  snprintf(plugin_build, sizeof plugin_build, "%s", plugin.build ? plugin.build : "");
  /* Kernels first: an incomplete table fails the load before the device is registered, so
   * the device is usable exactly when the load succeeded.  A plugin without a kernel table
   * (kernels NULL) registers its device alone. */
  if ((plugin.kernels && tp_kernels_register(TP_DEVICE_CUDA, plugin.kernels) != TP_SUCCESS) ||
      tp_device_register(plugin.device) != TP_SUCCESS) {
    char why[1024];
    snprintf(why, sizeof why, "%s", tp_last_error()); /* not formatted from the buffer it overwrites */
    return tp_set_error(TP_ERR_UNSUPPORTED, "the CUDA plugin %s: %s", file, why); /* the plugin's fault */
  }
  return TP_SUCCESS;
}

static int loaded(void) { return tp_plugin_once_done(&once) && once.status == TP_SUCCESS; }

tp_status_t tp_cuda_load(const char *path) { return tp_plugin_once_run(&once, load_once, (void *)path); }

const char *tp_cuda_status(void) {
  static _Thread_local char line[1600];
  if (!tp_plugin_once_done(&once)) return "not loaded: nothing has used CUDA yet";
  if (once.status != TP_SUCCESS) {
    snprintf(line, sizeof line, "not loaded: %s", once.error);
    return line;
  }
  const char *s = plugin.status();
  return s ? s : "unknown";
}

const char *tp_cuda_plugin_path(void) { return loaded() ? plugin_path : ""; }

const char *tp_cuda_plugin_build(void) { return loaded() ? plugin_build : ""; }
