/*
 * The shared-memory backend ("shm"): ranks of one host exchange data through a
 * POSIX shared-memory segment per communicator.
 *
 * Segment layout (all offsets cache-line aligned):
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
 * Waits spin briefly when there are at least as many cores as ranks, then sleep
 * on the futex (with more ranks than cores they sleep at once).  While asleep a
 * waiter wakes every 20 ms to look at the abort flag, the peer's liveness
 * (/proc start time, so a reused pid is not mistaken for the peer) and its
 * deadline.
 *
 * Data paths.  all_reduce splits each round's chunk into one part per rank; rank
 * r reduces part r (in rank order, so every rank gets the same bits) and the
 * parts are copied back out.  When every rank's buffer lies at the same offset
 * of the same registered allocation (tp_comm_mem_alloc) the copies in and out
 * are skipped: a rank reads peers' inputs and writes peers' outputs in place.
 * Small messages take a one-round path: each rank stages its whole input and
 * reduces all of them.
 *
 * Lifetime.  Rank 0 creates the segment (0600, O_EXCL, space reserved with
 * posix_fallocate so a full /dev/shm is an error rather than a SIGBUS) and the
 * others attach (shm_seg.c: only this user's 0600 segments, liveness by flock).
 * A world communicator's name stays, locked by every rank, while the job lives:
 * it is the job's claim on its id, and each rank claims its place once, so a
 * second job with the same id stops both instead of mixing with them.  The last
 * rank to close removes it; a dead job's name is removed by the next start's
 * sweep.  A split's or a registered buffer's name is random and goes as soon as
 * every rank has mapped it.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "comm_impl.h"
#include "reduce_impl.h"
#include "shm_seg.h"

#define CL 64
#define SHM_MAGIC 0x3153484d52435054ULL /* "TPCRMSH1" */
#define SHM_VERSION 2
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
  uint64_t send_addr, recv_addr;  /* this rank's buffers in its own address space (CMA) */
  uint64_t counts_hash;           /* all_gather / reduce_scatter: the per-rank counts */
  uint64_t nonce;                 /* split / alloc: rank 0's fresh random number names what it creates */
} coll_hdr_t;

typedef struct {
  _Alignas(CL) _Atomic uint32_t step;
  _Atomic uint32_t waiters;
  _Atomic int32_t closed;
  _Atomic int32_t status; /* result of this rank's part of a collective setup step */
  _Alignas(CL) _Atomic int32_t pid; /* claimed once (compare-and-swap from 0): a second claimant is another job */
  uint64_t starttime;
  uint64_t cma_probe;   /* address of a private word peers read to test CMA */
  _Atomic int32_t cma_ok; /* this rank can read every peer with process_vm_readv */
  _Atomic int32_t act_kind; /* what the rank is doing now (TP_COLL_NONE: nothing) */
  _Atomic uint32_t act_seq;
  _Atomic int32_t act_peer;
  _Atomic uint32_t last_seq;
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
  _Atomic int32_t closing; /* a rank closed (or failed to set up) the communicator: it is ending */
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
  int keep_name;  /* a world communicator: the name stays (locked) while the job lives */
  int lock_fd;    /* holds this rank's lock on the segment (-1: none) */
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
  int use_cma;          /* every rank can process_vm_readv every other: single-copy path */
  size_t cma_bytes[TP_COLL_NUM]; /* per collective: messages from this size take it */
  uint64_t cma_magic;   /* the word peers read at init */
  char *scratch;        /* (world - 1) blocks of scratch_blk bytes for CMA reductions */
  size_t scratch_blk;
  int spin_iters;
  double yield_s; /* then sched_yield for this long before sleeping */
  uint32_t *p2p_sent;  /* chunks sent to peer p        */
  uint32_t *p2p_recvd; /* chunks received from peer p  */
  uint32_t *p2p_msg_s;
  uint32_t *p2p_msg_r;
  int cur_kind;      /* the call in progress, for error messages (formatted lazily) */
  uint32_t cur_seq;
  shm_mem *regions;
  pthread_mutex_t regions_lock; /* regions may be released from another thread */
  double last_liveness;
} shm_ctx;

/* ---------------------------------------------------------------- helpers */

static long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
  return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

static void post(_Atomic uint32_t *word, _Atomic uint32_t *waiters, uint32_t v) {
  atomic_store_explicit(word, v, memory_order_seq_cst);
  if (atomic_load_explicit(waiters, memory_order_seq_cst))
    futex(word, FUTEX_WAKE, INT_MAX, NULL);
}

static inline int reached(uint32_t v, uint32_t target) { return (int32_t)(v - target) >= 0; }

static size_t env_size(const char *name, size_t dflt) {
  const char *s = getenv(name);
  if (!s || !*s) return dflt;
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  if (end == s) return dflt;
  if (*end == 'k' || *end == 'K') v <<= 10;
  else if (*end == 'm' || *end == 'M') v <<= 20;
  return (size_t)v;
}

static uint64_t fnv1a(const char *s) {
  uint64_t h = 1469598103934665603ULL;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ULL;
  return h;
}

/* Process start time from /proc/<pid>/stat (field 22), 0 if unavailable. */
static uint64_t proc_starttime(int pid, char *state) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  char *p = strrchr(buf, ')');
  if (!p || p[1] != ' ') return 0;
  p += 2;
  if (state) *state = *p;
  for (int field = 3; field < 22 && p; field++) {
    p = strchr(p, ' ');
    if (p) p++;
  }
  return p ? strtoull(p, NULL, 10) : 0;
}

/* 1 if the process recorded in the slot is gone (exited, zombie, or pid reused). */
static int peer_dead(const rank_slot_t *s) {
  int pid = s->pid;
  if (pid <= 0) return 0;
  char state = '?';
  uint64_t st = proc_starttime(pid, &state);
  if (st == 0) {
    if (kill(pid, 0) == 0 || errno == EPERM) return 0;
    return errno == ESRCH;
  }
  if (state == 'Z' || state == 'X') return 1;
  return s->starttime && st != s->starttime;
}

static void describe_activity(const shm_ctx *c, int p, char *buf, size_t n) {
  const rank_slot_t *s = &c->slots[p];
  int kind = atomic_load(&s->act_kind);
  if (kind == TP_COLL_NONE) {
    snprintf(buf, n, "rank %d is not inside any call (its last collective was #%u)", p,
             atomic_load(&s->last_seq));
  } else if (kind == TP_COLL_SEND || kind == TP_COLL_RECV || kind == TP_COLL_SENDRECV) {
    snprintf(buf, n, "rank %d is in %s with peer %d", p, tp_coll_name((tp_coll_kind_t)kind),
             atomic_load(&s->act_peer));
  } else {
    snprintf(buf, n, "rank %d is in %s #%u", p, tp_coll_name((tp_coll_kind_t)kind),
             atomic_load(&s->act_seq));
  }
}

static void set_activity(shm_ctx *c, int kind, uint32_t seq, int peer) {
  rank_slot_t *s = &c->slots[c->comm->rank];
  atomic_store_explicit(&s->act_seq, seq, memory_order_relaxed);
  atomic_store_explicit(&s->act_peer, peer, memory_order_relaxed);
  atomic_store_explicit(&s->act_kind, kind, memory_order_relaxed);
}

static void publish_abort_status(shm_ctx *c, int rank, const char *msg, tp_status_t st) {
  int32_t expect = 0;
  if (atomic_compare_exchange_strong(&c->hdr->abort_state, &expect, 1)) {
    c->hdr->abort_rank = rank;
    c->hdr->abort_status = (int32_t)st;
    snprintf(c->hdr->abort_msg, sizeof c->hdr->abort_msg, "%s", msg);
    atomic_store(&c->hdr->abort_state, 2);
  }
  /* Wake everybody who sleeps on any counter of this segment. */
  for (int p = 0; p < c->comm->size; p++) futex(&c->slots[p].step, FUTEX_WAKE, INT_MAX, NULL);
  for (int i = 0; i < c->comm->size * c->comm->size; i++) {
    futex(&c->chans[i].sent, FUTEX_WAKE, INT_MAX, NULL);
    futex(&c->chans[i].acked, FUTEX_WAKE, INT_MAX, NULL);
  }
}

static void publish_abort(shm_ctx *c, int rank, const char *msg) {
  publish_abort_status(c, rank, msg, TP_ERR_REMOTE);
}

/* The error a rank reports when another rank aborted the communicator: a
 * timeout or mismatch keeps its kind (every rank would have seen the same),
 * anything else is a remote failure. */
static tp_status_t abort_error(shm_ctx *c) {
  for (int i = 0; i < 1000 && atomic_load(&c->hdr->abort_state) == 1; i++) sched_yield();
  tp_status_t st = (tp_status_t)c->hdr->abort_status;
  if (st != TP_ERR_TIMEOUT && st != TP_ERR_MISMATCH) st = TP_ERR_REMOTE;
  return tp_set_error(st, "%s", c->hdr->abort_msg);
}

/* An abort published while this rank was not waiting (a rank of another job with
 * the same id stops this one) fails the next call, even one whose peers all arrive. */
#define RETURN_IF_ABORTED(c)                                                          \
  do {                                                                                \
    if (TP_UNLIKELY(atomic_load_explicit(&(c)->hdr->abort_state, memory_order_acquire))) \
      return abort_error(c);                                                          \
  } while (0)

/* Wait until *word reaches target.  `peer` is the rank that moves the word;
 * `what` names the wait for messages.  max_wait > 0 bounds this call (returns
 * TP_IN_PROGRESS when it runs out), else the communicator's timeout applies. */
/* `what` names the wait in messages; NULL: the collective in progress. */
static const char *what_text(const shm_ctx *c, const char *what, char *buf, size_t n) {
  if (what) return what;
  snprintf(buf, n, "%s #%u", tp_coll_name((tp_coll_kind_t)c->cur_kind), c->cur_seq);
  return buf;
}

