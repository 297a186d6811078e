/*
 * Private side of the communicator interface: the backend table, the registry's
 * entry and the common communicator struct.  A backend is a folder of files (shm/,
 * nccl/, mpi/) that fill a tp_backend_ops, plus one line in backends.c;
 * the dispatcher in comm.c names no backend, validates every argument once
 * (including the device of each buffer against the table's `devices` and the
 * stream against `streams`), and the backends trust their inputs.
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
  TP_COLL_ALL_TO_ALL = 12,
  TP_COLL_NUM = 13
} tp_coll_kind_t;

const char *tp_coll_name(tp_coll_kind_t kind);

/* One collective call, validated.  For ALL_GATHER / REDUCE_SCATTER `counts`
 * has one entry per rank (the equal-count calls fill it in); `count` is this
 * rank's own count for those, the element count otherwise.  ALL_TO_ALL: `counts`
 * are the send counts (one per peer), `recv_counts` the receive counts, `count`
 * the elements this rank sends in all and `total` those it receives; both sides'
 * blocks lie rank after rank (displacements: the prefix sums). */
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
  tp_stream_t stream;        /* NULL unless the backend has streams (ops->streams) */
  const size_t *recv_counts; /* ALL_TO_ALL only; NULL otherwise */
} tp_coll_args_t;

struct tp_comm;

/* A registered buffer's handle starts with this header; the backend that made it
 * sets `release` (called once, by tp_mem_release) and extends the struct. */
struct tp_mem {
  void (*release)(struct tp_mem *mem);
};

typedef struct {
  const char *name;
  /* Device types its buffers may live on: bit (1u << tp_device_t). */
  unsigned devices;
  /* 1: work is queued on the caller's stream; 0: runs on the host, synchronously,
   * and takes NULL only (the dispatcher rejects any other stream). */
  int streams;
  tp_status_t (*collective)(struct tp_comm *comm, const tp_coll_args_t *args);
  tp_status_t (*send)(struct tp_comm *comm, const void *buf, size_t count, tp_dtype_t dtype, int peer,
                      tp_stream_t stream);
  tp_status_t (*recv)(struct tp_comm *comm, void *buf, size_t count, tp_dtype_t dtype, int peer, tp_stream_t stream);
  tp_status_t (*sendrecv)(struct tp_comm *comm, const void *sendbuf, size_t sendcount, int dst, void *recvbuf,
                          size_t recvcount, int src, tp_dtype_t dtype, tp_stream_t stream);
  tp_status_t (*split)(struct tp_comm *comm, int color, int key, struct tp_comm **out);
  /* Optional (NULL: TP_ERR_UNSUPPORTED; callers fall back to plain device memory). */
  tp_status_t (*mem_alloc)(struct tp_comm *comm, size_t nbytes, void **ptr, tp_mem_t *handle);
  /* Optional: fills the backend's fields of the statistics (single_copy). */
  void (*stats)(struct tp_comm *comm, tp_comm_stats_t *stats);
  /* Tell the peers that this rank failed; must be safe from any thread. */
  void (*abort)(struct tp_comm *comm, const char *reason);
  void (*destroy)(struct tp_comm *comm);
  /* Optional (streams = 1): waits for the work queued on stream, under the timeout. */
  tp_status_t (*sync)(struct tp_comm *comm, tp_stream_t stream);
} tp_backend_ops;

/* One line of the registry (backends.c).  init fills comm->ops and comm->impl.
 * world_comm: a job's world communicator (unless comm->job_id_unique, its name is
 * the job's claim on its id, kept while the job lives); else a split's, named by
 * comm_id. */
typedef struct {
  const char *name;
  tp_status_t (*init)(struct tp_comm *comm, const char *comm_id, int world_comm);
  /* Optional: TP_SUCCESS when this process could use the backend (library found,
   * device there), else the reason as the error; NULL: always usable. */
  tp_status_t (*usable)(void);
} tp_backend_entry;

