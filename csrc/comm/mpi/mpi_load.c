/*
 * The "mpi" line of the backend registry: opens libtpcore_mpi.so (mpi_abi.h; built from
 * plugin/) on first use, once per process, with the core's plugin opener (core/plugin.h),
 * and hands it the host table.  Every build has the line; whether this machine can run it
 * (plugin built, libmpi loadable) is what tp_mpi_usable says.
 *
 * Search order: $TPCORE_MPI_PLUGIN (the only place tried when set), then beside the core
 * (tpcore/.libs for the extension, build/ for the Makefile's programs), then the loader
 * path.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <string.h>

#include "../../core/plugin.h"
#include "../reduce_impl.h"
#include "mpi_abi.h"

static const tp_mpi_host_api host_api = {
    .abi_version = TP_MPI_PLUGIN_ABI,
    .size = sizeof(tp_mpi_host_api),
    .tpcore_version = TP_HOST_VERSION,
    .comm_struct_size = sizeof(struct tp_comm),
    .set_error_v = tp_plugin_set_error_v,
    .error_prefix_v = tp_plugin_error_prefix_v,
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

static tp_plugin_once once = TP_PLUGIN_ONCE_INIT;
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

static const tp_plugin_spec spec = {
    .what = "MPI plugin",
    .env_name = "TPCORE_MPI_PLUGIN",
    .soname = TP_MPI_PLUGIN_SONAME,
    .entry = TP_MPI_PLUGIN_ENTRY,
    .abi = TP_MPI_PLUGIN_ABI,
    .reply_size = sizeof(tp_mpi_plugin),
    .rebuild = "pip install . or make",
    .before_entry = promote_mpi_libraries,
};

static tp_status_t load_once(void *unused) {
  union {
    tp_mpi_plugin p;
    unsigned char room[TP_PLUGIN_REPLY_MAX];
  } out;
  const char *file;
  tp_status_t s = tp_plugin_load(&spec, NULL, &host_api, &out, &file);
  if (s != TP_SUCCESS) {
    const char *e = tp_last_error();
    if (strstr(e, "libmpi") && strstr(e, "did not load")) /* the plugin is there, its libmpi is not */
      tp_error_prefix("libmpi is not loadable (install Open MPI: libopenmpi-dev openmpi-bin)");
    else if (strstr(e, "this build has no"))
      tp_error_prefix("the MPI plugin was not built (no mpicc when tpcore was built, or TPCORE_MPI=0)");
    return s;
  }
  if (!out.p.comm_init || !out.p.library)
    return tp_set_error(TP_ERR_UNSUPPORTED,
                        "the MPI plugin %s gave no comm_init or library entry: rebuild "
                        "tpcore and its plugin together (pip install . or make)",
                        file);
  plugin = out.p;
  return TP_SUCCESS;
}

static tp_status_t load(void) { return tp_plugin_once_run(&once, load_once, NULL); }

tp_status_t tp_mpi_usable(void) { return load(); }

tp_status_t tp_mpi_comm_init(struct tp_comm *comm, const char *comm_id, int world_comm) {
  TP_CHECK(load());
  return plugin.comm_init(comm, comm_id, world_comm);
}
