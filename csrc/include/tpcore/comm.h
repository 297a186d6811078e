/*
 * tpcore communicators: one interface, several backends (shm today; nccl and mpi
 * plug in behind the same table).
 *
 * Semantics follow NCCL: every rank of a communicator calls the same collectives
 * in the same order with matching dtype, op, root and counts.  Each collective
 * carries a header (sequence number, op, dtype, count, root) so that a mismatch
 * is reported on every rank as TP_ERR_MISMATCH, naming both sides, instead of
 * corrupting data.  Every wait has a timeout; a rank that aborts or dies makes
 * the others fail promptly with TP_ERR_REMOTE naming it.
 *
 * Buffers are contiguous, with `count` elements of `dtype`, on a device the
 * backend takes (tp_comm_devices: host memory for shm).  send and recv may be
 * the same pointer (in place).  A communicator is used by one thread at a time.
 *
 * Streams (NCCL's order: the stream is the last argument).  A backend that
 * queues work on a device stream (nccl) runs the call on `stream` and returns
 * once it is queued; a host backend (shm) runs it synchronously and takes
 * NULL only: a stream passed to it is an argument error, not silently ignored.
 */
#ifndef TPCORE_COMM_H
#define TPCORE_COMM_H

#include "tpcore/tpcore.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tp_comm *tp_comm_t;
typedef struct tp_mem *tp_mem_t;

typedef enum {
  TP_SUM = 0,
  TP_PROD = 1,
  TP_MIN = 2,
  TP_MAX = 3,
  TP_AVG = 4, /* sum / world size; integers divide truncating toward zero */
  TP_NUM_REDOPS = 5
} tp_redop_t;

TP_API const char *tp_redop_name(tp_redop_t op);

#define TP_SPLIT_NOCOLOR (-1)
#define TP_JOB_ID_MAX 64

typedef struct {
  size_t size;         /* sizeof(tp_comm_config_t): lets the struct grow      */
  unsigned version;    /* TP_VERSION                                          */
  const char *backend; /* "shm" (default when NULL)                           */
  const char *job_id;  /* names the job's shared resources: [A-Za-z0-9_-]{1,64} */
  double timeout_s;    /* every wait; <= 0: TPCORE_TIMEOUT or 300 s           */
  int spin_us;         /* busy-wait before yielding; < 0: automatic (adaptive) */
  /* Registered memory (tp_comm_mem_alloc): 1 on, 0 declined for any backend,
   * < 0: TPCORE_REGISTERED_MEMORY (0 declines), else on. */
  int registered_memory;
  /* nccl: this rank's GPU; < 0: $LOCAL_RANK, else 0.  Ignored by host backends. */
  int device_id;
  /* 1: no other job can have this job_id (a random one, as python -m tpcore.launch and
   * tpcore.spawn draw, or one a launcher's agent holds): the world communicator's
   * shared-memory name is removed as soon as every rank has joined, so that nothing of
   * the job stays in /dev/shm however its processes end.  0 (default): the name stays
   * while the job lives, as its claim on the id (a second job with the same id stops
   * both), and a job killed outright leaves it until a sweep (shm backend). */
  int job_id_unique;
} tp_comm_config_t;

#define TP_COMM_CONFIG_INITIALIZER {sizeof(tp_comm_config_t), TP_VERSION, NULL, NULL, -1.0, -1, -1, -1, 0}

/* Collective over the `world` ranks that name the same job_id: each calls it
 * with its own rank.  Returns when all have joined, or TP_ERR_TIMEOUT naming
 * the ranks that did not arrive. */
TP_API tp_status_t tp_comm_init_rank(tp_comm_t *comm, int world, int rank, const tp_comm_config_t *config);
/* Releases everything this rank holds.  Not collective. NULL is accepted. */
TP_API tp_status_t tp_comm_destroy(tp_comm_t comm);
/* Marks the communicator failed on every rank (they raise TP_ERR_REMOTE naming
 * this rank and `reason`), then behaves like a destroyed one for this rank's
 * collectives.  Safe to call from another thread. */
TP_API tp_status_t tp_comm_abort(tp_comm_t comm, const char *reason);
/* Waits until the calls queued on `stream` by this communicator have finished,
 * under the communicator's timeout (a stuck or mismatched call fails every rank
 * naming the ranks it waited for).  A host backend (shm) has finished every call
 * when it returns: TP_SUCCESS at once. */
TP_API tp_status_t tp_comm_sync(tp_comm_t comm, tp_stream_t stream);
/* TP_SUCCESS when this process could make a communicator of `backend` (its
 * library loads, its device is there); else the reason, as the error. */
TP_API tp_status_t tp_comm_backend_usable(const char *backend);
/* TP_SUCCESS, or the error that made the communicator unusable. */
TP_API tp_status_t tp_comm_get_async_error(tp_comm_t comm, tp_status_t *error);

