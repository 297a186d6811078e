/*
 * Private header of the MPI plugin (libtpcore_mpi.so), split by concern:
 *   mpi.c      the plugin's entry, MPI start-up and finalize, communicator init / split /
 *              destroy, abort, the waits under the timeout
 *   mpi_ops.c  the user-defined reductions, the call descriptions compared across ranks,
 *              the collectives and the point-to-point operations
 * Here: what both need.  Everything is hidden (-fvisibility=hidden, csrc/comm/mpi/plugin/plugin.map):
 * the plugin exports its entry only.
 */
#ifndef TPCORE_MPI_IMPL_H
#define TPCORE_MPI_IMPL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <limits.h>
#include <mpi.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../mpi_abi.h"

/* The core's helpers, through the host table (mpi.c). */
extern const tp_mpi_host_api *tp_mpi_host;

#define TAG_P2P 11
#define TAG_ABORT 12
#define TAG_CALL 13 /* the call descriptions, rank to rank (mpi_ops.c) */
#define NOTE_MAX 512

/* An operation was left in flight, or a peer failed: skip MPI_Finalize (it waits for every rank).
 * A mismatch that every rank saw leaves nothing in flight and does not count. */
extern atomic_int tp_mpi_any_failed;
extern int tp_mpi_check_calls; /* TPCORE_MPI_CHECK */

typedef struct {
  MPI_Comm mc;   /* the operations' communicator                   */
  MPI_Comm ctrl; /* abort notes: one MPI_Irecv from any rank, always posted */
  MPI_Request ctrl_req;
  char ctrl_note[NOTE_MAX];
  char *abort_note; /* what this rank sent on abort (kept until the sends complete) */
  MPI_Request *abort_reqs;
  int nabort;
  atomic_int abort_claimed; /* the first tp_comm_abort of this rank (prepares abort_note) */
  atomic_int aborted;       /* tp_comm_abort was called on this rank (abort_note is ready) */
  atomic_int notes_sent;    /* the notes went (or are going) out: one thread sends them, once */
  int pending;              /* an operation timed out with its request still active */
  uint64_t seq;             /* collectives called so far (the description's sequence number) */
  /* The call descriptions (mpi_ops.c; NULL with TPCORE_MPI_CHECK=0): this rank's and the ones
   * received for the call in progress, and each rank's latest one that reached this rank (what
   * a timeout names for a rank that did not arrive); requests and statuses of one exchange. */
  int64_t *calls, *last_calls;
  MPI_Request *call_reqs;
  MPI_Status *call_stats;
  uint64_t arrived; /* the latest call whose description came from every rank */
} mpi_ctx;

/* ---- mpi.c -------------------------------------------------------------------------- */

tp_status_t tp_mpi_error(struct tp_comm *comm, int rc, const char *what);
#define MPI_TRY(comm, call, what)                                 \
  do {                                                            \
    int rc_ = (call);                                             \
    if (rc_ != MPI_SUCCESS) return tp_mpi_error(comm, rc_, what); \
  } while (0)

/* Writes what a timed-out wait tells about the ranks into buf (after "timed out after N s"). */
typedef void (*tp_mpi_why_fn)(struct tp_comm *comm, mpi_ctx *x, const void *arg, char *buf, size_t n);
/* Waits for n requests (stats: n of them, or NULL when n <= 2); on a timeout why says why. */
tp_status_t tp_mpi_wait_why(struct tp_comm *comm, mpi_ctx *x, MPI_Request *reqs, int n, MPI_Status *stats,
                            const char *what, tp_mpi_why_fn why, const void *arg);
/* Waits for n (1 or 2) requests; peer (>= 0) is named on a timeout. */
tp_status_t tp_mpi_wait_all(struct tp_comm *comm, mpi_ctx *x, MPI_Request *reqs, int n, MPI_Status *stats,
                            const char *what, int peer);
tp_status_t tp_mpi_wait_one(struct tp_comm *comm, mpi_ctx *x, MPI_Request *req, const char *what, int peer);

/* ---- mpi_ops.c ---------------------------------------------------------------------- */

/* The 16-bit and 128-bit datatypes and the user-defined reductions, once per process. */
tp_status_t tp_mpi_setup_types(void);
/* The buffers of the description exchange (adopt), and their release (destroy: kept when a
 * request may still use them). */
tp_status_t tp_mpi_calls_setup(struct tp_comm *comm, mpi_ctx *x);
void tp_mpi_calls_free(mpi_ctx *x);
/* All ranks exchange the description; any difference is TP_ERR_MISMATCH naming both. */
tp_status_t tp_mpi_check_call(struct tp_comm *comm, mpi_ctx *x, const tp_coll_args_t *a, const char *what);
tp_status_t tp_mpi_refuse_if_failed(struct tp_comm *comm, mpi_ctx *x, const char *what);
tp_status_t tp_mpi_collective(struct tp_comm *comm, const tp_coll_args_t *a);
tp_status_t tp_mpi_send(struct tp_comm *comm, const void *buf, size_t count, tp_dtype_t dt, int peer,
                        tp_stream_t stream);
tp_status_t tp_mpi_recv(struct tp_comm *comm, void *buf, size_t count, tp_dtype_t dt, int peer, tp_stream_t stream);
tp_status_t tp_mpi_sendrecv(struct tp_comm *comm, const void *sbuf, size_t scount, int dst, void *rbuf, size_t rcount,
                            int src, tp_dtype_t dt, tp_stream_t stream);

#endif