static tp_status_t wait_word(shm_ctx *c, _Atomic uint32_t *word, _Atomic uint32_t *waiters,
                             uint32_t target, int peer, const char *what_, double max_wait) {
  if (reached(atomic_load_explicit(word, memory_order_acquire), target)) return TP_SUCCESS;
  for (int i = 0; i < c->spin_iters; i++) {
    cpu_relax();
    if (reached(atomic_load_explicit(word, memory_order_acquire), target)) return TP_SUCCESS;
  }
  double t0 = tp_now();
  if (c->yield_s > 0) {
    /* More ranks than cores: hand the core to the rank we wait for. */
    while (tp_now() - t0 < c->yield_s) {
      sched_yield();
      if (reached(atomic_load_explicit(word, memory_order_acquire), target)) return TP_SUCCESS;
    }
  }
  double deadline = t0 + (max_wait > 0 ? max_wait : c->comm->timeout_s);
  rank_slot_t *ps = &c->slots[peer];
  for (;;) {
    if (atomic_load(&c->hdr->abort_state)) return abort_error(c);
    atomic_fetch_add(waiters, 1);
    uint32_t cur = atomic_load(word);
    if (!reached(cur, target)) {
      struct timespec ts = {0, 20 * 1000 * 1000};
      futex(word, FUTEX_WAIT, cur, &ts);
    }
    atomic_fetch_sub(waiters, 1);
    if (reached(atomic_load_explicit(word, memory_order_acquire), target)) return TP_SUCCESS;
    if (atomic_load(&c->hdr->abort_state)) return abort_error(c);
    double now = tp_now();
    char wbuf[64];
    const char *what = what_text(c, what_, wbuf, sizeof wbuf);
    if (atomic_load(&ps->closed)) {
      char msg[512];
      snprintf(msg, sizeof msg, "rank %d closed the communicator while rank %d waited for it in %s",
               peer, c->comm->rank, what);
      publish_abort(c, peer, msg);
      return tp_set_error(TP_ERR_REMOTE, "%s", msg);
    }
    if (now - c->last_liveness > 0.05) {
      c->last_liveness = now;
      if (peer_dead(ps)) {
        char msg[512];
        snprintf(msg, sizeof msg, "rank %d (pid %d) died while rank %d waited for it in %s", peer,
                 ps->pid, c->comm->rank, what);
        publish_abort(c, peer, msg);
        return tp_set_error(TP_ERR_REMOTE, "%s", msg);
      }
    }
    if (now >= deadline) {
      if (max_wait > 0) return TP_IN_PROGRESS;
      char act[160];
      describe_activity(c, peer, act, sizeof act);
      return tp_set_error(TP_ERR_TIMEOUT,
                          "%s on rank %d: timed out after %.1f s waiting for rank %d (%s)", what,
                          c->comm->rank, now - t0, peer, act);
    }
  }
}

static inline void arrive(shm_ctx *c) {
  rank_slot_t *me = &c->slots[c->comm->rank];
  c->step++;
  post(&me->step, &me->waiters, c->step);
}

static tp_status_t wait_all(shm_ctx *c, const char *what) {
  int n = c->comm->size, r = c->comm->rank;
  for (int i = 1; i < n; i++) {
    int p = (r + i) % n;
    TP_CHECK(wait_word(c, &c->slots[p].step, &c->slots[p].waiters, c->step, p, what, 0));
  }
  return TP_SUCCESS;
}

static tp_status_t sync_all(shm_ctx *c, const char *what) {
  arrive(c);
  return wait_all(c, what);
}

static inline char *stage_buf(shm_ctx *c, int rank, unsigned b) {
  return c->stage + ((size_t)rank * 2 + (b & 1u)) * c->stage_bytes;
}

/* ---------------------------------------------------------------- headers */

static void describe_hdr(const coll_hdr_t *h, char *buf, size_t n) {
  const char *kind = tp_coll_name((tp_coll_kind_t)h->kind);
  const char *dt = tp_dtype_name((tp_dtype_t)h->dtype);
  unsigned long long cnt = (unsigned long long)h->count;
  switch (h->kind) {
    case TP_COLL_ALL_REDUCE:
      snprintf(buf, n, "%s(%s) of %llu %s", kind, tp_redop_name((tp_redop_t)h->op), cnt, dt);
      break;
    case TP_COLL_REDUCE:
      snprintf(buf, n, "%s(%s, root %d) of %llu %s", kind, tp_redop_name((tp_redop_t)h->op),
               h->root, cnt, dt);
      break;
    case TP_COLL_BROADCAST:
      snprintf(buf, n, "%s(root %d) of %llu %s", kind, h->root, cnt, dt);
      break;
    case TP_COLL_ALL_GATHER:
      snprintf(buf, n, "%s of %llu %s (%llu in all)", kind, cnt, dt,
               (unsigned long long)h->total);
      break;
    case TP_COLL_REDUCE_SCATTER:
      snprintf(buf, n, "%s(%s) of %llu %s (receiving %llu)", kind,
               tp_redop_name((tp_redop_t)h->op), (unsigned long long)h->total, dt, cnt);
      break;
    case TP_COLL_ALLOC:
      snprintf(buf, n, "alloc of %llu bytes", cnt);
      break;
    default:
      snprintf(buf, n, "%s", kind);
  }
}

static int hdr_matches(const coll_hdr_t *a, const coll_hdr_t *b, const tp_coll_args_t *args,
                       int peer) {
  if (a->seq != b->seq || a->kind != b->kind) return 0;
  switch (a->kind) {
    case TP_COLL_ALL_REDUCE:
    case TP_COLL_REDUCE:
    case TP_COLL_BROADCAST:
      return a->dtype == b->dtype && a->count == b->count && a->op == b->op && a->root == b->root;
    case TP_COLL_ALL_GATHER:
    case TP_COLL_REDUCE_SCATTER:
      return a->dtype == b->dtype && a->op == b->op && a->total == b->total &&
             b->count == args->counts[peer] && a->counts_hash == b->counts_hash;
    case TP_COLL_ALLOC:
      return a->count == b->count;
    default:
      return 1;
  }
}

static void post_hdr(shm_ctx *c, const tp_coll_args_t *a, int color, int key,
                     int64_t sreg, int64_t soff, int64_t rreg, int64_t roff) {
  coll_hdr_t *h = &c->slots[c->comm->rank].hdr[c->seq & 1];
  h->seq = c->seq;
  h->kind = a->kind;
  h->dtype = a->dtype;
  h->op = (a->kind == TP_COLL_ALL_REDUCE || a->kind == TP_COLL_REDUCE ||
           a->kind == TP_COLL_REDUCE_SCATTER) ? (int32_t)a->op : 0;
  h->root = (a->kind == TP_COLL_BROADCAST || a->kind == TP_COLL_REDUCE) ? a->root : 0;
  h->color = color;
  h->key = key;
  h->count = a->count;
  h->total = a->total;
  h->send_region = sreg;
  h->send_off = soff;
  h->recv_region = rreg;
  h->recv_off = roff;
  h->send_addr = (uint64_t)(uintptr_t)a->send;
  h->recv_addr = (uint64_t)(uintptr_t)a->recv;
  h->counts_hash = 0;
  h->nonce = 0;
  if (a->counts) {
    uint64_t x = 1469598103934665603ULL;
    for (int p = 0; p < c->comm->size; p++) x = (x ^ (uint64_t)a->counts[p]) * 1099511628211ULL;
    h->counts_hash = x;
  }
}

static inline const coll_hdr_t *peer_hdr(const shm_ctx *c, int p) {
  return &c->slots[p].hdr[c->seq & 1];
}

/* ------------------------------------------------ single copy (CMA) */

/* Copy nbytes from peer p's address space (at raddr) into dst, with the
 * kernel's process_vm_readv: one copy instead of two through staging. */
static tp_status_t cma_read(shm_ctx *c, int p, void *dst, uint64_t raddr, size_t nbytes) {
  char *d = dst;
  while (nbytes) {
    struct iovec l = {d, nbytes}, r = {(void *)(uintptr_t)raddr, nbytes};
    ssize_t got = process_vm_readv(c->slots[p].pid, &l, 1, &r, 1, 0);
    if (got <= 0) {
      int err = got < 0 ? errno : EIO;
      if (err == EINTR) continue;
      if (err == ESRCH || peer_dead(&c->slots[p])) {
        char msg[256];
        snprintf(msg, sizeof msg, "rank %d (pid %d) died while rank %d read its buffer", p,
                 c->slots[p].pid, c->comm->rank);
        publish_abort(c, p, msg);
        return tp_set_error(TP_ERR_REMOTE, "%s", msg);
      }
      return tp_set_error(TP_ERR_SYSTEM, "rank %d could not read rank %d's buffer (process_vm_readv: %s)",
                          c->comm->rank, p, strerror(err));
    }
    d += got;
    raddr += (uint64_t)got;
    nbytes -= (size_t)got;
  }
  return TP_SUCCESS;
}

/* Rank r reduces elements [lo, lo + m) of every rank's send buffer into
 * out: its own from memory, the peers' pulled block by block into scratch. */
static tp_status_t cma_reduce_range(shm_ctx *c, const char *send, int own_send, size_t lo, size_t m,
                                    char *out, tp_dtype_t dt, tp_redop_t op, size_t peer_off_elems) {
  int n = c->comm->size, r = c->comm->rank;
  size_t es = tp_dtype_size(dt), blk = c->scratch_blk / es;
  const void *srcs[1024];
  (void)own_send;
  for (size_t o = 0; o < m; o += blk) {
    size_t k = m - o < blk ? m - o : blk;
    int slot = 0;
    for (int p = 0; p < n; p++) {
      if (p == r) {
        srcs[p] = send + (lo + o) * es;
        continue;
      }
      char *tmp = c->scratch + (size_t)slot++ * c->scratch_blk;
      TP_CHECK(cma_read(c, p, tmp, peer_hdr(c, p)->send_addr + (peer_off_elems + o) * es, k * es));
      srcs[p] = tmp;
    }
    tp_reduce_n(out + o * es, NULL, srcs, n, k, dt, op);
  }
  return TP_SUCCESS;
}