TP_API tp_status_t tp_comm_rank(tp_comm_t comm, int *rank);
TP_API tp_status_t tp_comm_size(tp_comm_t comm, int *size);
TP_API tp_status_t tp_comm_backend(tp_comm_t comm, const char **name);
TP_API tp_status_t tp_comm_timeout(tp_comm_t comm, double *seconds);
TP_API tp_status_t tp_comm_set_timeout(tp_comm_t comm, double seconds);
/* The device types this communicator's buffers may live on: bit (1u << t) for
 * each tp_device_t t (shm: 1u << TP_DEVICE_CPU).  Collectives reject a buffer
 * on any other device with TP_ERR_INVALID_ARGUMENT. */
TP_API tp_status_t tp_comm_devices(tp_comm_t comm, unsigned *mask);
/* The number of the last collective this rank began on comm (0 before any; point-to-point
 * calls have none): the next one's is *seq + 1, the same on every rank that made the same
 * calls (the "#N" of the errors and of tp_comm_history). */
TP_API tp_status_t tp_comm_seq(tp_comm_t comm, uint64_t *seq);

/* Collectives. */
TP_API tp_status_t tp_all_reduce(const void *send, void *recv, size_t count, tp_dtype_t dtype, tp_redop_t op,
                                 tp_comm_t comm, tp_stream_t stream);
/* recv holds size * sendcount elements, rank p's at p * sendcount. */
TP_API tp_status_t tp_all_gather(const void *send, void *recv, size_t sendcount, tp_dtype_t dtype, tp_comm_t comm,
                                 tp_stream_t stream);
/* Uneven form: rank p contributes counts[p] elements, placed at the sum of the
 * counts before it.  counts has `size` entries and is the same on every rank. */
TP_API tp_status_t tp_all_gather_v(const void *send, void *recv, const size_t *counts, tp_dtype_t dtype, tp_comm_t comm,
                                   tp_stream_t stream);
/* send holds size * recvcount elements; rank p receives block p, reduced. */
TP_API tp_status_t tp_reduce_scatter(const void *send, void *recv, size_t recvcount, tp_dtype_t dtype, tp_redop_t op,
                                     tp_comm_t comm, tp_stream_t stream);
TP_API tp_status_t tp_reduce_scatter_v(const void *send, void *recv, const size_t *counts, tp_dtype_t dtype,
                                       tp_redop_t op, tp_comm_t comm, tp_stream_t stream);
/* Each rank sends block p of send (send_counts[p] elements) to rank p and receives rank p's
 * block for it into block p of recv (recv_counts[p] elements): MPI_Alltoallv with the
 * displacements the prefix sums of the counts.  send_counts[q] on rank p must equal
 * recv_counts[p] on rank q (the shm and mpi backends check it on every rank: TP_ERR_MISMATCH
 * naming both ranks; nccl cannot: a mismatch there fails, or hangs until the timeout).  Both
 * arrays have `size` entries; counts may be 0; send and recv must not overlap. */
TP_API tp_status_t tp_all_to_all(const void *send, const size_t *send_counts, void *recv, const size_t *recv_counts,
                                 tp_dtype_t dtype, tp_comm_t comm, tp_stream_t stream);
/* send is read on root only; recv is written on every rank. */
TP_API tp_status_t tp_broadcast(const void *send, void *recv, size_t count, tp_dtype_t dtype, int root, tp_comm_t comm,
                                tp_stream_t stream);
/* recv is written on root only (may be NULL elsewhere). */
TP_API tp_status_t tp_reduce(const void *send, void *recv, size_t count, tp_dtype_t dtype, tp_redop_t op, int root,
                             tp_comm_t comm, tp_stream_t stream);
TP_API tp_status_t tp_barrier(tp_comm_t comm, tp_stream_t stream);

/* Point to point.  A send of up to the backend's eager size returns at once;
 * a larger one returns when the receiver has taken all but the last chunks. */
TP_API tp_status_t tp_send(const void *buf, size_t count, tp_dtype_t dtype, int peer, tp_comm_t comm,
                           tp_stream_t stream);
TP_API tp_status_t tp_recv(void *buf, size_t count, tp_dtype_t dtype, int peer, tp_comm_t comm, tp_stream_t stream);
/* Sends to `dst` and receives from `src` at the same time (no deadlock in rings). */
TP_API tp_status_t tp_sendrecv(const void *sendbuf, size_t sendcount, int dst, void *recvbuf, size_t recvcount, int src,
                               tp_dtype_t dtype, tp_comm_t comm, tp_stream_t stream);

/* Collective: ranks with the same color form a new communicator, ordered by
 * (key, parent rank).  TP_SPLIT_NOCOLOR gives *newcomm = NULL. */
TP_API tp_status_t tp_comm_split(tp_comm_t comm, int color, int key, tp_comm_t *newcomm);

