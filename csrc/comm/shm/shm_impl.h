/*
 * Private header of the shared-memory backend ("shm"), split by concern:
 *   shm_rendezvous.c  segment set-up and rendezvous, init, abort, destroy, split,
 *                     the backend's table
 *   shm_wait.c        the waits (adaptive spin / yield / sleep), liveness, abort
 *   shm_coll.c        collective headers and mismatch checks, the collectives
 *   shm_a2a.c         all_to_all (uneven counts, checked pairwise across ranks)
 *   shm_p2p.c         point-to-point channels
 *   shm_mem.c         registered memory
 * Here: the segment's layout (types shared by all of them), the per-rank
 * context, and the small inline helpers the hot paths use.
 *
 * Ranks of one host exchange data through a POSIX shared-memory segment per
 * communicator.  Segment layout (all offsets cache-line aligned):
 *   shm_header_t                     magic, world, abort state
 *   rank_slot_t[world]               per rank: step counter (a futex word),
 *                                    collective headers (double buffered), pid,
 *                                    what the rank is doing (for timeout messages)
 *   chan_t[world * world]            point-to-point channel src -> dst
 *   staging[world][2][stage_bytes]   per rank, two alternating staging buffers
 *   p2p data[world*world][NBUF][p2p_chunk]
 *
 * Synchronisation.  Every rank owns a monotone 32-bit step counter.  "arrive"
 * publishes step+1 (release); "wait_all" waits until every peer's counter has
 * reached this rank's.  A collective is a sequence of rounds; each round writes
 * the rank's own staging buffer (index round & 1), arrives, waits for all, and
 * reads peers' buffers only before its next arrive.  A buffer is written again
 * two rounds later, after a wait that proves every peer has finished reading it.
 * How a wait spends its time (spin, yield, sleep on the futex) is shm_wait.c's.
 */
#ifndef TPCORE_SHM_IMPL_H
#define TPCORE_SHM_IMPL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <time.h>

#include "../comm_impl.h"

#define CL 64
#define SHM_MAGIC 0x3153484d52435054ULL /* "TPCRMSH1" */
#define SHM_VERSION 4
#define P2P_NBUF 2
#define ALIGN_UP(x, a) (((x) + (a) - 1) / (a) * (a))

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() ((void)0)
#endif

typedef struct {
  uint32_t seq;
  int32_t kind;
  int32_t dtype;
  int32_t op;
  int32_t root;
  int32_t color;
  int32_t key;
  int32_t pad;
  uint64_t count; /* this rank's count (its part for gather / scatter) */
  uint64_t total;
  int64_t send_region, send_off; /* registered location, -1 if none */
  int64_t recv_region, recv_off;
  uint64_t send_addr, recv_addr; /* this rank's buffers in its own address space (CMA) */
  uint64_t counts_hash;          /* all_gather / reduce_scatter: the per-rank counts */
  uint64_t nonce;                /* split / alloc: rank 0's fresh random number names what it creates */
  char site[TP_COMM_SITE_MAX];   /* the caller's "file.py:LINE" (shm_desync.c names desyncs with it) */
} coll_hdr_t;

typedef struct {
  _Alignas(CL) _Atomic uint32_t step;
  _Atomic uint32_t waiters;
  _Atomic int32_t closed;
  _Atomic int32_t status;           /* result of this rank's part of a collective setup step */
  _Alignas(CL) _Atomic int32_t pid; /* claimed once (compare-and-swap from 0): a second claimant is another job */
  uint64_t starttime;
  uint64_t cma_probe;       /* address of a private word peers read to test CMA */
  _Atomic int32_t cma_ok;   /* this rank can read every peer with process_vm_readv */
  _Atomic int32_t act_kind; /* what the rank is doing now (TP_COLL_NONE: nothing) */
  _Atomic uint32_t act_seq;
  _Atomic int32_t act_peer;
  _Atomic uint32_t last_seq;
  _Atomic double last_start; /* tp_now() when its last collective began */
  coll_hdr_t hdr[2];
} rank_slot_t;