/* After the first wait of a collective: every peer's header must match. */
static tp_status_t check_hdrs(shm_ctx *c, const tp_coll_args_t *a) {
  int n = c->comm->size, r = c->comm->rank;
  const coll_hdr_t *mine = &c->slots[r].hdr[c->seq & 1];
  for (int i = 1; i < n; i++) {
    int p = (r + i) % n;
    const coll_hdr_t *h = &c->slots[p].hdr[c->seq & 1];
    if (!hdr_matches(mine, h, a, p)) {
      char da[192], db[192];
      describe_hdr(h, da, sizeof da);
      describe_hdr(mine, db, sizeof db);
      char msg[600];
      if (h->seq != mine->seq)
        snprintf(msg, sizeof msg, "collective mismatch: rank %d is at collective #%u (%s), rank %d at #%u (%s)",
                 p, h->seq, da, r, mine->seq, db);
      else if (h->kind == mine->kind && h->counts_hash != mine->counts_hash &&
               (h->kind == TP_COLL_ALL_GATHER || h->kind == TP_COLL_REDUCE_SCATTER))
        snprintf(msg, sizeof msg, "collective mismatch at #%u: ranks %d and %d passed different per-rank "
                 "counts to %s (rank %d says rank %d has %llu elements; rank %d has %llu)", mine->seq, p, r,
                 tp_coll_name((tp_coll_kind_t)h->kind), r, p, (unsigned long long)a->counts[p], p,
                 (unsigned long long)h->count);
      else
        snprintf(msg, sizeof msg, "collective mismatch at #%u: rank %d called %s, rank %d %s",
                 mine->seq, p, da, r, db);
      return tp_set_error(TP_ERR_MISMATCH, "%s", msg);
    }
  }
  return TP_SUCCESS;
}

/* ------------------------------------------------------ registered memory */

static int64_t find_region(shm_ctx *c, const void *p, size_t nbytes, int64_t *off) {
  if (!p || !c->regions) return -1;
  int64_t id = -1;
  pthread_mutex_lock(&c->regions_lock);
  for (shm_mem *m = c->regions; m; m = m->next) {
    const char *lo = (const char *)m->ptr;
    if ((const char *)p >= lo && (const char *)p + nbytes <= lo + m->nbytes) {
      *off = (const char *)p - lo;
      id = m->id;
      break;
    }
  }
  pthread_mutex_unlock(&c->regions_lock);
  return id;
}

static shm_mem *region_by_id(shm_ctx *c, int64_t id) {
  shm_mem *found = NULL;
  pthread_mutex_lock(&c->regions_lock);
  for (shm_mem *m = c->regions; m; m = m->next)
    if (m->id == id) {
      found = m;
      break;
    }
  pthread_mutex_unlock(&c->regions_lock);
  return found;
}

/* Pointer to rank p's copy of (region, offset). */
static inline char *peer_ptr(const shm_mem *m, int p, int64_t off) {
  return (char *)m->base + (size_t)p * m->slot + (size_t)off;
}

/* 1 if every rank posted the same registered region and offset for the field. */
static int all_registered(shm_ctx *c, int recv_side, shm_mem **m, int64_t *off) {
  int n = c->comm->size;
  const coll_hdr_t *h0 = &c->slots[0].hdr[c->seq & 1];
  int64_t reg = recv_side ? h0->recv_region : h0->send_region;
  int64_t o = recv_side ? h0->recv_off : h0->send_off;
  if (reg < 0) return 0;
  for (int p = 1; p < n; p++) {
    const coll_hdr_t *h = &c->slots[p].hdr[c->seq & 1];
    if ((recv_side ? h->recv_region : h->send_region) != reg ||
        (recv_side ? h->recv_off : h->send_off) != o)
      return 0;
  }
  *m = region_by_id(c, reg);
  *off = o;
  return *m != NULL;
}

/* ------------------------------------------------------------ collectives */

/* Split [0, count) into n parts whose starts are cache-line aligned. */
static inline size_t part_lo(size_t count, int n, int p, size_t es) {
  size_t unit = CL / es;
  size_t units = (count + unit - 1) / unit;
  size_t lo = (units * (size_t)p / (size_t)n) * unit;
  return lo < count ? lo : count;
}

/* Did any rank post a registered send buffer?  (All ranks compute the same.) */
static int any_send_registered(shm_ctx *c) {
  for (int p = 0; p < c->comm->size; p++)
    if (c->slots[p].hdr[c->seq & 1].send_region >= 0) return 1;
  return 0;
}

static void stage_parts(shm_ctx *c, unsigned b, const char *send, size_t off, size_t m,
                        size_t es, int nt) {
  int n = c->comm->size, r = c->comm->rank;
  char *st = stage_buf(c, r, b);
  for (int p = 0; p < n; p++) {
    if (p == r) continue;
    size_t lo = part_lo(m, n, p, es), hi = part_lo(m, n, p + 1, es);
    tp_copy(st + lo * es, send + (off + lo) * es, (hi - lo) * es, nt);
  }
}

/*
 * all_reduce and reduce.  Per chunk of the message: stage the parts the peers
 * reduce, sync, reduce my part in rank order into my output and my staging
 * buffer, sync, copy the other parts out.  The header sync doubles as the first
 * chunk's staging sync.  Registered buffers skip the staging on either side.
 */
static tp_status_t all_reduce_like(shm_ctx *c, const tp_coll_args_t *a, const char *what) {
  int n = c->comm->size, r = c->comm->rank;
  int is_reduce = a->kind == TP_COLL_REDUCE;
  int writes_out = !is_reduce || r == a->root;
  size_t es = tp_dtype_size(a->dtype), cnt = a->count, nbytes = cnt * es;
  const char *send = (const char *)a->send;
  char *recv = (char *)a->recv;
  int nt = nbytes >= c->nt_bytes;
  const void *srcs[1024];

  int64_t soff = 0, roff = 0;
  int64_t sreg = find_region(c, send, nbytes, &soff);
  int64_t rreg = writes_out && !is_reduce ? find_region(c, recv, nbytes, &roff) : -1;
  post_hdr(c, a, 0, 0, sreg, soff, rreg, roff);

  if (nbytes <= c->small_bytes) {
    unsigned b = c->round++;
    if (nbytes) memcpy(stage_buf(c, r, b), send, nbytes);
    TP_CHECK(sync_all(c, what));
    TP_CHECK(check_hdrs(c, a));
    if (writes_out) {
      for (int p = 0; p < n; p++) srcs[p] = stage_buf(c, p, b);
      tp_reduce_n(recv, NULL, srcs, n, cnt, a->dtype, a->op);
    }
    return TP_SUCCESS;
  }

  size_t chunk = c->stage_bytes / es;
  unsigned b = c->round++;
  int cma = c->use_cma && !is_reduce && nbytes >= c->cma_bytes[TP_COLL_ALL_REDUCE];
  int prestaged = sreg < 0 && !cma;
  if (prestaged) stage_parts(c, b, send, 0, cnt < chunk ? cnt : chunk, es, nt);
  TP_CHECK(sync_all(c, what));
  TP_CHECK(check_hdrs(c, a));
  shm_mem *sm = NULL, *rm = NULL;
  int src_direct = all_registered(c, 0, &sm, &soff);
  int dst_direct = !is_reduce && all_registered(c, 1, &rm, &roff);
  if (src_direct || dst_direct) c->comm->stats.zero_copy++;
  if (cma && !(src_direct && dst_direct)) {
    /* Single copy: reduce my part pulling the peers' inputs, then pull their parts. */
    size_t lo = part_lo(cnt, n, r, es), hi = part_lo(cnt, n, r + 1, es);
    TP_CHECK(cma_reduce_range(c, send, 1, lo, hi - lo, recv + lo * es, a->dtype, a->op, lo));
    TP_CHECK(sync_all(c, what));
    for (int i = 1; i < n; i++) {
      int p = (r + i) % n;
      size_t plo = part_lo(cnt, n, p, es), phi = part_lo(cnt, n, p + 1, es);
      TP_CHECK(cma_read(c, p, recv + plo * es, peer_hdr(c, p)->recv_addr + plo * es, (phi - plo) * es));
    }
    return sync_all(c, what); /* peers may not touch their output before we have read it */
  }
  if (src_direct && dst_direct) chunk = cnt;
  if (!src_direct && (cma || any_send_registered(c))) {
    /* Mixed: some ranks skipped staging, expecting the in-place path. */
    if (!prestaged) stage_parts(c, b, send, 0, cnt < chunk ? cnt : chunk, es, nt);
    TP_CHECK(sync_all(c, what));
  }
  for (size_t off = 0; off < cnt; off += chunk) {
    size_t m = cnt - off < chunk ? cnt - off : chunk;
    if (off > 0) {
      b = c->round++;
      if (!src_direct) {
        stage_parts(c, b, send, off, m, es, nt);
        TP_CHECK(sync_all(c, what));
      }
    }
    size_t mylo = part_lo(m, n, r, es), myhi = part_lo(m, n, r + 1, es), mine = myhi - mylo;
    for (int p = 0; p < n; p++) {
      if (src_direct) srcs[p] = peer_ptr(sm, p, soff) + (off + mylo) * es;
      else if (p == r) srcs[p] = send + (off + mylo) * es;
      else srcs[p] = stage_buf(c, p, b) + mylo * es;
    }
    if (dst_direct) {
      /* Reduce a cache-sized block into my output, then copy it to the peers'. */
      size_t blk = 16384 / es;
      const void *s2[1024];
      for (size_t o = 0; o < mine; o += blk) {
        size_t k = mine - o < blk ? mine - o : blk;
        for (int p = 0; p < n; p++) s2[p] = (const char *)srcs[p] + o * es;
        size_t at = (off + mylo + o) * es;
        char *dst = peer_ptr(rm, r, roff) + at;
        tp_reduce_n(dst, n == 2 ? peer_ptr(rm, 1 - r, roff) + at : NULL, s2, n, k, a->dtype, a->op);
        if (n > 2)
          for (int i = 1; i < n; i++) memcpy(peer_ptr(rm, (r + i) % n, roff) + at, dst, k * es);
      }
    } else if (writes_out) {
      tp_reduce_n(recv + (off + mylo) * es, is_reduce ? NULL : stage_buf(c, r, b) + mylo * es,
                  srcs, n, mine, a->dtype, a->op);
    } else {
      tp_reduce_n(stage_buf(c, r, b) + mylo * es, NULL, srcs, n, mine, a->dtype, a->op);
    }
    TP_CHECK(sync_all(c, what));
    if (!dst_direct && writes_out) {
      for (int i = 1; i < n; i++) {
        int p = (r + i) % n;
        size_t lo = part_lo(m, n, p, es), hi = part_lo(m, n, p + 1, es);
        memcpy(recv + (off + lo) * es, stage_buf(c, p, b) + lo * es, (hi - lo) * es);
      }
    }
  }
  return TP_SUCCESS;
}