/* Registered memory (NCCL's user-buffer registration).  Collective: every rank
 * asks for the same nbytes and gets a buffer in memory the ranks share;
 * collectives whose buffers all lie at the same offset of the same allocation
 * on every rank read and write peers' memory in place, without staging copies.
 * The buffer stays valid until tp_mem_release, even after tp_comm_destroy.
 * TP_ERR_UNSUPPORTED when the backend has none or registered memory is turned
 * off (config.registered_memory = 0 or TPCORE_REGISTERED_MEMORY=0): callers
 * then use plain device memory. */
TP_API tp_status_t tp_comm_mem_alloc(tp_comm_t comm, size_t nbytes, void **ptr, tp_mem_t *handle);
TP_API void tp_mem_release(tp_mem_t handle);

/* Statistics of this rank on this communicator since init. */
typedef struct {
  uint64_t collectives; /* collective calls completed                  */
  uint64_t bytes;       /* payload bytes of those calls (this rank's)  */
  uint64_t zero_copy;   /* calls that took the registered-memory path  */
  double seconds;       /* time spent inside collectives and p2p       */
  int single_copy;      /* large private arrays move in one (kernel) copy (backend stat) */
} tp_comm_stats_t;
TP_API tp_status_t tp_comm_get_stats(tp_comm_t comm, tp_comm_stats_t *stats);

/* ---- collective history and regions (csrc/comm/history.c) ----------------
 * Every communicator keeps a ring of its last N calls (TPCORE_HISTORY=N, default
 * 64; 0 turns it off): op, dtype, count, root or peer, the collective's number
 * (the same on every rank), the call site, the region, start, duration, status.
 * When a collective fails with a mismatch or a timeout every rank prints its ring
 * (the last 16 entries) to stderr, and the shm backend names the first divergence
 * across ranks ("rank 2 called all_gather(4096 bfloat16) at model.py:88 while
 * ranks 0, 1, 3 called all_reduce(sum, 4096 float32) at model.py:91"). */
#define TP_COMM_SITE_MAX 48
#define TP_COMM_REGION_NAME_MAX 24
#define TP_COMM_REGIONS_MAX 16

typedef struct {
  uint64_t seq;   /* the collective's number on this communicator (1, 2, ...); 0: point to point */
  const char *op; /* "all_reduce", "barrier", "send", ... (static)                            */
  int redop;      /* tp_redop_t of a reduction, -1 otherwise                                  */
  int dtype;      /* tp_dtype_t, -1 when the call moves no typed data (barrier, split, alloc) */
  uint64_t count; /* elements (this rank's part of all_gather / reduce_scatter; all_to_all: sent); alloc: bytes */
  int root;       /* broadcast / reduce root, send / recv peer, sendrecv destination; else -1 */
  int src;        /* sendrecv source; else -1                                                 */
  char site[TP_COMM_SITE_MAX]; /* "file.py:LINE" of the caller, or "C"                              */
  const char *region;          /* "attention", "mlp", "embedding", "head", "other", ... (lives with comm) */
  double start;                /* tp_now() when the call began                                            */
  double seconds;              /* its duration; < 0 while it runs                                         */
  tp_status_t status;          /* TP_IN_PROGRESS while it runs                                           */
} tp_coll_record_t;

/* The call site of the next calls on comm ("model.py:91", copied, cut at
 * TP_COMM_SITE_MAX - 1 bytes); it stays until changed.  NULL or "": "C". */
TP_API tp_status_t tp_comm_set_site(tp_comm_t comm, const char *site);
/* Tags the next calls' statistics and history with a region ("attention", "mlp", ...;
 * copied, at most TP_COMM_REGION_NAME_MAX - 1 characters; NULL or "": "other").  Returns
 * the previous tag (restore it when done), or NULL when comm is NULL.  A communicator
 * keeps up to TP_COMM_REGIONS_MAX names; calls under further names count as "other". */
TP_API const char *tp_comm_set_region(tp_comm_t comm, const char *name);
/* The ring, oldest first: up to `max` of the newest entries into out; *n how many.  max 0
 * (out may be NULL): *n = how many entries it holds now (size out with it). */
TP_API tp_status_t tp_comm_history(tp_comm_t comm, tp_coll_record_t *out, int max, int *n);
/* Entries the ring holds at most (TPCORE_HISTORY; 0: off). */
TP_API tp_status_t tp_comm_history_capacity(tp_comm_t comm, int *capacity);

typedef struct {
  const char *name;
  uint64_t calls; /* completed calls under this region */
  uint64_t bytes; /* their payload bytes (as tp_comm_stats_t.bytes) */
  double seconds; /* their time (the regions' seconds add up to tp_comm_stats_t.seconds) */
} tp_comm_region_stats_t;
/* The regions seen so far ("other" first): up to max into out, *n how many. */
TP_API tp_status_t tp_comm_region_stats(tp_comm_t comm, tp_comm_region_stats_t *out, int max, int *n);

/* The backends of this build, in registry order (the first is the default):
 * index 0, 1, ... until NULL. */
TP_API const char *tp_comm_backend_name(int index);

#ifdef __cplusplus
}
#endif
#endif /* TPCORE_COMM_H */