typedef struct {
  uint32_t msg; /* message number on this channel */
  int32_t dtype;
  uint64_t count;
  uint32_t chunk, nchunks;
  uint64_t nbytes;
} p2p_hdr_t;

typedef struct {
  _Alignas(CL) _Atomic uint32_t sent;
  _Atomic uint32_t sent_waiters;
  _Alignas(CL) _Atomic uint32_t acked;
  _Atomic uint32_t acked_waiters;
  _Alignas(CL) p2p_hdr_t hdr[P2P_NBUF];
} chan_t;

typedef struct {
  uint64_t magic;
  uint32_t version;
  int32_t world;
  uint64_t total_size;
  uint64_t stage_bytes;
  uint64_t p2p_chunk;
  int32_t creator_pid;
  uint64_t creator_start; /* the creator's /proc start time: a reused pid is not it */
  /* Rank 0's settings, adopted by every rank: they choose data paths, which must agree. */
  uint64_t small_bytes, nt_bytes, scratch_blk, cma_bytes[TP_COLL_NUM];
  _Alignas(CL) _Atomic int32_t attached;
  _Alignas(CL) _Atomic int32_t abort_state; /* 0 none, 1 being written, 2 published */
  _Atomic int32_t closing;                  /* a rank closed (or failed to set up) the communicator: it is ending */
  int32_t abort_rank;
  int32_t abort_status; /* tp_status_t the peers report: timeout, mismatch or remote */
  char abort_msg[768];
} shm_header_t;

/* A registered buffer: the common handle header first (its release is
 * shm_mem_release), then shm's part. */
typedef struct shm_mem {
  struct tp_mem hdr;
  _Atomic int refs;
  void *base;
  size_t maplen;
  size_t slot;
  int64_t id;
  int rank;
  void *ptr;
  size_t nbytes;
  struct shm_ctx *owner; /* NULL once the communicator is gone */
  struct shm_mem *next;
} shm_mem;

typedef struct shm_ctx {
  struct tp_comm *comm;
  char name[256];
  char comm_id[128];
  int keep_name; /* a world communicator of a job id that may be shared: the name stays (locked) */
  int lock_fd;   /* holds this rank's lock on the segment (-1: none) */
  char *base;
  size_t size;
  shm_header_t *hdr;
  rank_slot_t *slots;
  chan_t *chans;
  char *stage;
  char *p2pdata;
  size_t stage_bytes;
  size_t p2p_chunk;
  size_t small_bytes;
  size_t nt_bytes;
  uint32_t step;
  uint32_t seq;
  uint32_t round;
  uint32_t nsplit;
  int64_t nmem;
  int use_cma;                   /* every rank can process_vm_readv every other: single-copy path */
  size_t cma_bytes[TP_COLL_NUM]; /* per collective: messages from this size take it */
  uint64_t cma_magic;            /* the word peers read at init */
  char *scratch;                 /* (world - 1) blocks of scratch_blk bytes for CMA reductions */
  size_t scratch_blk;
  /* Waits (shm_wait.c). */
  int adaptive;           /* 0: spin_us was given (config or TPCORE_SPIN_US): fixed spin */
  int spin_iters;         /* fixed spin: pause iterations before sleeping */
  double spin_s;          /* adaptive: the full spin budget on a machine with a core per rank */
  double yield_s;         /* then sched_yield for this long before sleeping (more ranks than cores) */
  double contended_until; /* adaptive: until then, waits spin briefly and sleep */
  double hold_s;          /* how long a contention noticed now holds (doubles while it lasts) */
  uint64_t contentions;   /* times contention was noticed (for tests and debugging) */
  uint32_t *p2p_sent;     /* chunks sent to peer p        */
  uint32_t *p2p_recvd;    /* chunks received from peer p  */
  uint32_t *p2p_msg_s;
  uint32_t *p2p_msg_r;
  int cur_kind; /* the call in progress, for error messages (formatted lazily) */
  uint32_t cur_seq;
  shm_mem *regions;
  pthread_mutex_t regions_lock; /* regions may be released from another thread */
  double last_liveness;
} shm_ctx;

