/* Loading the CUDA plugin (libtpcore_cuda.so; the ABI is csrc/cuda/plugin_abi.h).
 *
 * tp_cuda_load(path) runs once per process (later calls return the first result):
 * dlopen(RTLD_NOW | RTLD_LOCAL) of, in order, the path argument, $TPCORE_CUDA_PLUGIN
 * (either one, when given, is the only place tried), the file beside the loaded core
 * (dladdr of this function: <dir>/.libs/ and <dir>/, which is tpcore/.libs/ for the
 * extension and build/ for a C program built by the Makefile), and the loader path.
 * The plugin's entry is called with the host table; its ABI and tpcore version are
 * checked, then its device and kernel tables are registered in the registries. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../cuda/plugin_abi.h"
#include "../devices/device_impl.h"
#include "../kernels/kernels_impl.h"
#include "dynlib.h"

#define TP_PLUGIN_STR2_(x) #x
#define TP_PLUGIN_STR_(x) TP_PLUGIN_STR2_(x)
#define TP_HOST_VERSION \
  TP_PLUGIN_STR_(TP_VERSION_MAJOR) "." TP_PLUGIN_STR_(TP_VERSION_MINOR) "." TP_PLUGIN_STR_(TP_VERSION_PATCH)

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static int load_done;                 /* under load_lock; read with acquire */
static tp_status_t load_status;       /* the first call's result */
static char load_error[1536];         /* why it failed, for tp_cuda_status and later calls */
static char plugin_path[1024];
static char plugin_build[256];
static tp_cuda_plugin plugin;         /* the plugin's tables, valid when load_status == TP_SUCCESS */

static tp_status_t host_set_error_v(tp_status_t status, const char *fmt, va_list ap) {
  char buf[2048];
  vsnprintf(buf, sizeof buf, fmt, ap);
  return tp_set_error(status, "%s", buf);
}

static void host_error_prefix_v(const char *fmt, va_list ap) {
  char buf[512];
  vsnprintf(buf, sizeof buf, fmt, ap);
  tp_error_prefix("%s", buf);
}

static const tp_cuda_host_api host_api = {
    .abi_version = TP_CUDA_PLUGIN_ABI,
    .size = sizeof(tp_cuda_host_api),
    .tpcore_version = TP_HOST_VERSION,
    .set_error_v = host_set_error_v,
    .error_prefix_v = host_error_prefix_v,
    .clear_error = tp_clear_error,
    .open_library = tp_dynlib_open,
    .now = tp_now,
};

/* dlopen of one candidate; a file that exists but does not load is remembered as the
 * most telling failure. */
static void *try_plugin(const char *path, char *tried, size_t cap, char *bad, size_t badcap) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h) return h;
  const char *err = dlerror();
  size_t len = strlen(tried);
  if (len < cap) snprintf(tried + len, cap - len, "%s%s", len ? ", " : "", path);
  int exists = strchr(path, '/') ? access(path, F_OK) == 0 : (err && !strstr(err, "No such file"));
  if (exists && !bad[0]) snprintf(bad, badcap, "%s", err ? err : "unknown dlopen error");
  return NULL;
}

/* A separately built plugin (what: "CUDA plugin"; soname: libtpcore_cuda.so): path when
 * given, else $env_name when set (either one is then the only place tried), else beside the
 * loaded core (<dir>/.libs/, <dir>/) and the loader path.  NULL with the error set. */
void *tp_plugin_open(const char *what, const char *env_name, const char *soname, const char *path) {
  dlerror();
  if (!path || !*path) {
    const char *env = getenv(env_name);
    if (env && *env) {
      void *h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
      if (h) return h;
      const char *err = dlerror();
      tp_set_error(TP_ERR_UNSUPPORTED, "cannot load the %s from %s=%s: %s", what, env_name, env,
                   err ? err : "unknown dlopen error");
      return NULL;
    }
  } else {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h) return h;
    const char *err = dlerror();
    tp_set_error(TP_ERR_UNSUPPORTED, "cannot load the %s %s: %s", what, path, err ? err : "unknown dlopen error");
    return NULL;
  }
  char tried[1024] = "", bad[512] = "", file[1024];
  Dl_info info;
  if (dladdr((void *)tp_plugin_open, &info) && info.dli_fname && strchr(info.dli_fname, '/')) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", info.dli_fname);
    *strrchr(dir, '/') = '\0';
    const char *subs[] = {"/.libs/", "/"};
    for (int i = 0; i < 2; i++) {
      if ((size_t)snprintf(file, sizeof file, "%s%s%s", dir, subs[i], soname) >= sizeof file) continue;
      void *h = try_plugin(file, tried, sizeof tried, bad, sizeof bad);
      if (h) return h;
    }
  }
  void *h = try_plugin(soname, tried, sizeof tried, bad, sizeof bad);
  if (h) return h;
  if (bad[0])
    tp_set_error(TP_ERR_UNSUPPORTED, "the %s was found but did not load: %s (tried %s)", what, bad, tried);
  else
    tp_set_error(TP_ERR_UNSUPPORTED, "this build has no %s (tried %s; %s names another file)", what, tried,
                 env_name);
  return NULL;
}

