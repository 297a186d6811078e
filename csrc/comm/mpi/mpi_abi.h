/*
 * The MPI plugin's ABI (private): the contract between the core (csrc/comm/mpi/mpi_load.c,
 * which registers the "mpi" line of the backend registry in every build) and
 * libtpcore_mpi.so (csrc/comm/mpi/plugin/mpi.c and mpi_ops.c, the only files that include <mpi.h>,
 * built with mpicc's flags when an MPI is found, linked to libmpi).
 *
 * The core dlopens the plugin (RTLD_LOCAL), promotes the libmpi it pulled in to
 * RTLD_GLOBAL (Open MPI's components are plugins that need libmpi's symbols), looks up
 * TP_MPI_PLUGIN_ENTRY and calls it with its tp_mpi_host_api; the plugin checks the ABI
 * and fills a tp_mpi_plugin.  The plugin reaches the core only through the host table
 * (the extension is built with hidden symbols and loaded RTLD_LOCAL); it reads and
 * writes struct tp_comm (comm_impl.h) directly, so the table carries its size and the
 * tpcore version, and a plugin of another build is refused.
 */
#ifndef TPCORE_MPI_ABI_H
#define TPCORE_MPI_ABI_H

#include <stdarg.h>
#include <stdint.h>

#include "../comm_impl.h"

#define TP_MPI_PLUGIN_ABI 1
#define TP_MPI_PLUGIN_ENTRY "tp_mpi_plugin_init_v1"
#define TP_MPI_PLUGIN_SONAME "libtpcore_mpi.so"

typedef struct tp_mpi_host_api {
  uint32_t abi_version;       /* TP_MPI_PLUGIN_ABI */
  uint32_t size;              /* sizeof(tp_mpi_host_api) */
  const char *tpcore_version; /* "0.x.y" */
  uint32_t comm_struct_size;  /* sizeof(struct tp_comm) */
  tp_status_t (*set_error_v)(tp_status_t status, const char *fmt, va_list ap);
  void (*error_prefix_v)(const char *fmt, va_list ap);
  void (*clear_error)(void);
  const char *(*last_error)(void);
  double (*now)(void);
  size_t (*dtype_size)(tp_dtype_t dtype);
  const char *(*dtype_name)(tp_dtype_t dtype);
  const char *(*redop_name)(tp_redop_t op);
  const char *(*coll_name)(tp_coll_kind_t kind);
  /* comm_impl.h */
  tp_status_t (*comm_alloc)(struct tp_comm **out, int world, int rank, const char *job_id, double timeout_s,
                            int spin_us);
  void (*comm_mark_failed)(struct tp_comm *comm, tp_status_t status, const char *msg);
  /* reduce_impl.h: the kernels of the shm backend, so both reduce alike (NaN, wrap-around, 16-bit) */
  void (*reduce_n)(void *dst, void *dst2, const void *const *srcs, int nsrc, size_t n, tp_dtype_t dtype, tp_redop_t op);
} tp_mpi_host_api;

typedef struct tp_mpi_plugin {
  uint32_t abi_version;       /* TP_MPI_PLUGIN_ABI */
  uint32_t size;              /* sizeof(tp_mpi_plugin) */
  const char *tpcore_version; /* the version the plugin was built from */
  const char *build;          /* "Open MPI v4.1.4 (headers of MPI 3.1)" */
  /* The registry's init (comm_impl.h): world_comm 1 dups MPI_COMM_WORLD (MPI_Init_thread first). */
  tp_status_t (*comm_init)(struct tp_comm *comm, const char *comm_id, int world_comm);
  /* The library actually loaded (MPI_Get_library_version's first line), or "" before init. */
  const char *(*library)(void);
} tp_mpi_plugin;

typedef tp_status_t (*tp_mpi_plugin_init_fn)(const tp_mpi_host_api *host, tp_mpi_plugin *out);

#endif
