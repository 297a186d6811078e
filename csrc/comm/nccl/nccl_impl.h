/*
 * nccl backend, private: the context of one NCCL communicator (nccl.c: loading,
 * init, waits, split, destroy; nccl_ops.c: the collectives and point to point).
 *
 * Beside each NCCL communicator lives a host communicator (shm, same job, world
 * and rank) made at init: it carries the unique id, and its split follows every
 * ncclCommSplit.  When the ranks span hosts (tp_nccl_bootstrap_store) there is none:
 * the unique id and each split's (color, key) travel through the job's rendezvous
 * store (store_coll.c), and the descriptor segment below is left out.  A small shared segment holds one slot per rank: the rank's
 * state (in init, ready, failed) and a ring of descriptors of its latest
 * collectives (kind, count, dtype, op, root, seq), written without any
 * synchronisation on the hot path and read by peers to detect mismatched calls
 * and to name the ranks a timed-out wait is stuck on.
 */
#ifndef TPCORE_NCCL_IMPL_H
#define TPCORE_NCCL_IMPL_H

#include <stdatomic.h>
#include <stdint.h>

#include "../comm_impl.h"
#include "nccl_api.h"
#include "tpcore/store.h"

#define NCCL_RING 8        /* descriptors kept per rank (seq % NCCL_RING) */
#define NCCL_MAX_STREAMS 8 /* distinct streams remembered for the waits of destroy */

enum { NCCL_STATE_INIT = 0, NCCL_STATE_READY = 1, NCCL_STATE_FAILED = 2 };

typedef struct {
  _Atomic uint32_t seq; /* written last (release); 0: empty */
  uint32_t kind, dtype, op;
  int32_t root;
  uint64_t count, total, counts_hash;
} nccl_desc_t;

typedef struct {
  _Atomic int state;
  _Atomic uint32_t last_seq; /* the latest descriptor written */
  _Atomic int32_t pid;       /* the rank's process and its /proc start time, written once when it */
  int32_t pad0;              /* maps the segment: peers check it while they wait (a dead rank)     */
  _Atomic uint64_t start;
  char pad[40];
  nccl_desc_t ring[NCCL_RING];
} nccl_slot_t;

struct nccl_mem;

typedef struct nccl_ctx {
  struct tp_comm *comm;
  const tp_nccl_api_t *api;
  tp_comm_t host;   /* the shm communicator beside this one (NULL across hosts)        */
  int store_mode;   /* 1: the ranks span hosts: id and splits through the job's store,
                          * no host communicator, no descriptor segment                   */
  tp_store_t store; /* open during an init across hosts only                          */
  ncclComm_t nc;
  int device_id;
  atomic_int abort_flag; /* set by ops->abort (any thread); acted on by the thread in NCCL */
  char abort_reason[256];
  uint32_t seq;
  char comm_id[96];
  int nsplits;
  /* the descriptor segment */
  char seg_name[160];
  int seg_fd;
  nccl_slot_t *slots;
  size_t seg_bytes;
  void *scratch; /* 16 bytes of device memory (barrier) */
  tp_stream_t streams[NCCL_MAX_STREAMS];
  int nstreams;
  struct nccl_mem *mems;   /* registered buffers still registered */
  double next_alive_check; /* tp_now() of the next look at the peers' processes */
} nccl_ctx;

/* nccl.c */
tp_status_t tp_nccl_comm_init(struct tp_comm *comm, const char *comm_id, int world_comm);
tp_status_t tp_nccl_usable(void);
/* Whether a communicator of `size` ranks bootstraps through the job's store (its ranks span
 * hosts; TPCORE_NCCL_BOOTSTRAP=store|shm decides when set). */
int tp_nccl_bootstrap_store(int size, int world_comm);
tp_status_t tp_nccl_error(nccl_ctx *x, const char *call, ncclResult_t r);
/* After a call of a non-blocking communicator: waits while it says ncclInProgress. */
tp_status_t tp_nccl_settle(nccl_ctx *x, const char *call, ncclResult_t r);
/* Posts this rank's descriptor of the next collective and checks the peers' for the same seq. */
tp_status_t tp_nccl_post(nccl_ctx *x, const tp_coll_args_t *a);
/* What a timed-out wait knows of the ranks, after "timed out after N s ...": ": rank 2 did not
 * arrive (its last call: all_reduce #61)", ": rank 3 has not finished init"; "" when every peer
 * has posted the collective in progress; across hosts (no descriptor segment), that it cannot tell. */
void tp_nccl_laggards(nccl_ctx *x, char *buf, size_t n);
/* Waits for the work queued on stream under the timeout (NCCL errors, abort, mismatch). */
tp_status_t tp_nccl_wait(nccl_ctx *x, tp_stream_t stream, const char *what);
void tp_nccl_note_stream(nccl_ctx *x, tp_stream_t stream);
int tp_nccl_dtype(tp_dtype_t d);
int tp_nccl_op(tp_redop_t op);

/* nccl_ops.c */
extern const tp_backend_ops tp_nccl_ops;

#endif