/* displ[p] = where rank p's block starts (displ[n] = total); returns the largest count. */
static size_t displacements(const size_t *counts, int n, size_t *displ) {
  size_t cmax = 0;
  displ[0] = 0;
  for (int p = 0; p < n; p++) {
    displ[p + 1] = displ[p] + counts[p];
    cmax = counts[p] > cmax ? counts[p] : cmax;
  }
  return cmax;
}

/* all_gather (counts may differ by rank).  The header sync carries the first
 * chunk; a registered source is read in place. */
static tp_status_t all_gather(shm_ctx *c, const tp_coll_args_t *a, const char *what) {
  int n = c->comm->size, r = c->comm->rank;
  size_t es = tp_dtype_size(a->dtype);
  const size_t *counts = a->counts;
  size_t displ[1025];
  size_t cmax = displacements(counts, n, displ);
  const char *send = (const char *)a->send;
  char *recv = (char *)a->recv;
  size_t mybytes = counts[r] * es;
  int64_t soff = 0;
  int64_t sreg = find_region(c, send, mybytes, &soff);
  post_hdr(c, a, 0, 0, sreg, soff, -1, 0);
  size_t chunk = c->stage_bytes / es;
  int nt = cmax * es * (size_t)n >= c->nt_bytes;
  unsigned b = c->round++;
  int cma = c->use_cma && displ[n] * es >= c->cma_bytes[TP_COLL_ALL_GATHER];
  int prestaged = sreg < 0 && !cma;
  if (prestaged) tp_copy(stage_buf(c, r, b), send, (counts[r] < chunk ? counts[r] : chunk) * es, nt);
  char *own = recv + displ[r] * es;
  if (own != send && mybytes) memmove(own, send, mybytes);
  TP_CHECK(sync_all(c, what));
  TP_CHECK(check_hdrs(c, a));
  /* Registered source: the same region on every rank (offsets may differ). */
  const coll_hdr_t *h0 = &c->slots[0].hdr[c->seq & 1];
  shm_mem *sm = h0->send_region >= 0 ? region_by_id(c, h0->send_region) : NULL;
  for (int p = 1; p < n && sm; p++)
    if (c->slots[p].hdr[c->seq & 1].send_region != h0->send_region) sm = NULL;
  if (sm) {
    c->comm->stats.zero_copy++;
    for (int i = 1; i < n; i++) {
      int p = (r + i) % n;
      memcpy(recv + displ[p] * es, peer_ptr(sm, p, c->slots[p].hdr[c->seq & 1].send_off),
             counts[p] * es);
    }
    return sync_all(c, what); /* peers may not touch their inputs before we are done */
  }
  if (cma) {
    for (int i = 1; i < n; i++) {
      int p = (r + i) % n;
      TP_CHECK(cma_read(c, p, recv + displ[p] * es, peer_hdr(c, p)->send_addr, counts[p] * es));
    }
    return sync_all(c, what);
  }
  if (any_send_registered(c)) {
    if (!prestaged) tp_copy(stage_buf(c, r, b), send, (counts[r] < chunk ? counts[r] : chunk) * es, nt);
    TP_CHECK(sync_all(c, what));
  }
  for (size_t off = 0; off < cmax || off == 0; off += chunk) {
    if (off > 0) {
      b = c->round++;
      if (off < counts[r]) {
        size_t m = counts[r] - off < chunk ? counts[r] - off : chunk;
        tp_copy(stage_buf(c, r, b), send + off * es, m * es, nt);
      }
      TP_CHECK(sync_all(c, what));
    }
    for (int i = 1; i < n; i++) {
      int p = (r + i) % n;
      if (off >= counts[p]) continue;
      size_t m = counts[p] - off < chunk ? counts[p] - off : chunk;
      memcpy(recv + (displ[p] + off) * es, stage_buf(c, p, b), m * es);
    }
    if (cmax == 0) break;
  }
  return TP_SUCCESS;
}

static void stage_rs(shm_ctx *c, unsigned b, const char *send, const size_t *counts,
                     const size_t *displ, size_t off, size_t cp, size_t es, int nt) {
  int n = c->comm->size, r = c->comm->rank;
  char *st = stage_buf(c, r, b);
  for (int p = 0; p < n; p++) {
    if (p == r || off >= counts[p]) continue;
    size_t m = counts[p] - off < cp ? counts[p] - off : cp;
    tp_copy(st + (size_t)p * cp * es, send + (displ[p] + off) * es, m * es, nt);
  }
}

/* reduce_scatter (counts may differ by rank): per round each rank stages a
 * piece of every other rank's block, syncs, and reduces its own block's piece. */
static tp_status_t reduce_scatter(shm_ctx *c, const tp_coll_args_t *a, const char *what) {
  int n = c->comm->size, r = c->comm->rank;
  size_t es = tp_dtype_size(a->dtype);
  const size_t *counts = a->counts;
  size_t displ[1025];
  size_t cmax = displacements(counts, n, displ);
  const char *send = (const char *)a->send;
  char *recv = (char *)a->recv;
  const void *srcs[1024];
  int64_t soff = 0;
  int64_t sreg = find_region(c, send, a->total * es, &soff);
  post_hdr(c, a, 0, 0, sreg, soff, -1, 0);
  size_t cp = c->stage_bytes / ((size_t)n * es); /* elements per destination per round */
  cp = cp / (CL / es) * (CL / es);
  if (cp == 0) cp = 1;
  int nt = a->total * es >= c->nt_bytes;
  unsigned b = c->round++;
  int cma = c->use_cma && a->total * es >= c->cma_bytes[TP_COLL_REDUCE_SCATTER];
  int prestaged = sreg < 0 && !cma;
  if (prestaged) stage_rs(c, b, send, counts, displ, 0, cp, es, nt);
  TP_CHECK(sync_all(c, what));
  TP_CHECK(check_hdrs(c, a));
  shm_mem *sm = NULL;
  if (all_registered(c, 0, &sm, &soff)) {
    c->comm->stats.zero_copy++;
    for (int p = 0; p < n; p++) srcs[p] = peer_ptr(sm, p, soff) + displ[r] * es;
    tp_reduce_n(recv, NULL, srcs, n, counts[r], a->dtype, a->op);
    return sync_all(c, what);
  }
  if (cma) {
    TP_CHECK(cma_reduce_range(c, send, 1, displ[r], counts[r], recv, a->dtype, a->op, displ[r]));
    return sync_all(c, what);
  }
  if (any_send_registered(c)) {
    if (!prestaged) stage_rs(c, b, send, counts, displ, 0, cp, es, nt);
    TP_CHECK(sync_all(c, what));
  }
  for (size_t off = 0; off < cmax; off += cp) {
    if (off > 0) {
      b = c->round++;
      stage_rs(c, b, send, counts, displ, off, cp, es, nt);
      TP_CHECK(sync_all(c, what));
    }
    if (off < counts[r]) {
      size_t m = counts[r] - off < cp ? counts[r] - off : cp;
      for (int p = 0; p < n; p++)
        srcs[p] = p == r ? send + (displ[r] + off) * es : stage_buf(c, p, b) + (size_t)r * cp * es;
      tp_reduce_n(recv + off * es, NULL, srcs, n, m, a->dtype, a->op);
    }
  }
  return TP_SUCCESS;
}

/* broadcast: the root stages chunks (or is read in place when registered). */
static tp_status_t broadcast(shm_ctx *c, const tp_coll_args_t *a, const char *what) {
  int r = c->comm->rank, root = a->root;
  size_t es = tp_dtype_size(a->dtype), cnt = a->count, nbytes = cnt * es;
  const char *send = (const char *)a->send;
  char *recv = (char *)a->recv;
  int64_t soff = 0, roff = 0;
  int64_t sreg = r == root ? find_region(c, send, nbytes, &soff) : -1;
  int64_t rreg = find_region(c, recv, nbytes, &roff);
  post_hdr(c, a, 0, 0, sreg, soff, rreg, roff);
  size_t chunk = c->stage_bytes / es;
  int nt = nbytes >= c->nt_bytes;
  unsigned b = c->round++;
  int cma = c->use_cma && nbytes >= c->cma_bytes[TP_COLL_BROADCAST];
  if (r == root) {
    if (sreg < 0 && !cma) tp_copy(stage_buf(c, root, b), send, (cnt < chunk ? cnt : chunk) * es, nt);
    if (recv != send && nbytes) memmove(recv, send, nbytes);
  }
  TP_CHECK(sync_all(c, what));
  TP_CHECK(check_hdrs(c, a));
  const coll_hdr_t *rh = &c->slots[root].hdr[c->seq & 1];
  /* In place from the root's registered array only if every rank's output lies in the
   * same allocation: that proves every rank still holds it (a rank may have released
   * its handle, and must then take the same path as the others). */
  shm_mem *sm = NULL;
  if (rh->send_region >= 0) {
    int all = 1;
    for (int p = 0; p < c->comm->size; p++) all &= peer_hdr(c, p)->recv_region == rh->send_region;
    if (all) sm = region_by_id(c, rh->send_region);
  }
  if (sm) {
    c->comm->stats.zero_copy++;
    if (r != root && nbytes) memcpy(recv, peer_ptr(sm, root, rh->send_off), nbytes);
    return sync_all(c, what);
  }
  if (cma) {
    if (r != root) TP_CHECK(cma_read(c, root, recv, rh->send_addr, nbytes));
    return sync_all(c, what);
  }
  if (rh->send_region >= 0) {
    /* The root skipped staging expecting the in-place path, which not every rank can take. */
    if (r == root) tp_copy(stage_buf(c, root, b), send, (cnt < chunk ? cnt : chunk) * es, nt);
    TP_CHECK(sync_all(c, what));
  }
  for (size_t off = 0; off < cnt; off += chunk) {
    size_t m = cnt - off < chunk ? cnt - off : chunk;
    if (off > 0) {
      b = c->round++;
      if (r == root) tp_copy(stage_buf(c, root, b), send + off * es, m * es, nt);
      TP_CHECK(sync_all(c, what));
    }
    if (r != root) memcpy(recv + off * es, stage_buf(c, root, b), m * es);
  }
  return TP_SUCCESS;
}