/* ---------------------------------------------------------------- helpers */

long tp_shm_futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts);

/* Publish v in *word (release) and wake its sleepers, if any. */
static inline void shm_post(_Atomic uint32_t *word, _Atomic uint32_t *waiters, uint32_t v) {
  atomic_store_explicit(word, v, memory_order_seq_cst);
  if (atomic_load_explicit(waiters, memory_order_seq_cst)) tp_shm_futex(word, FUTEX_WAKE, INT_MAX, NULL);
}

static inline int reached(uint32_t v, uint32_t target) { return (int32_t)(v - target) >= 0; }

size_t tp_shm_env_size(const char *name, size_t dflt);
int tp_shm_online_cores(void);
uint64_t tp_shm_random_token(void);
/* Process start time from /proc/<pid>/stat (field 22), 0 if unavailable. */
uint64_t tp_shm_proc_starttime(int pid, char *state);
/* 1 if the process recorded in the slot is gone (exited, zombie, or pid reused). */
int tp_shm_peer_dead(const rank_slot_t *s);
/* shm_desync.c: what rank p is doing, for a timeout ("rank 3 never arrived at #17 ...: its
 * last call was #16 barrier at train.py:40, 12.1 s ago"; "rank 3 is waiting in #17 ..."). */
void tp_shm_describe_activity(const shm_ctx *c, int p, char *buf, size_t n);
/* The first divergence across every rank's posted header: "rank 2 called all_gather(4096
 * bfloat16) at model.py:88 while ranks 0, 1, 3 called all_reduce(sum, 4096 float32) at
 * model.py:91".  0 when every rank's call reads the same (the caller says why they differ). */
int tp_shm_divergence(const shm_ctx *c, char *buf, size_t n);
void tp_shm_publish_abort_status(shm_ctx *c, int rank, const char *msg, tp_status_t st);
void tp_shm_publish_abort(shm_ctx *c, int rank, const char *msg);
tp_status_t tp_shm_abort_error(shm_ctx *c);

static inline void shm_set_activity(shm_ctx *c, int kind, uint32_t seq, int peer) {
  rank_slot_t *s = &c->slots[c->comm->rank];
  atomic_store_explicit(&s->act_seq, seq, memory_order_relaxed);
  atomic_store_explicit(&s->act_peer, peer, memory_order_relaxed);
  atomic_store_explicit(&s->act_kind, kind, memory_order_relaxed);
}

/* An abort published while this rank was not waiting (a rank of another job with
 * the same id stops this one) fails the next call, even one whose peers all arrive. */
#define RETURN_IF_ABORTED(c)                                                                                           \
  do {                                                                                                                 \
    if (TP_UNLIKELY(atomic_load_explicit(&(c)->hdr->abort_state, memory_order_acquire))) return tp_shm_abort_error(c); \
  } while (0)

/* Reads the wait settings (spin, yield) for a new communicator into c. */
void tp_shm_wait_setup(shm_ctx *c);

/* Wait until *word reaches target.  `peer` is the rank that moves the word;
 * `what` names the wait in messages (NULL: the collective in progress).
 * max_wait > 0 bounds this call (returns TP_IN_PROGRESS when it runs out), else
 * the communicator's timeout applies.  The slow part is shm_wait.c's. */
tp_status_t tp_shm_wait_slow(shm_ctx *c, _Atomic uint32_t *word, _Atomic uint32_t *waiters, uint32_t target, int peer,
                             const char *what, double max_wait);
