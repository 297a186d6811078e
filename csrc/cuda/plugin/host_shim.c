/* Inside the plugin, the core's helpers that kernel and device code call
 * (core_impl.h, dynlib.h) forward to the host table (plugin_abi.h): an error set here
 * is tp_last_error() of the caller's thread in the host, and cuBLAS is searched for as
 * NCCL is.  tp_dynlib_sym and tp_dynlib_path need no host state and run here. */
#include <dlfcn.h>
#include <link.h>
#include <stdarg.h>
#include <stdio.h>

#include "../../core/dynlib.h"
#include "cuda_plugin_impl.h"

tp_status_t tp_set_error(tp_status_t status, const char *fmt, ...) {
  if (!tp_cuda_host) return status;
  va_list ap;
  va_start(ap, fmt);
  tp_status_t s = tp_cuda_host->set_error_v(status, fmt, ap);
  va_end(ap);
  return s;
}

void tp_error_prefix(const char *fmt, ...) {
  if (!tp_cuda_host) return;
  va_list ap;
  va_start(ap, fmt);
  tp_cuda_host->error_prefix_v(fmt, ap);
  va_end(ap);
}

void tp_clear_error(void) {
  if (tp_cuda_host) tp_cuda_host->clear_error();
}

double tp_now(void) { return tp_cuda_host ? tp_cuda_host->now() : 0.0; }

void *tp_dynlib_open(const char *what, const char *override_env, const char *const *sonames, int nsonames) {
  if (!tp_cuda_host) return NULL;
  return tp_cuda_host->open_library(what, override_env, sonames, nsonames);
}