/* The entry named `name`; NULL name: the default (the registry's first line).
 * NULL when unknown. */
const tp_backend_entry *tp_backend_find(const char *name);
/* "shm, nccl": the known names, for messages. */
void tp_backend_names(char *buf, size_t n);

struct tp_comm {
  const tp_backend_ops *ops;
  void *impl;
  int rank;
  int size;
  double timeout_s;
  int spin_us;
  int registered_memory; /* 0: tp_comm_mem_alloc declines (TPCORE_REGISTERED_MEMORY=0) */
  int device_id;         /* config.device_id (< 0: the backend's default) */
  /* A device backend's own device: host buffers given to it are staged through bounce
   * buffers there (staged.c).  TP_DEVICE_CPU (calloc's 0): none. */
  tp_device_t stage_device;
  int stage_device_id;
  char job_id[TP_JOB_ID_MAX + 1];
  int job_id_unique; /* config.job_id_unique: the world's name goes once every rank has joined */
  atomic_int busy;   /* a call is in progress (one thread at a time) */
  atomic_int failed; /* 1 once a fatal error was seen                */
  tp_status_t fail_status;
  char fail_msg[1024];
  tp_comm_stats_t stats;
  /* History and regions (history.c). */
  int hist_cap;               /* ring entries (TPCORE_HISTORY); 0: off */
  tp_coll_record_t *ring;     /* allocated at the first call */
  uint64_t hist_n;            /* calls recorded so far */
  tp_coll_record_t *hist_cur; /* the call in progress (NULL: none, or the ring is off) */
  uint64_t coll_seq;          /* collectives entered (the backends' sequence numbers agree) */
  double call_t0;             /* tp_now() when the call in progress (or the last one) began */
  char site[TP_COMM_SITE_MAX];
  int region; /* index into regions; 0 is "other" */
  int nregions;
  struct {
    char name[TP_COMM_REGION_NAME_MAX];
    uint64_t calls, bytes;
    double seconds;
  } regions[TP_COMM_REGIONS_MAX];
};

/* Allocates the common part; the backend fills ops/impl. */
tp_status_t tp_comm_alloc_common(struct tp_comm **out, int world, int rank, const char *job_id, double timeout_s,
                                 int spin_us);
/* Records a fatal error: later calls fail at once with the same sentence. */
void tp_comm_mark_failed(struct tp_comm *comm, tp_status_t status, const char *msg);

/* ---- history.c ---------------------------------------------------------------------- */
/* Reads TPCORE_HISTORY into comm (an error naming it when malformed); sets site and regions. */
tp_status_t tp_hist_setup(struct tp_comm *comm);
/* A call begins (after enter): a new ring entry (collectives get the next number). */
void tp_hist_begin(struct tp_comm *comm, tp_coll_kind_t kind, int dtype, int redop, size_t count, int root, int src,
                   double t0);
/* The call ended with st after dt seconds moving `bytes`: the entry, the statistics, and on a
 * mismatch or timeout (first failure) the ring printed to stderr. */
void tp_hist_end(struct tp_comm *comm, tp_status_t st, double dt, size_t bytes);
/* "all_reduce(sum, 4096 float32)", "broadcast(16 int8, root 1)", "barrier", "send(8 float32 to 1)". */
void tp_coll_describe(char *buf, size_t n, int kind, int dtype, int redop, uint64_t count, int root, int src);

/* Appends to buf (cap bytes, NUL-terminated) the ranks that did not arrive at a timed-out call,
 * grouped by their last call: ": ranks 0, 3 did not arrive (their last call: all_reduce #61); rank 4
 * has not finished init" (late.c, one wording for the mpi and nccl backends).  last holds n rows of
 * w bytes: "" for a rank that arrived, "-" for one that has made no call yet (no_call says what
 * kind: "no collective call"), "+" for one still in init, else its last call.  The rows are
 * consumed (cleared).  Returns the length written. */
size_t tp_late_ranks(char *last, int n, size_t w, const char *no_call, char *buf, size_t cap);

#endif
