/* The plugin opener (plugin.h): finding, opening, starting and checking a plugin built
 * apart from the core, and the once-per-process guard around it. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dynlib.h"
#include "plugin.h"

tp_status_t tp_plugin_set_error_v(tp_status_t status, const char *fmt, va_list ap) {
  char buf[2048];
  vsnprintf(buf, sizeof buf, fmt, ap);
  return tp_set_error(status, "%s", buf);
}

void tp_plugin_error_prefix_v(const char *fmt, va_list ap) {
  char buf[512];
  vsnprintf(buf, sizeof buf, fmt, ap);
  tp_error_prefix("%s", buf);
}

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

/* The one place named by the caller or the variable: its failure is the error. */
static void *open_named(const char *what, const char *place, const char *file) {
  void *h = dlopen(file, RTLD_NOW | RTLD_LOCAL);
  if (h) return h;
  const char *err = dlerror();
  tp_set_error(TP_ERR_UNSUPPORTED, "cannot load the %s %s%s: %s", what, place, file,
               err ? err : "unknown dlopen error");
  return NULL;
}

void *tp_plugin_open(const char *what, const char *env_name, const char *soname, const char *path) {
  dlerror();
  if (path && *path) return open_named(what, "", path);
  const char *env = getenv(env_name);
  if (env && *env) {
    char place[128];
    snprintf(place, sizeof place, "from %s=", env_name);
    return open_named(what, place, env);
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
  if (bad[0]) tp_set_error(TP_ERR_UNSUPPORTED, "the %s was found but did not load: %s (tried %s)", what, bad, tried);
  else
    tp_set_error(TP_ERR_UNSUPPORTED, "this build has no %s (tried %s; %s names another file)", what, tried, env_name);
  return NULL;
}

/* The reply's header, read without assuming the plugin's struct is ours. */
static tp_plugin_header header_of(const void *reply) {
  tp_plugin_header h;
  memcpy(&h, reply, sizeof h);
  return h;
}

tp_status_t tp_plugin_load(const tp_plugin_spec *spec, const char *path, const void *host, void *reply,
                           const char **file) {
  static char where[1024];
  void *h = tp_plugin_open(spec->what, spec->env_name, spec->soname, path);
  if (!h) return tp_last_status();
  const char *p = tp_dynlib_path(h);
  snprintf(where, sizeof where, "%s", p && *p ? p : path && *path ? path : spec->soname);
  *file = where;
  if (spec->before_entry) spec->before_entry(h);
  dlerror();
  tp_plugin_entry_fn entry = (tp_plugin_entry_fn)dlsym(h, spec->entry);
  if (!entry) {
    tp_set_error(TP_ERR_UNSUPPORTED, "%s is not a tpcore %s: it has no symbol %s", where, spec->what, spec->entry);
    dlclose(h);
    return TP_ERR_UNSUPPORTED;
  }
  memset(reply, 0, TP_PLUGIN_REPLY_MAX);
  tp_clear_error();
  tp_status_t s = entry(host, reply);
  tp_plugin_header got = header_of(reply);
  /* From here on the library stays open: its code may be referenced by what it returned. */
  if (got.abi_version != spec->abi)
    return tp_set_error(TP_ERR_UNSUPPORTED,
                        "the %s %s has plugin ABI %u (tpcore %s), but this tpcore %s needs "
                        "ABI %u: rebuild tpcore and its plugin together (%s)",
                        spec->what, where, (unsigned)got.abi_version,
                        got.tpcore_version ? got.tpcore_version : "unknown", TP_HOST_VERSION, (unsigned)spec->abi,
                        spec->rebuild);
  if (s != TP_SUCCESS) {
    tp_error_prefix("the %s %s failed to start", spec->what, where);
    return s;
  }
  if (got.size < spec->reply_size || !got.tpcore_version || strcmp(got.tpcore_version, TP_HOST_VERSION))
    return tp_set_error(TP_ERR_UNSUPPORTED,
                        "the %s %s was built from tpcore %s, but this is tpcore %s: "
                        "rebuild them together (%s)",
                        spec->what, where, got.tpcore_version ? got.tpcore_version : "unknown", TP_HOST_VERSION,
                        spec->rebuild);
  return TP_SUCCESS;
}

int tp_plugin_once_done(tp_plugin_once *once) { return __atomic_load_n(&once->done, __ATOMIC_ACQUIRE); }

tp_status_t tp_plugin_once_run(tp_plugin_once *once, tp_status_t (*load)(void *arg), void *arg) {
  if (!tp_plugin_once_done(once)) {
    pthread_mutex_lock(&once->lock);
    if (!once->done) {
      once->status = load(arg);
      snprintf(once->error, sizeof once->error, "%s", once->status ? tp_last_error() : "");
      __atomic_store_n(&once->done, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&once->lock);
  }
  if (once->status != TP_SUCCESS) return tp_set_error(once->status, "%s", once->error);
  return TP_SUCCESS;
}
