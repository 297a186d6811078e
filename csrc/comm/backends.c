/*
 * The registry of communicator backends: one line per backend (its name and its
 * constructor).  The first line is the default (config->backend == NULL).
 * Adding a backend is its files plus one line here, behind its build switch:
 *
 *   #ifdef TP_WITH_NCCL
 *       {"nccl", tp_nccl_comm_init},
 *   #endif
 */
#include <stdio.h>
#include <string.h>

#include "comm_impl.h"

tp_status_t tp_shm_comm_init(struct tp_comm *comm, const char *comm_id, int world_comm);
/* NCCL is opened at run time (nccl.c): every build has the backend; `usable` says
 * whether this machine can run it. */
tp_status_t tp_nccl_comm_init(struct tp_comm *comm, const char *comm_id, int world_comm);
tp_status_t tp_nccl_usable(void);
/* MPI lives in a plugin (mpi_load.c opens libtpcore_mpi.so, built when mpicc was found). */
tp_status_t tp_mpi_comm_init(struct tp_comm *comm, const char *comm_id, int world_comm);
tp_status_t tp_mpi_usable(void);

static const tp_backend_entry backends[] = {
    {"shm", tp_shm_comm_init, NULL},
    {"nccl", tp_nccl_comm_init, tp_nccl_usable},
    {"mpi", tp_mpi_comm_init, tp_mpi_usable},
};

#define NUM_BACKENDS (sizeof backends / sizeof backends[0])

const tp_backend_entry *tp_backend_find(const char *name) {
  if (!name) return &backends[0];
  for (size_t i = 0; i < NUM_BACKENDS; i++)
    if (strcmp(backends[i].name, name) == 0) return &backends[i];
  return NULL;
}

void tp_backend_names(char *buf, size_t n) {
  size_t len = 0;
  if (n) buf[0] = '\0';
  for (size_t i = 0; i < NUM_BACKENDS && len < n; i++)
    len += (size_t)snprintf(buf + len, n - len, "%s%s", i ? ", " : "", backends[i].name);
}

const char *tp_comm_backend_name(int index) {
  return index >= 0 && (size_t)index < NUM_BACKENDS ? backends[index].name : NULL;
}

tp_status_t tp_comm_backend_usable(const char *name) {
  tp_clear_error();
  const tp_backend_entry *be = name ? tp_backend_find(name) : NULL;
  if (!be) {
    char known[256];
    tp_backend_names(known, sizeof known);
    return tp_set_error(TP_ERR_UNSUPPORTED, "backend '%s' is not available in this build (available: %s)",
                        name ? name : "(null)", known);
  }
  if (!be->usable) return TP_SUCCESS;
  tp_status_t st = be->usable();
  if (st != TP_SUCCESS) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", tp_last_error());
    return tp_set_error(st, "backend %s: %s", name, msg);
  }
  return TP_SUCCESS;
}