/* One rank alone: every collective is a local copy (or nothing). */
static tp_status_t solo_collective(const tp_coll_args_t *a) {
  size_t es = tp_dtype_size(a->dtype);
  if (a->kind == TP_COLL_BARRIER) return TP_SUCCESS;
  size_t n = a->kind == TP_COLL_ALL_GATHER || a->kind == TP_COLL_REDUCE_SCATTER ? a->total : a->count;
  if (n && a->recv && a->send && a->recv != a->send) memmove(a->recv, a->send, n * es);
  return TP_SUCCESS;
}

static tp_status_t shm_collective(struct tp_comm *comm, const tp_coll_args_t *a) {
  shm_ctx *c = comm->impl;
  RETURN_IF_ABORTED(c);
  const char *what = NULL; /* formatted only if an error needs it */
  c->seq++;
  if (comm->size == 1) return solo_collective(a);
  c->cur_kind = a->kind;
  c->cur_seq = c->seq;
  set_activity(c, a->kind, c->seq, -1);
  tp_status_t st;
  switch (a->kind) {
    case TP_COLL_ALL_REDUCE:
    case TP_COLL_REDUCE: st = all_reduce_like(c, a, what); break;
    case TP_COLL_ALL_GATHER: st = all_gather(c, a, what); break;
    case TP_COLL_REDUCE_SCATTER: st = reduce_scatter(c, a, what); break;
    case TP_COLL_BROADCAST: st = broadcast(c, a, what); break;
    case TP_COLL_BARRIER:
      post_hdr(c, a, 0, 0, -1, 0, -1, 0);
      st = sync_all(c, what);
      if (st == TP_SUCCESS) st = check_hdrs(c, a);
      break;
    default: st = tp_set_error(TP_ERR_INTERNAL, "shm: unknown collective %d", a->kind);
  }
  atomic_store(&c->slots[comm->rank].last_seq, c->seq);
  set_activity(c, TP_COLL_NONE, c->seq, -1);
  if (st != TP_SUCCESS) {
    /* Make sure no peer waits on us for the rest of a collective it thinks matched. */
    char msg[768];
    snprintf(msg, sizeof msg, "rank %d failed: %s", comm->rank, tp_last_error());
    publish_abort_status(c, comm->rank, msg, st);
  }
  return st;
}

/* ----------------------------------------------------------- point to point */

static inline chan_t *chan(shm_ctx *c, int src, int dst) {
  return &c->chans[(size_t)src * c->comm->size + dst];
}
static inline char *chan_buf(shm_ctx *c, int src, int dst, unsigned slot) {
  return c->p2pdata + (((size_t)src * c->comm->size + dst) * P2P_NBUF + slot) * c->p2p_chunk;
}

typedef struct {
  const char *buf;
  size_t nbytes, count;
  tp_dtype_t dtype;
  int peer;
  uint32_t msg, nchunks, done;
} p2p_op;

static void p2p_init(shm_ctx *c, p2p_op *o, const void *buf, size_t count, tp_dtype_t dt, int peer,
                     uint32_t msg) {
  o->buf = buf;
  o->count = count;
  o->dtype = dt;
  o->nbytes = count * tp_dtype_size(dt);
  o->peer = peer;
  o->msg = msg;
  o->nchunks = (uint32_t)(o->nbytes ? (o->nbytes + c->p2p_chunk - 1) / c->p2p_chunk : 1);
  o->done = 0;
}

/* One step of a send; max_wait as in wait_word. */
static tp_status_t send_step(shm_ctx *c, p2p_op *o, double max_wait, const char *what) {
  int r = c->comm->rank;
  chan_t *ch = chan(c, r, o->peer);
  uint32_t k = c->p2p_sent[o->peer];
  if (k >= P2P_NBUF)
    TP_CHECK(wait_word(c, &ch->acked, &ch->acked_waiters, k - P2P_NBUF + 1, o->peer, what, max_wait));
  unsigned slot = k % P2P_NBUF;
  size_t off = (size_t)o->done * c->p2p_chunk;
  size_t m = o->nbytes - off < c->p2p_chunk ? o->nbytes - off : c->p2p_chunk;
  p2p_hdr_t *h = &ch->hdr[slot];
  h->msg = o->msg;
  h->dtype = o->dtype;
  h->count = o->count;
  h->chunk = o->done;
  h->nchunks = o->nchunks;
  h->nbytes = m;
  if (m) memcpy(chan_buf(c, r, o->peer, slot), o->buf + off, m);
  c->p2p_sent[o->peer] = k + 1;
  post(&ch->sent, &ch->sent_waiters, k + 1);
  o->done++;
  return TP_SUCCESS;
}

static tp_status_t recv_step(shm_ctx *c, p2p_op *o, double max_wait, const char *what) {
  int r = c->comm->rank;
  chan_t *ch = chan(c, o->peer, r);
  uint32_t k = c->p2p_recvd[o->peer];
  TP_CHECK(wait_word(c, &ch->sent, &ch->sent_waiters, k + 1, o->peer, what, max_wait));
  unsigned slot = k % P2P_NBUF;
  const p2p_hdr_t *h = &ch->hdr[slot];
  if (h->msg != o->msg || h->dtype != (int32_t)o->dtype || h->count != o->count ||
      h->chunk != o->done) {
    char msg[512];
    snprintf(msg, sizeof msg,
             "point-to-point mismatch: rank %d sent %llu %s (message #%u) but rank %d expected "
             "%llu %s (message #%u)",
             o->peer, (unsigned long long)h->count, tp_dtype_name((tp_dtype_t)h->dtype), h->msg, r,
             (unsigned long long)o->count, tp_dtype_name(o->dtype), o->msg);
    publish_abort_status(c, r, msg, TP_ERR_MISMATCH);
    return tp_set_error(TP_ERR_MISMATCH, "%s", msg);
  }
  size_t off = (size_t)o->done * c->p2p_chunk;
  if (h->nbytes) memcpy((char *)o->buf + off, chan_buf(c, o->peer, r, slot), h->nbytes);
  c->p2p_recvd[o->peer] = k + 1;
  post(&ch->acked, &ch->acked_waiters, k + 1);
  o->done++;
  return TP_SUCCESS;
}

/* A point-to-point wait that timed out leaves the peers out of step: fail them too. */
static tp_status_t p2p_done(shm_ctx *c, tp_status_t st) {
  if (st == TP_ERR_TIMEOUT) {
    char msg[768];
    snprintf(msg, sizeof msg, "rank %d failed: %s", c->comm->rank, tp_last_error());
    publish_abort_status(c, c->comm->rank, msg, st);
  }
  set_activity(c, TP_COLL_NONE, c->seq, -1);
  return st;
}

static tp_status_t shm_send(struct tp_comm *comm, const void *buf, size_t count, tp_dtype_t dt,
                            int peer, tp_stream_t stream) {
  shm_ctx *c = comm->impl;
  p2p_op o;
  RETURN_IF_ABORTED(c);
  char what[64];
  p2p_init(c, &o, buf, count, dt, peer, ++c->p2p_msg_s[peer]);
  snprintf(what, sizeof what, "send to rank %d", peer);
  set_activity(c, TP_COLL_SEND, o.msg, peer);
  tp_status_t st = TP_SUCCESS;
  while (st == TP_SUCCESS && o.done < o.nchunks) st = send_step(c, &o, 0, what);
  return p2p_done(c, st);
}

static tp_status_t shm_recv(struct tp_comm *comm, void *buf, size_t count, tp_dtype_t dt,
                            int peer, tp_stream_t stream) {
  shm_ctx *c = comm->impl;
  p2p_op o;
  RETURN_IF_ABORTED(c);
  char what[64];
  p2p_init(c, &o, buf, count, dt, peer, ++c->p2p_msg_r[peer]);
  snprintf(what, sizeof what, "recv from rank %d", peer);
  set_activity(c, TP_COLL_RECV, o.msg, peer);
  tp_status_t st = TP_SUCCESS;
  while (st == TP_SUCCESS && o.done < o.nchunks) st = recv_step(c, &o, 0, what);
  return p2p_done(c, st);
}

static tp_status_t shm_sendrecv(struct tp_comm *comm, const void *sbuf, size_t scount, int dst,
                                void *rbuf, size_t rcount, int src, tp_dtype_t dt,
                                tp_stream_t stream) {
  shm_ctx *c = comm->impl;
  RETURN_IF_ABORTED(c);
  p2p_op so, ro;
  char what[96];
  p2p_init(c, &so, sbuf, scount, dt, dst, ++c->p2p_msg_s[dst]);
  p2p_init(c, &ro, rbuf, rcount, dt, src, ++c->p2p_msg_r[src]);
  snprintf(what, sizeof what, "sendrecv (to rank %d, from rank %d)", dst, src);
  set_activity(c, TP_COLL_SENDRECV, so.msg, dst);
  double t0 = tp_now();
  tp_status_t st = TP_SUCCESS;
  while (so.done < so.nchunks || ro.done < ro.nchunks) {
    int progressed = 0;
    if (so.done < so.nchunks) {
      st = send_step(c, &so, 0.002, what);
      if (st == TP_SUCCESS) progressed = 1;
      else if (st != TP_IN_PROGRESS) break;
    }
    if (ro.done < ro.nchunks) {
      st = recv_step(c, &ro, 0.002, what);
      if (st == TP_SUCCESS) progressed = 1;
      else if (st != TP_IN_PROGRESS) break;
    }
    st = TP_SUCCESS;
    if (progressed) t0 = tp_now();
    else if (tp_now() - t0 > comm->timeout_s) {
      char act[160];
      describe_activity(c, ro.done < ro.nchunks ? src : dst, act, sizeof act);
      st = tp_set_error(TP_ERR_TIMEOUT, "%s on rank %d: timed out after %.1f s (%s)", what,
                        comm->rank, comm->timeout_s, act);
      break;
    }
  }
  return p2p_done(c, st);
}

/* --------------------------------------------------------- segment set-up */

static size_t layout(int world, size_t stage, size_t p2p, size_t *o_slots, size_t *o_chans,
                     size_t *o_stage, size_t *o_p2p) {
  size_t off = ALIGN_UP(sizeof(shm_header_t), 4096);
  *o_slots = off;
  off += ALIGN_UP(sizeof(rank_slot_t) * (size_t)world, 4096);
  *o_chans = off;
  off += ALIGN_UP(sizeof(chan_t) * (size_t)world * (size_t)world, 4096);
  *o_stage = off;
  off += (size_t)world * 2 * stage;
  *o_p2p = off;
  off += world > 1 ? (size_t)world * (size_t)world * P2P_NBUF * p2p : 0;
  return ALIGN_UP(off, 4096);
}

