/*
 * Private side of the communicator interface: the backend table and the common
 * communicator struct.  A backend is one file (shm.c, later nccl.c, mpi.c) that
 * fills a tp_backend_ops; the dispatcher in comm.c validates every argument once
 * and the backends trust their inputs.
 */
#ifndef TPCORE_COMM_IMPL_H
#define TPCORE_COMM_IMPL_H

#include <stdatomic.h>

#include "../core/core_impl.h"
#include "tpcore/comm.h"

typedef enum {
  TP_COLL_NONE = 0,
  TP_COLL_ALL_REDUCE = 1,
  TP_COLL_ALL_GATHER = 2,
  TP_COLL_REDUCE_SCATTER = 3,
  TP_COLL_BROADCAST = 4,
  TP_COLL_REDUCE = 5,
  TP_COLL_BARRIER = 6,
  TP_COLL_SPLIT = 7,
  TP_COLL_ALLOC = 8,
  TP_COLL_SEND = 9,
  TP_COLL_RECV = 10,
  TP_COLL_SENDRECV = 11,
  TP_COLL_NUM = 12
} tp_coll_kind_t;

const char *tp_coll_name(tp_coll_kind_t kind);

/* One collective call, validated.  For ALL_GATHER / REDUCE_SCATTER `counts`
 * has one entry per rank (the equal-count calls fill it in); `count` is this
 * rank's own count for those, the element count otherwise. */
typedef struct {
  tp_coll_kind_t kind;
  const void *send;
  void *recv;
  size_t count;
  const size_t *counts;
  size_t total;
  tp_dtype_t dtype;
  tp_redop_t op;
  int root;
} tp_coll_args_t;

struct tp_comm;

typedef struct {
  const char *name;
  tp_status_t (*collective)(struct tp_comm *comm, const tp_coll_args_t *args);
  tp_status_t (*send)(struct tp_comm *comm, const void *buf, size_t count, tp_dtype_t dtype,
                      int peer);
  tp_status_t (*recv)(struct tp_comm *comm, void *buf, size_t count, tp_dtype_t dtype,
                      int peer);
  tp_status_t (*sendrecv)(struct tp_comm *comm, const void *sendbuf, size_t sendcount, int dst,
                          void *recvbuf, size_t recvcount, int src, tp_dtype_t dtype);
  tp_status_t (*split)(struct tp_comm *comm, int color, int key, struct tp_comm **out);
  /* Optional (NULL: TP_ERR_UNSUPPORTED). */
  tp_status_t (*mem_alloc)(struct tp_comm *comm, size_t nbytes, void **ptr, tp_mem_t *handle);
  /* Tell the peers that this rank failed; must be safe from any thread. */
  void (*abort)(struct tp_comm *comm, const char *reason);
  void (*destroy)(struct tp_comm *comm);
} tp_backend_ops;

struct tp_comm {
  const tp_backend_ops *ops;
  void *impl;
  int rank;
  int size;
  double timeout_s;
  int spin_us;
  char job_id[TP_JOB_ID_MAX + 1];
  atomic_int busy;              /* a call is in progress (one thread at a time) */
  atomic_int failed;            /* 1 once a fatal error was seen                */
  tp_status_t fail_status;
  char fail_msg[1024];
  tp_comm_stats_t stats;
};

/* Allocates the common part; the backend fills ops/impl. */
tp_status_t tp_comm_alloc_common(struct tp_comm **out, int world, int rank, const char *job_id,
                                 double timeout_s, int spin_us);
/* Records a fatal error: later calls fail at once with the same sentence. */
void tp_comm_mark_failed(struct tp_comm *comm, tp_status_t status, const char *msg);

/* Backend constructors. */
/* world_comm: a job's world communicator (its name is the job's claim on its id,
 * kept while the job lives); else a split, whose name is random. */
tp_status_t tp_shm_comm_init(struct tp_comm *comm, const char *comm_id, int world_comm);
int tp_comm_is_shm(tp_comm_t comm);

#endif
