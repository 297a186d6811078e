/*
 * The "mpi" line of the backend registry: opens libtpcore_mpi.so (mpi_abi.h) on first
 * use, once per process, and hands it the host table.  Every build has the line; whether
 * this machine can run it (plugin built, libmpi loadable) is what tp_mpi_usable says.
 *
 * Search order: $TPCORE_MPI_PLUGIN (the only place tried when set), then beside the core
 * (tpcore/.libs for the extension, build/ for the Makefile's programs), then the loader
 * path (plugin.c's tp_plugin_open).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "../core/dynlib.h"
#include "mpi_abi.h"
#include "reduce_impl.h"

#define TP_MPI_STR2_(x) #x
#define TP_MPI_STR_(x) TP_MPI_STR2_(x)
#define TP_MPI_HOST_VERSION \
  TP_MPI_STR_(TP_VERSION_MAJOR) "." TP_MPI_STR_(TP_VERSION_MINOR) "." TP_MPI_STR_(TP_VERSION_PATCH)

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

static const tp_mpi_host_api host_api = {
    .abi_version = TP_MPI_PLUGIN_ABI,
    .size = sizeof(tp_mpi_host_api),
    .tpcore_version = TP_MPI_HOST_VERSION,
    .comm_struct_size = sizeof(struct tp_comm),
    .set_error_v = host_set_error_v,
    .error_prefix_v = host_error_prefix_v,
    .clear_error = tp_clear_error,
    .last_error = tp_last_error,
    .now = tp_now,
    .dtype_size = tp_dtype_size,
    .dtype_name = tp_dtype_name,
    .redop_name = tp_redop_name,
    .coll_name = tp_coll_name,
    .comm_alloc = tp_comm_alloc_common,
    .comm_mark_failed = tp_comm_mark_failed,
    .reduce_n = tp_reduce_n,
};

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static int load_done;
static tp_status_t load_status;
static char load_error[1536];
static tp_mpi_plugin plugin;

/* Open MPI opens its components (mca_*.so) with dlopen and they resolve libmpi's and
 * libopen-pal's symbols globally: the MPI libraries the plugin pulled in RTLD_LOCAL are
 * re-opened RTLD_GLOBAL (RTLD_NOLOAD: the very same files) before MPI_Init runs. */
static void promote_mpi_libraries(void *h) {
  struct link_map *lm = NULL;
  if (dlinfo(h, RTLD_DI_LINKMAP, &lm) != 0 || !lm) return;
  while (lm->l_prev) lm = lm->l_prev;
  for (; lm; lm = lm->l_next) {
    const char *name = lm->l_name ? strrchr(lm->l_name, '/') : NULL;
    name = name ? name + 1 : lm->l_name;
    if (!name || !*name) continue;
    if (strncmp(name, "libmpi", 6) == 0 || strncmp(name, "libopen-", 8) == 0 || strncmp(name, "libpmix", 7) == 0)
      dlopen(lm->l_name, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD); /* kept open for the process's life */
  }
}

static tp_status_t load_once(void) {
  void *h = tp_plugin_open("MPI plugin", "TPCORE_MPI_PLUGIN", TP_MPI_PLUGIN_SONAME, NULL);
  if (!h) {
    const char *e = tp_last_error();
    if (strstr(e, "libmpi") && strstr(e, "did not load")) /* the plugin is there, its libmpi is not */
      tp_error_prefix("libmpi is not loadable (install Open MPI: libopenmpi-dev openmpi-bin)");
    else if (strstr(e, "this build has no"))
      tp_error_prefix("the MPI plugin was not built (no mpicc when tpcore was built, or TPCORE_MPI=0)");
    return tp_last_status();
  }
  const char *file = tp_dynlib_path(h);
  if (!file || !*file) file = TP_MPI_PLUGIN_SONAME;
  promote_mpi_libraries(h);
  dlerror();
  tp_mpi_plugin_init_fn init = (tp_mpi_plugin_init_fn)dlsym(h, TP_MPI_PLUGIN_ENTRY);
  if (!init) {
    tp_set_error(TP_ERR_UNSUPPORTED, "%s is not a tpcore MPI plugin: it has no symbol %s", file, TP_MPI_PLUGIN_ENTRY);
    dlclose(h);
    return TP_ERR_UNSUPPORTED;
  }
  union {
    tp_mpi_plugin p;
    unsigned char room[512];
  } out;
  memset(&out, 0, sizeof out);
  tp_clear_error();
  tp_status_t s = init(&host_api, &out.p);
  if (out.p.abi_version != TP_MPI_PLUGIN_ABI)
    return tp_set_error(TP_ERR_UNSUPPORTED, "the MPI plugin %s has plugin ABI %u, but this tpcore %s needs ABI %d: "
                        "rebuild tpcore and its plugin together (pip install . or make)", file,
                        (unsigned)out.p.abi_version, TP_MPI_HOST_VERSION, TP_MPI_PLUGIN_ABI);
  if (s != TP_SUCCESS) {
    tp_error_prefix("the MPI plugin %s failed to start", file);
    return s;
  }
  if (out.p.size < sizeof(tp_mpi_plugin) || !out.p.tpcore_version ||
      strcmp(out.p.tpcore_version, TP_MPI_HOST_VERSION) || !out.p.comm_init || !out.p.library)
    return tp_set_error(TP_ERR_UNSUPPORTED, "the MPI plugin %s was built from tpcore %s, but this is tpcore %s: "
                        "rebuild them together (pip install . or make)", file,
                        out.p.tpcore_version ? out.p.tpcore_version : "unknown", TP_MPI_HOST_VERSION);
  plugin = out.p;
  return TP_SUCCESS;
}

static tp_status_t load(void) {
  if (!__atomic_load_n(&load_done, __ATOMIC_ACQUIRE)) {
    pthread_mutex_lock(&load_lock);
    if (!load_done) {
      load_status = load_once();
      snprintf(load_error, sizeof load_error, "%s", load_status ? tp_last_error() : "");
      __atomic_store_n(&load_done, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&load_lock);
  }
  if (load_status != TP_SUCCESS) return tp_set_error(load_status, "%s", load_error);
  return TP_SUCCESS;
}

tp_status_t tp_mpi_usable(void) { return load(); }

tp_status_t tp_mpi_comm_init(struct tp_comm *comm, const char *comm_id, int world_comm) {
  TP_CHECK(load());
  return plugin.comm_init(comm, comm_id, world_comm);
}