/* Random bits for names nobody may predict. */
static uint64_t random_token(void) {
  uint64_t t = 0;
  if (getrandom(&t, sizeof t, 0) == (ssize_t)sizeof t && t) return t;
  return (uint64_t)tp_now() * 0x9E3779B97F4A7C15ULL ^ (uint64_t)getpid() << 32 ^ (uint64_t)(uintptr_t)&t;
}

/* Why two jobs meet in one segment, and what to do about it. */
#define COLLISION_ADVICE                                                                       \
  "; both jobs stop. Give each job a job id of its own: python -m tpcore.launch and "          \
  "tpcore.spawn do; with torchrun-style variables set TPCORE_JOB_ID, or another MASTER_PORT"

/* Rank 0 found its segment's name taken.  A name no process locks is left from a
 * job that died: remove it (*retry).  A communicator of this id being closed: wait
 * for its last rank to leave, which removes the name (*retry).  Any other live one
 * belongs to another job with the same id: tell that job (both stop) and fail. */
static tp_status_t name_taken(shm_ctx *c, double deadline, int *retry) {
  int fd;
  size_t nb = 0;
  *retry = 0;
  TP_CHECK(tp_seg_open(c->name, &fd, &nb)); /* another user's or a loosened one: an error */
  if (fd < 0) {
    *retry = 1; /* gone meanwhile */
    return TP_SUCCESS;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) == 0) { /* held through the check and the unlink */
    if (tp_seg_same(c->name, fd)) shm_unlink(c->name);
    close(fd);
    *retry = 1;
    return TP_SUCCESS;
  }
  shm_header_t *h = nb >= sizeof *h ? mmap(NULL, sizeof *h, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                                    : MAP_FAILED;
  close(fd);
  int ready = h != MAP_FAILED && __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) == SHM_MAGIC;
  if (ready && (atomic_load(&h->closing) || atomic_load(&h->abort_state))) {
    munmap(h, sizeof *h);
    if (tp_now() > deadline)
      return tp_set_error(TP_ERR_TIMEOUT,
                          "rank 0 timed out waiting for the previous communicator of job '%s' to be "
                          "closed by all its ranks (shared-memory segment %s is still in use)",
                          c->comm->job_id, c->name);
    usleep(1000);
    *retry = 1;
    return TP_SUCCESS;
  }
  if (ready && h->creator_pid == getpid() && h->creator_start == proc_starttime(getpid(), NULL)) {
    munmap(h, sizeof *h);
    return tp_set_error(TP_ERR_INVALID_USAGE,
                        "this process already has a communicator of job '%s' (shared-memory segment %s): "
                        "close it before making another, or use another TPCORE_JOB_ID",
                        c->comm->job_id, c->name);
  }
  char msg[768];
  snprintf(msg, sizeof msg,
           "job id '%s' is used by two jobs at once: rank 0 of a second job (pid %d) found the "
           "running job's shared-memory segment %s (created by pid %d)" COLLISION_ADVICE,
           c->comm->job_id, (int)getpid(), c->name, ready ? h->creator_pid : -1);
  if (ready) { /* the other job's ranks see it at their next call or within 20 ms of waiting */
    int32_t expect = 0;
    if (atomic_compare_exchange_strong(&h->abort_state, &expect, 1)) {
      h->abort_rank = 0;
      h->abort_status = (int32_t)TP_ERR_INVALID_USAGE;
      snprintf(h->abort_msg, sizeof h->abort_msg, "%s", msg);
      atomic_store(&h->abort_state, 2);
    }
  }
  if (h != MAP_FAILED) munmap(h, sizeof *h);
  return tp_set_error(TP_ERR_INVALID_USAGE, "%s", msg);
}

static void free_ctx(shm_ctx *c) {
  if (!c) return;
  pthread_mutex_destroy(&c->regions_lock);
  free(c->scratch);
  free(c->p2p_sent);
  free(c->p2p_recvd);
  free(c->p2p_msg_s);
  free(c->p2p_msg_r);
  free(c);
}

static void shm_destroy(struct tp_comm *comm);
static void shm_abort(struct tp_comm *comm, const char *reason);
static tp_status_t shm_split(struct tp_comm *comm, int color, int key, struct tp_comm **out);
static tp_status_t shm_mem_alloc(struct tp_comm *comm, size_t nbytes, void **ptr, tp_mem_t *h);

static void shm_stats(struct tp_comm *comm, tp_comm_stats_t *stats) {
  const shm_ctx *c = comm->impl;
  stats->single_copy = c ? c->use_cma : 0;
}

static const tp_backend_ops shm_ops = {
    .name = "shm",
    .devices = 1u << TP_DEVICE_CPU,
    .streams = 0,
    .collective = shm_collective,
    .send = shm_send,
    .recv = shm_recv,
    .sendrecv = shm_sendrecv,
    .split = shm_split,
    .mem_alloc = shm_mem_alloc,
    .stats = shm_stats,
    .abort = shm_abort,
    .destroy = shm_destroy,
};

static int online_cores(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

/* Join the segment rank 0 creates: wait for it (up to the deadline), never join a
 * stale one (its creator gone) or one of another user, adopt rank 0's settings,
 * check that the layout they give is the segment's size, and take this rank's
 * lock on it (c->lock_fd). */
static tp_status_t attach_main(shm_ctx *c, int world, int rank, double deadline, void **base,
                               size_t *size, size_t *o_slots, size_t *o_chans, size_t *o_stage,
                               size_t *o_p2p) {
  const char *why = "it does not exist yet";
  for (;; usleep(1000)) {
    if (tp_now() > deadline)
      return tp_set_error(TP_ERR_TIMEOUT,
                          "rank %d timed out waiting for rank 0 to create shared-memory segment %s (%s; "
                          "did rank 0 start, with the same job id and world size?)", rank, c->name, why);
    int fd;
    size_t nb = 0;
    TP_CHECK(tp_seg_open(c->name, &fd, &nb)); /* another user's or a loosened one: never joined */
    if (fd < 0) continue;
    if (nb < sizeof(shm_header_t)) {
      close(fd);
      why = "it is still being sized";
      continue;
    }
    shm_header_t *h = mmap(NULL, sizeof *h, PROT_READ, MAP_SHARED, fd, 0);
    if (h == MAP_FAILED) {
      int err = errno;
      close(fd);
      return tp_seg_sys_error("cannot map shared-memory segment", c->name, err);
    }
    int ready = __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) == SHM_MAGIC;
    rank_slot_t probe = {0};
    if (ready) {
      probe.pid = h->creator_pid;
      probe.starttime = h->creator_start;
    }
    int ending = ready && (atomic_load(&h->closing) || atomic_load(&h->abort_state));
    if (!ready || ending || peer_dead(&probe)) {
      why = !ready ? "it is not initialised yet"
            : ending ? "the segment found belongs to a communicator being closed"
                     : "the segment found belongs to a job that ended";
      munmap(h, sizeof *h);
      close(fd);
      continue;
    }
    if (h->version != SHM_VERSION || h->world != world) {
      tp_status_t st = tp_set_error(TP_ERR_INVALID_USAGE,
                                    "rank %d: shared-memory segment %s was set up by rank 0 for world size %d "
                                    "(version %u), but this rank has world size %d (version %d)",
                                    rank, c->name, h->world, h->version, world, SHM_VERSION);
      munmap(h, sizeof *h);
      close(fd);
      return st;
    }
    c->stage_bytes = h->stage_bytes;
    c->p2p_chunk = h->p2p_chunk;
    c->small_bytes = h->small_bytes;
    c->nt_bytes = h->nt_bytes;
    c->scratch_blk = h->scratch_blk;
    memcpy(c->cma_bytes, h->cma_bytes, sizeof c->cma_bytes);
    munmap(h, sizeof *h);
    if (!tp_seg_lock(c->name, fd)) { /* removed after we opened it: look again */
      close(fd);
      continue;
    }
    *size = layout(world, c->stage_bytes, c->p2p_chunk, o_slots, o_chans, o_stage, o_p2p);
    if (*size != nb) {
      tp_seg_close(fd);
      return tp_set_error(TP_ERR_INTERNAL, "rank %d: shared-memory segment %s has %zu bytes, expected %zu",
                          rank, c->name, nb, *size);
    }
    void *p = tp_seg_map(fd, *size);
    if (p == MAP_FAILED) {
      int err = errno;
      tp_seg_close(fd);
      return tp_seg_sys_error("cannot map shared-memory segment", c->name, err);
    }
    c->lock_fd = fd;
    *base = p;
    return TP_SUCCESS;
  }
}