static inline tp_status_t shm_wait_word(shm_ctx *c, _Atomic uint32_t *word, _Atomic uint32_t *waiters, uint32_t target,
                                        int peer, const char *what, double max_wait) {
  if (reached(atomic_load_explicit(word, memory_order_acquire), target)) return TP_SUCCESS;
  return tp_shm_wait_slow(c, word, waiters, target, peer, what, max_wait);
}

static inline void shm_arrive(shm_ctx *c) {
  rank_slot_t *me = &c->slots[c->comm->rank];
  c->step++;
  shm_post(&me->step, &me->waiters, c->step);
}

static inline tp_status_t shm_wait_all(shm_ctx *c, const char *what) {
  int n = c->comm->size, r = c->comm->rank;
  for (int i = 1; i < n; i++) {
    int p = (r + i) % n;
    TP_CHECK(shm_wait_word(c, &c->slots[p].step, &c->slots[p].waiters, c->step, p, what, 0));
  }
  return TP_SUCCESS;
}

static inline tp_status_t shm_sync_all(shm_ctx *c, const char *what) {
  shm_arrive(c);
  return shm_wait_all(c, what);
}

static inline char *stage_buf(shm_ctx *c, int rank, unsigned b) {
  return c->stage + ((size_t)rank * 2 + (b & 1u)) * c->stage_bytes;
}

static inline const coll_hdr_t *peer_hdr(const shm_ctx *c, int p) { return &c->slots[p].hdr[c->seq & 1]; }

/* Pointer to rank p's copy of (region, offset). */
static inline char *peer_ptr(const shm_mem *m, int p, int64_t off) {
  return (char *)m->base + (size_t)p * m->slot + (size_t)off;
}

static inline chan_t *chan(shm_ctx *c, int src, int dst) { return &c->chans[(size_t)src * c->comm->size + dst]; }
static inline char *chan_buf(shm_ctx *c, int src, int dst, unsigned slot) {
  return c->p2pdata + (((size_t)src * c->comm->size + dst) * P2P_NBUF + slot) * c->p2p_chunk;
}

/* ------------------------------------------------ across the files */

void tp_shm_post_hdr(shm_ctx *c, const tp_coll_args_t *a, int color, int key, int64_t sreg, int64_t soff, int64_t rreg,
                     int64_t roff);
/* After the first wait of a collective: every peer's header must match. */
tp_status_t tp_shm_check_hdrs(shm_ctx *c, const tp_coll_args_t *a);
tp_status_t tp_shm_collective(struct tp_comm *comm, const tp_coll_args_t *a);
/* Copies nbytes from rank p's address space (at raddr) into dst with process_vm_readv (CMA). */
tp_status_t tp_shm_cma_read(shm_ctx *c, int p, void *dst, uint64_t raddr, size_t nbytes);
/* shm_a2a.c: all_to_all (world >= 2; the header is posted there). */
tp_status_t tp_shm_all_to_all(shm_ctx *c, const tp_coll_args_t *a, const char *what);

tp_status_t tp_shm_send(struct tp_comm *comm, const void *buf, size_t count, tp_dtype_t dt, int peer,
                        tp_stream_t stream);
tp_status_t tp_shm_recv(struct tp_comm *comm, void *buf, size_t count, tp_dtype_t dt, int peer, tp_stream_t stream);
tp_status_t tp_shm_sendrecv(struct tp_comm *comm, const void *sbuf, size_t scount, int dst, void *rbuf, size_t rcount,
                            int src, tp_dtype_t dt, tp_stream_t stream);

/* The registered region holding [p, p + nbytes) (its offset in *off), or -1. */
int64_t tp_shm_find_region(shm_ctx *c, const void *p, size_t nbytes, int64_t *off);
shm_mem *tp_shm_region_by_id(shm_ctx *c, int64_t id);
tp_status_t tp_shm_mem_alloc(struct tp_comm *comm, size_t nbytes, void **ptr, tp_mem_t *out);

/* The backend's constructor (registered in backends.c). */
tp_status_t tp_shm_comm_init(struct tp_comm *comm, const char *comm_id, int world_comm);

#endif