static void *open_plugin(const char *path) {
  return tp_plugin_open("CUDA plugin", "TPCORE_CUDA_PLUGIN", TP_CUDA_PLUGIN_SONAME, path);
}

static const char *where(void *h, const char *fallback) {
  const char *p = tp_dynlib_path(h);
  return p && *p ? p : fallback;
}

static tp_status_t load_once(const char *path) {
  void *h = open_plugin(path);
  if (!h) return tp_last_status();
  const char *file = where(h, path ? path : "libtpcore_cuda.so");
  dlerror();
  tp_cuda_plugin_init_fn init = (tp_cuda_plugin_init_fn)dlsym(h, TP_CUDA_PLUGIN_ENTRY);
  if (!init) {
    tp_set_error(TP_ERR_UNSUPPORTED, "%s is not a tpcore CUDA plugin: it has no symbol %s", file,
                 TP_CUDA_PLUGIN_ENTRY);
    dlclose(h);
    return TP_ERR_UNSUPPORTED;
  }
  /* Room beyond our struct: a plugin of another ABI may write a larger one. */
  union {
    tp_cuda_plugin p;
    unsigned char room[1024];
  } out;
  memset(&out, 0, sizeof out);
  tp_clear_error();
  tp_status_t s = init(&host_api, &out.p);
  if (out.p.abi_version != TP_CUDA_PLUGIN_ABI) {
    tp_set_error(TP_ERR_UNSUPPORTED, "the CUDA plugin %s has plugin ABI %u (tpcore %s), but this tpcore %s needs "
                 "ABI %d: rebuild tpcore and its plugin together (pip install . or make CUDA=1)", file,
                 (unsigned)out.p.abi_version, out.p.tpcore_version ? out.p.tpcore_version : "unknown",
                 TP_HOST_VERSION, TP_CUDA_PLUGIN_ABI);
    return TP_ERR_UNSUPPORTED; /* not closed: its code may still be referenced by what it returned */
  }
  if (s != TP_SUCCESS) {
    tp_error_prefix("the CUDA plugin %s failed to start", file);
    return s;
  }
  if (out.p.size < sizeof(tp_cuda_plugin) || !out.p.tpcore_version || strcmp(out.p.tpcore_version, TP_HOST_VERSION)) {
    return tp_set_error(TP_ERR_UNSUPPORTED, "the CUDA plugin %s was built from tpcore %s, but this is tpcore %s: "
                        "rebuild them together (pip install . or make CUDA=1)", file,
                        out.p.tpcore_version ? out.p.tpcore_version : "unknown", TP_HOST_VERSION);
  }
  if (!out.p.device || !out.p.status || out.p.device->type != TP_DEVICE_CUDA)
    return tp_set_error(TP_ERR_UNSUPPORTED, "the CUDA plugin %s gave no CUDA device table", file);
  plugin = out.p;
  snprintf(plugin_path, sizeof plugin_path, "%s", file);
  snprintf(plugin_build, sizeof plugin_build, "%s", plugin.build ? plugin.build : "");
  /* Kernels first: an incomplete table fails the load before the device is registered, so
   * the device is usable exactly when the load succeeded.  The kernel table may be absent
   * from a plugin built before its kernels (kernels NULL): the device alone is registered. */
  if ((plugin.kernels && tp_kernels_register(TP_DEVICE_CUDA, plugin.kernels) != TP_SUCCESS) ||
      tp_device_register(plugin.device) != TP_SUCCESS) {
    char why[1024];
    snprintf(why, sizeof why, "%s", tp_last_error()); /* not formatted from the buffer it overwrites */
    return tp_set_error(TP_ERR_UNSUPPORTED, "the CUDA plugin %s: %s", file, why); /* the plugin's fault */
  }
  return TP_SUCCESS;
}

tp_status_t tp_cuda_load(const char *path) {
  if (!__atomic_load_n(&load_done, __ATOMIC_ACQUIRE)) {
    pthread_mutex_lock(&load_lock);
    if (!load_done) {
      load_status = load_once(path);
      snprintf(load_error, sizeof load_error, "%s", load_status ? tp_last_error() : "");
      __atomic_store_n(&load_done, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&load_lock);
  }
  if (load_status != TP_SUCCESS) return tp_set_error(load_status, "%s", load_error);
  return TP_SUCCESS;
}

const char *tp_cuda_status(void) {
  static _Thread_local char line[1600];
  if (!__atomic_load_n(&load_done, __ATOMIC_ACQUIRE)) return "not loaded: nothing has used CUDA yet";
  if (load_status != TP_SUCCESS) {
    snprintf(line, sizeof line, "not loaded: %s", load_error);
    return line;
  }
  const char *s = plugin.status();
  return s ? s : "unknown";
}

const char *tp_cuda_plugin_path(void) {
  return __atomic_load_n(&load_done, __ATOMIC_ACQUIRE) && load_status == TP_SUCCESS ? plugin_path : "";
}

const char *tp_cuda_plugin_build(void) {
  return __atomic_load_n(&load_done, __ATOMIC_ACQUIRE) && load_status == TP_SUCCESS ? plugin_build : "";
}