tp_status_t tp_shm_comm_init(struct tp_comm *comm, const char *comm_id, int world_comm) {
  int world = comm->size, rank = comm->rank;
  shm_ctx *c = calloc(1, sizeof *c);
  if (!c) return tp_set_error(TP_ERR_NOMEM, "out of memory");
  c->comm = comm;
  /* A world of one rank has no one to mix with: its name goes at once like a split's. */
  c->keep_name = world_comm && world > 1;
  c->lock_fd = -1;
  pthread_mutex_init(&c->regions_lock, NULL);
  snprintf(c->comm_id, sizeof c->comm_id, "%s", comm_id);
  snprintf(c->name, sizeof c->name, "/tpcore_%s_%016llx", comm->job_id,
           (unsigned long long)fnv1a(comm_id));
  c->stage_bytes = ALIGN_UP(env_size("TPCORE_SHM_CHUNK", (size_t)1 << 20), 4096);
  if (c->stage_bytes < 65536) c->stage_bytes = 65536;
  /* The channels take world^2 * 2 chunks: keep them to ~8 MiB for large worlds. */
  size_t p2p_dflt = ((size_t)4 << 20) / ((size_t)world * (size_t)world);
  p2p_dflt = p2p_dflt > ((size_t)256 << 10) ? ((size_t)256 << 10) : p2p_dflt < 16384 ? 16384 : p2p_dflt;
  c->p2p_chunk = ALIGN_UP(env_size("TPCORE_SHM_P2P_CHUNK", p2p_dflt), 4096);
  c->small_bytes = env_size("TPCORE_SHM_SMALL", (size_t)32 << 10);
  if (c->small_bytes > c->stage_bytes) c->small_bytes = c->stage_bytes;
  /* Non-temporal stores measured slower on these machines at every size: opt-in. */
  c->nt_bytes = env_size("TPCORE_SHM_NT_BYTES", SIZE_MAX);
  /* Measured on 2 ranks with buffers rewritten between calls: the kernel's copy reads
   * lines dirty in the peer's cache at ~10 GB/s, so the two pull phases of all_reduce
   * and reduce_scatter beat staging only from a few MiB; one-copy gathers win from 64 KiB. */
  c->cma_bytes[TP_COLL_ALL_GATHER] = c->cma_bytes[TP_COLL_BROADCAST] = (size_t)64 << 10;
  c->cma_bytes[TP_COLL_ALL_REDUCE] = (size_t)2 << 20;
  c->cma_bytes[TP_COLL_REDUCE_SCATTER] = (size_t)2 << 20;
  if (getenv("TPCORE_SHM_CMA_BYTES"))
    for (int k = 0; k < TP_COLL_NUM; k++) c->cma_bytes[k] = env_size("TPCORE_SHM_CMA_BYTES", 0);
  c->scratch_blk = ALIGN_UP(env_size("TPCORE_SHM_CMA_BLOCK", (size_t)128 << 10), 4096);
  int spin_us = comm->spin_us;
  /* With a core per rank, spinning costs nothing but that core; 1 ms covers a peer's
   * copy of a few MiB (a futex sleep and wake-up adds 10-40 us, measured). */
  if (spin_us < 0) spin_us = (int)env_size("TPCORE_SPIN_US", world <= online_cores() ? 1000 : 0);
  c->spin_iters = spin_us * 20; /* a pause is ~10-50 ns */
  /* Measured with 3-4 ranks on 2 cores: a 100 us yield phase takes a barrier from ~25 us
   * (futex sleep and wake-up) to ~2 us; busy spinning would steal the waited-for rank's core. */
  c->yield_s = world > online_cores() ? (double)env_size("TPCORE_YIELD_US", 100) * 1e-6 : 0;
  c->p2p_sent = calloc((size_t)world, sizeof(uint32_t));
  c->p2p_recvd = calloc((size_t)world, sizeof(uint32_t));
  c->p2p_msg_s = calloc((size_t)world, sizeof(uint32_t));
  c->p2p_msg_r = calloc((size_t)world, sizeof(uint32_t));
  if (!c->p2p_sent || !c->p2p_recvd || !c->p2p_msg_s || !c->p2p_msg_r) {
    free_ctx(c);
    return tp_set_error(TP_ERR_NOMEM, "out of memory");
  }
  size_t o_slots, o_chans, o_stage, o_p2p;
  size_t size = layout(world, c->stage_bytes, c->p2p_chunk, &o_slots, &o_chans, &o_stage, &o_p2p);
  double deadline = tp_now() + comm->timeout_s;
  void *base = NULL;
  tp_status_t st;
  if (rank == 0) {
    /* The user's names that no live process locks are left from jobs that died
     * (SIGKILL during set-up, or a world communicator's name): remove them. */
    if (world_comm) tp_seg_sweep(TP_SEG_PREFIX);
    for (;;) {
      int exists = 0, retry = 0;
      st = tp_seg_create(c->name, size, &base, &c->lock_fd, &exists);
      if (!exists) break;
      st = name_taken(c, deadline, &retry);
      if (st == TP_SUCCESS && !retry) st = tp_set_error(TP_ERR_INTERNAL, "segment %s: no decision", c->name);
      if (st == TP_SUCCESS && tp_now() > deadline)
        st = tp_set_error(TP_ERR_TIMEOUT, "cannot create shared-memory segment %s: its name keeps coming back",
                          c->name);
      if (st != TP_SUCCESS) break;
    }
    if (st != TP_SUCCESS) {
      free_ctx(c);
      return st;
    }
    shm_header_t *h = base;
    h->world = world;
    h->total_size = size;
    h->stage_bytes = c->stage_bytes;
    h->p2p_chunk = c->p2p_chunk;
    h->small_bytes = c->small_bytes;
    h->nt_bytes = c->nt_bytes;
    h->scratch_blk = c->scratch_blk;
    memcpy(h->cma_bytes, c->cma_bytes, sizeof h->cma_bytes);
    h->creator_pid = getpid();
    h->creator_start = proc_starttime(getpid(), NULL);
    h->version = SHM_VERSION;
    atomic_store(&((shm_header_t *)base)->attached, 0);
    __atomic_store_n(&h->magic, SHM_MAGIC, __ATOMIC_RELEASE);
  } else {
    st = attach_main(c, world, rank, deadline, &base, &size, &o_slots, &o_chans, &o_stage, &o_p2p);
    if (st != TP_SUCCESS) {
      free_ctx(c);
      return st;
    }
  }
  c->base = base;
  c->size = size;
  c->hdr = base;
  c->slots = (rank_slot_t *)(c->base + o_slots);
  c->chans = (chan_t *)(c->base + o_chans);
  c->stage = c->base + o_stage;
  c->p2pdata = c->base + o_p2p;
  rank_slot_t *me = &c->slots[rank];
  /* Each place is claimed once.  A second claimant is a rank of another job that
   * has the same job id (two torchrun-style jobs on one address and port): both
   * jobs stop, rather than compute with each other's ranks. */
  int32_t holder = 0;
  uint64_t my_start = proc_starttime(getpid(), NULL);
  if (!atomic_compare_exchange_strong(&me->pid, &holder, (int32_t)getpid())) {
    char msg[768];
    snprintf(msg, sizeof msg,
             "job id '%s' is used by two jobs at once: rank %d's place in shared-memory segment %s "
             "was already taken by pid %d when pid %d arrived" COLLISION_ADVICE,
             comm->job_id, rank, c->name, (int)holder, (int)getpid());
    c->comm = comm;
    publish_abort_status(c, rank, msg, TP_ERR_INVALID_USAGE);
    st = tp_set_error(TP_ERR_INVALID_USAGE, "%s", msg);
    goto fail_unclaimed;
  }
  me->starttime = my_start;
  c->cma_magic = 0x54504d4100000000ULL | (uint64_t)rank;
  me->cma_probe = (uint64_t)(uintptr_t)&c->cma_magic;
  atomic_store(&me->act_kind, TP_COLL_NONE);
  atomic_fetch_add(&c->hdr->attached, 1);
  comm->impl = c;
  comm->ops = &shm_ops;
  /* Wait for everyone to attach; then the name can go. */
  for (;;) {
    int n = atomic_load(&c->hdr->attached);
    if (n >= world) break;
    if (atomic_load(&c->hdr->abort_state)) {
      st = abort_error(c);
      goto fail;
    }
    if (tp_now() > deadline) {
      char missing[256] = "";
      size_t len = 0;
      for (int p = 0; p < world && len < sizeof missing - 16; p++)
        if (c->slots[p].pid == 0) len += snprintf(missing + len, sizeof missing - len, "%s%d", len ? ", " : "", p);
      st = tp_set_error(TP_ERR_TIMEOUT,
                        "rank %d timed out after %.1f s waiting for rank(s) %s to join the "
                        "communicator (%d of %d joined)",
                        rank, comm->timeout_s, missing, n, world);
      goto fail;
    }
    for (int p = 0; p < world; p++) {
      if (p != rank && c->slots[p].pid && peer_dead(&c->slots[p])) {
        st = tp_set_error(TP_ERR_REMOTE, "rank %d (pid %d) died while the communicator was being set up",
                          p, c->slots[p].pid);
        goto fail;
      }
    }
    usleep(world <= online_cores() ? 50 : 500);
  }
  if (!c->keep_name) { /* a split's name: nobody else can know it, and everyone is in */
    if (rank == 0 && tp_seg_same(c->name, c->lock_fd)) shm_unlink(c->name);
    tp_seg_close(c->lock_fd);
    c->lock_fd = -1;
  }
  /* Single-copy transfers need every rank to be able to read every other's memory
   * (same user, and ptrace rules such as Yama's allowing it): test it once. */
  int cma_ok = world > 1 && env_size("TPCORE_SHM_CMA", 1) != 0;
  for (int p = 0; p < world && cma_ok; p++) {
    if (p == rank) continue;
    uint64_t v = 0;
    struct iovec l = {&v, sizeof v}, r = {(void *)(uintptr_t)c->slots[p].cma_probe, sizeof v};
    if (process_vm_readv(c->slots[p].pid, &l, 1, &r, 1, 0) != (ssize_t)sizeof v ||
        v != (0x54504d4100000000ULL | (uint64_t)p))
      cma_ok = 0;
  }
  atomic_store(&me->cma_ok, cma_ok);
  st = sync_all(c, "init");
  if (st != TP_SUCCESS) goto fail;
  c->use_cma = 1;
  for (int p = 0; p < world; p++) c->use_cma &= atomic_load(&c->slots[p].cma_ok) != 0;
  if (c->use_cma) {
    c->scratch = malloc((size_t)(world - 1) * c->scratch_blk);
    if (!c->scratch) c->use_cma = 0; /* every rank must agree: fail instead */
    if (!c->scratch) {
      st = tp_set_error(TP_ERR_NOMEM, "out of memory for the communicator's scratch space");
      goto fail;
    }
  }
  return TP_SUCCESS;
fail:
  atomic_store(&c->hdr->closing, 1);
fail_unclaimed:
  tp_seg_leave(c->name, c->lock_fd); /* the last one out removes the name */
  munmap(c->base, c->size);
  free_ctx(c);
  comm->impl = NULL;
  comm->ops = NULL;
  return st;
}

static void shm_abort(struct tp_comm *comm, const char *reason) {
  shm_ctx *c = comm->impl;
  if (!c) return;
  char msg[768];
  snprintf(msg, sizeof msg, "rank %d aborted the communicator: %s", comm->rank,
           reason && *reason ? reason : "(no reason given)");
  publish_abort(c, comm->rank, msg);
}

static void shm_destroy(struct tp_comm *comm) {
  shm_ctx *c = comm->impl;
  if (!c) return;
  rank_slot_t *me = &c->slots[comm->rank];
  atomic_store(&me->closed, 1);
  atomic_store(&c->hdr->closing, 1); /* a new communicator of this id waits for this one to go */
  futex(&me->step, FUTEX_WAKE, INT_MAX, NULL);
  for (int p = 0; p < comm->size; p++) {
    futex(&chan(c, comm->rank, p)->sent, FUTEX_WAKE, INT_MAX, NULL);
    futex(&chan(c, p, comm->rank)->acked, FUTEX_WAKE, INT_MAX, NULL);
  }
  pthread_mutex_lock(&c->regions_lock);
  shm_mem *m = c->regions;
  c->regions = NULL;
  pthread_mutex_unlock(&c->regions_lock);
  while (m) {
    shm_mem *next = m->next;
    m->owner = NULL;
    m->next = NULL;
    m->hdr.release(&m->hdr);
    m = next;
  }
  munmap(c->base, c->size);
  tp_seg_leave(c->name, c->lock_fd); /* the last one out removes a world communicator's name */
  free_ctx(c);
  comm->impl = NULL;
}

/* -------------------------------------------------------------- split */

static tp_status_t shm_split(struct tp_comm *comm, int color, int key, struct tp_comm **out) {
  shm_ctx *c = comm->impl;
  RETURN_IF_ABORTED(c);
  int n = comm->size, r = comm->rank;
  char what[48];
  c->seq++;
  snprintf(what, sizeof what, "split #%u", c->seq);
  set_activity(c, TP_COLL_SPLIT, c->seq, -1);
  tp_coll_args_t a = {TP_COLL_SPLIT, NULL, NULL, 0, NULL, 0, TP_UINT8, TP_SUM, 0, NULL};
  post_hdr(c, &a, color, key, -1, 0, -1, 0);
  if (r == 0) c->slots[0].hdr[c->seq & 1].nonce = random_token();
  tp_status_t st = sync_all(c, what);
  if (st == TP_SUCCESS) st = check_hdrs(c, &a);
  unsigned nsplit = c->nsplit++;
  uint64_t nonce = c->slots[0].hdr[c->seq & 1].nonce;
  int newsize = 0, newrank = 0;
  if (st == TP_SUCCESS && color != TP_SPLIT_NOCOLOR) {
    for (int p = 0; p < n; p++) {
      const coll_hdr_t *h = &c->slots[p].hdr[c->seq & 1];
      if (h->color != color) continue;
      newsize++;
      if (h->key < key || (h->key == key && p < r)) newrank++;
    }
  }
  /* Everyone has read the headers before anyone can overwrite them. */
  if (st == TP_SUCCESS) st = sync_all(c, what);
  atomic_store(&c->slots[r].last_seq, c->seq);
  set_activity(c, TP_COLL_NONE, c->seq, -1);
  if (st != TP_SUCCESS || color == TP_SPLIT_NOCOLOR) return st;
  struct tp_comm *nc;
  TP_CHECK(tp_comm_alloc_common(&nc, newsize, newrank, comm->job_id, comm->timeout_s,
                                comm->spin_us));
  char id[96];
  /* A fresh random number of rank 0's, published through the job's own segment just
   * before the new segments are made, keeps their names unpredictable. */
  snprintf(id, sizeof id, "%016llx.%016llx.%u.%d", (unsigned long long)nonce,
           (unsigned long long)fnv1a(c->comm_id), nsplit, color);
  st = tp_shm_comm_init(nc, id, 0);
  if (st != TP_SUCCESS) {
    tp_error_prefix("split (color %d) on rank %d", color, r);
    free(nc);
    return st;
  }
  *out = nc;
  return TP_SUCCESS;
}

/* ------------------------------------------------------- registered memory */

/* The handle's release (tp_mem_release): one reference is the caller's, one the
 * communicator's; the mapping goes with the last. */
static void shm_mem_release(struct tp_mem *h) {
  shm_mem *m = (shm_mem *)h;
  shm_ctx *c = m->owner;
  if (c) { /* still registered: unlink from the communicator's list */
    int found = 0;
    pthread_mutex_lock(&c->regions_lock);
    shm_mem **pp = &c->regions;
    while (*pp && *pp != m) pp = &(*pp)->next;
    if (*pp) {
      *pp = m->next;
      m->owner = NULL;
      m->next = NULL;
      found = 1;
    }
    pthread_mutex_unlock(&c->regions_lock);
    if (found && atomic_fetch_sub(&m->refs, 1) == 1) goto unmap;
  }
  if (atomic_fetch_sub(&m->refs, 1) != 1) return;
unmap:
  munmap(m->base, m->maplen);
  free(m);
}

/* Map a registered buffer rank 0 has created: exactly its size, this user's, 0600. */
static tp_status_t attach_region(const char *name, size_t size, void **base) {
  int fd;
  size_t nb = 0;
  TP_CHECK(tp_seg_open(name, &fd, &nb));
  if (fd < 0) return tp_set_error(TP_ERR_SYSTEM, "shared-memory segment %s is gone", name);
  if (nb != size) {
    close(fd);
    return tp_set_error(TP_ERR_SYSTEM, "shared-memory segment %s has %zu bytes, expected %zu", name, nb, size);
  }
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) return tp_seg_sys_error("cannot map shared-memory segment", name, err);
  *base = p;
  return TP_SUCCESS;
}

static tp_status_t shm_mem_alloc(struct tp_comm *comm, size_t nbytes, void **ptr, tp_mem_t *out) {
  shm_ctx *c = comm->impl;
  RETURN_IF_ABORTED(c);
  int n = comm->size, r = comm->rank;
  char what[48];
  c->seq++;
  snprintf(what, sizeof what, "alloc #%u", c->seq);
  set_activity(c, TP_COLL_ALLOC, c->seq, -1);
  tp_coll_args_t a = {TP_COLL_ALLOC, NULL, NULL, nbytes, NULL, nbytes, TP_UINT8, TP_SUM, 0, NULL};
  post_hdr(c, &a, 0, 0, -1, 0, -1, 0);
  if (r == 0) c->slots[0].hdr[c->seq & 1].nonce = random_token();
  tp_status_t st = sync_all(c, what);
  if (st == TP_SUCCESS) st = check_hdrs(c, &a);
  if (st != TP_SUCCESS) goto done;
  int64_t id = c->nmem++;
  size_t slot = ALIGN_UP(nbytes ? nbytes : 1, 4096);
  size_t maplen = slot * (size_t)n;
  char name[300];
  /* Not predictable: a fresh random number of rank 0's, published through the job's
   * own segment just before the name is made, so nobody can create it first. */
  snprintf(name, sizeof name, "%s_%016llx_m%lld", c->name,
           (unsigned long long)c->slots[0].hdr[c->seq & 1].nonce, (long long)id);
  void *base = NULL;
  int lock_fd = -1;
  tp_status_t mine = TP_SUCCESS;
  char myerr[512] = "";
  rank_slot_t *ms = &c->slots[r];
  if (r == 0) {
    int exists = 0;
    mine = tp_seg_create(name, maplen, &base, &lock_fd, &exists);
    if (exists) { /* name the owner when it is someone else's */
      int ofd;
      size_t onb;
      mine = tp_seg_open(name, &ofd, &onb);
      if (ofd >= 0) close(ofd);
      if (mine == TP_SUCCESS)
        mine = tp_set_error(TP_ERR_INVALID_USAGE, "shared-memory name %s exists already", name);
    }
    if (mine != TP_SUCCESS) snprintf(myerr, sizeof myerr, "%s", tp_last_error());
    atomic_store(&ms->status, (int32_t)mine);
    st = sync_all(c, what); /* created (or failed) */
  } else {
    arrive(c);
    st = wait_word(c, &c->slots[0].step, &c->slots[0].waiters, c->step, 0, what, 0);
    if (st == TP_SUCCESS && atomic_load(&c->slots[0].status) == TP_SUCCESS) {
      mine = attach_region(name, maplen, &base);
      if (mine != TP_SUCCESS) snprintf(myerr, sizeof myerr, "%s", tp_last_error());
    } else if (st == TP_SUCCESS) {
      mine = TP_ERR_NOMEM;
      snprintf(myerr, sizeof myerr, "rank 0 could not create the shared buffer");
    }
    atomic_store(&ms->status, (int32_t)mine);
    if (st == TP_SUCCESS) st = wait_all(c, what);
  }
  if (st == TP_SUCCESS) st = sync_all(c, what); /* everyone attached (or failed) */
  if (lock_fd >= 0) { /* rank 0: everyone is in (or failed); the name can go */
    if (tp_seg_same(name, lock_fd)) shm_unlink(name);
    tp_seg_close(lock_fd);
  }
  if (st != TP_SUCCESS) {
    if (base) munmap(base, maplen);
    goto done;
  }
  int bad = -1;
  for (int p = 0; p < n && bad < 0; p++)
    if (atomic_load(&c->slots[p].status) != TP_SUCCESS) bad = p;
  /* Statuses are read; one more round before anyone may overwrite them. */
  st = sync_all(c, what);
  if (st != TP_SUCCESS) {
    if (base) munmap(base, maplen);
    goto done;
  }
  if (bad >= 0) {
    if (base) munmap(base, maplen);
    if (bad == r) st = tp_set_error(TP_ERR_NOMEM, "alloc of %zu bytes on rank %d: %s", nbytes, r, myerr);
    else st = tp_set_error(TP_ERR_NOMEM, "alloc of %zu bytes failed on rank %d", nbytes, bad);
    goto done;
  }
  shm_mem *m = calloc(1, sizeof *m);
  if (!m) {
    munmap(base, maplen);
    st = tp_set_error(TP_ERR_NOMEM, "out of memory");
    goto done;
  }
  m->hdr.release = shm_mem_release;
  atomic_init(&m->refs, 2); /* the communicator's and the caller's */
  m->base = base;
  m->maplen = maplen;
  m->slot = slot;
  m->id = id;
  m->rank = r;
  m->ptr = (char *)base + (size_t)r * slot;
  m->nbytes = nbytes;
  m->owner = c;
  pthread_mutex_lock(&c->regions_lock);
  m->next = c->regions;
  c->regions = m;
  pthread_mutex_unlock(&c->regions_lock);
  *ptr = m->ptr;
  *out = &m->hdr;
done:
  atomic_store(&c->slots[r].last_seq, c->seq);
  set_activity(c, TP_COLL_NONE, c->seq, -1);
  return st;
}
