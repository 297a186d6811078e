/*
 * nccl backend: loading the library, init, the waits, split and destroy
 * (nccl_impl.h describes the context; nccl_ops.c has the operations).
 *
 * One rank per GPU: the device is config.device_id (else $LOCAL_RANK, else 0),
 * made current with tp_device_set_current.  Every CUDA need goes through the
 * device table; this file includes no CUDA or NCCL header.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../../core/dynlib.h"
#include "nccl_impl.h"
#include "../shm/shm_impl.h" /* tp_shm_proc_starttime */
#include "../shm/shm_seg.h"
#include "../store/store_impl.h"
#include "tpcore/device.h"

/* ------------------------------------------------------------ the library */

static pthread_mutex_t api_lock = PTHREAD_MUTEX_INITIALIZER;
static tp_nccl_api_t api_store;
static int api_loaded;

static void version_text(int v, char *buf, size_t n) {
  if (v >= 10000) snprintf(buf, n, "%d.%d.%d", v / 10000, (v % 10000) / 100, v % 100);
  else snprintf(buf, n, "%d.%d.%d", v / 1000, (v % 1000) / 100, v % 100);
}

#define SYM(field, name)                                     \
  do {                                                       \
    *(void **)(&a.field) = tp_dynlib_sym(lib, "NCCL", name); \
    if (!a.field) goto fail;                                 \
  } while (0)

/* Loads and checks the library once per process (a failure is retried next time). */
static tp_status_t load_api(const tp_nccl_api_t **out) {
  pthread_mutex_lock(&api_lock);
  if (api_loaded) {
    pthread_mutex_unlock(&api_lock);
    *out = &api_store;
    return TP_SUCCESS;
  }
  static const char *const sonames[] = {"libnccl.so.2", "libnccl.so"};
  void *lib = tp_dynlib_open("NCCL", "TPCORE_NCCL_LIBRARY", sonames, 2);
  if (!lib) {
    pthread_mutex_unlock(&api_lock);
    return TP_ERR_UNSUPPORTED; /* the finder's sentence */
  }
  tp_nccl_api_t a;
  memset(&a, 0, sizeof a);
  a.lib = lib;
  SYM(GetVersion, "ncclGetVersion");
  int v = 0;
  if (a.GetVersion(&v) != ncclSuccess || v <= 0) {
    tp_set_error(TP_ERR_UNSUPPORTED, "NCCL at %s: ncclGetVersion failed", tp_dynlib_path(lib));
    goto fail;
  }
  if (v < TP_NCCL_MIN_VERSION) {
    char have[32], need[32];
    version_text(v, have, sizeof have);
    version_text(TP_NCCL_MIN_VERSION, need, sizeof need);
    tp_set_error(TP_ERR_UNSUPPORTED,
                 "NCCL at %s is version %s, too old: tpcore needs %s or later (ncclMemAlloc, "
                 "ncclCommRegister, ncclCommSplit, non-blocking init); install a newer nvidia-nccl "
                 "wheel or point TPCORE_NCCL_LIBRARY at one",
                 tp_dynlib_path(lib), have, need);
    goto fail;
  }
  a.version = v;
  SYM(GetErrorString, "ncclGetErrorString");
  SYM(GetLastError, "ncclGetLastError");
  SYM(GetUniqueId, "ncclGetUniqueId");
  SYM(CommInitRankConfig, "ncclCommInitRankConfig");
  SYM(CommGetAsyncError, "ncclCommGetAsyncError");
  SYM(CommFinalize, "ncclCommFinalize");
  SYM(CommDestroy, "ncclCommDestroy");
  SYM(CommAbort, "ncclCommAbort");
  SYM(CommSplit, "ncclCommSplit");
  SYM(MemAlloc, "ncclMemAlloc");
  SYM(MemFree, "ncclMemFree");
  SYM(CommRegister, "ncclCommRegister");
  SYM(CommDeregister, "ncclCommDeregister");
  SYM(GroupStart, "ncclGroupStart");
  SYM(GroupEnd, "ncclGroupEnd");
  SYM(AllReduce, "ncclAllReduce");
  SYM(Broadcast, "ncclBroadcast");
  SYM(Reduce, "ncclReduce");
  SYM(AllGather, "ncclAllGather");
  SYM(ReduceScatter, "ncclReduceScatter");
  SYM(Send, "ncclSend");
  SYM(Recv, "ncclRecv");
  api_store = a;
  api_loaded = 1; /* kept open for the life of the process */
  pthread_mutex_unlock(&api_lock);
  *out = &api_store;
  return TP_SUCCESS;
fail:
  pthread_mutex_unlock(&api_lock);
  /* dlclose is skipped on purpose: a library's destructors may not expect it. */
  return TP_ERR_UNSUPPORTED;
}

/* The CUDA side: the plugin loaded, a device there. */
static tp_status_t need_cuda(void) {
  (void)tp_cuda_load(NULL);
  if (tp_device_available(TP_DEVICE_CUDA)) return TP_SUCCESS;
  const char *why = tp_cuda_status();
  return tp_set_error(TP_ERR_UNSUPPORTED, "no CUDA device is usable in this process (%s)", why);
}

/* Whether this process could run the backend with its default device: the library, a
 * CUDA device, and (the same answer on every rank of a host, for backend "auto") one GPU
 * per local rank, unless NCCL 2.30+ is told to run several ranks on one GPU. */
tp_status_t tp_nccl_usable(void) {
  const tp_nccl_api_t *a;
  TP_CHECK(load_api(&a));
  TP_CHECK(need_cuda());
  const tp_device_ops *ops = tp_device_ops_of(TP_DEVICE_CUDA);
  int n = ops && ops->count ? ops->count() : 0;
  const char *lws = getenv("LOCAL_WORLD_SIZE"), *multi = getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  int local = lws && *lws ? atoi(lws) : 1;
  int shared_ok = multi && strcmp(multi, "1") == 0 && a->version >= TP_NCCL_VERSION(2, 30, 0);
  if (local > n && !shared_ok)
    return tp_set_error(TP_ERR_UNSUPPORTED,
                        "%d local ranks but %d CUDA device%s: NCCL runs one rank per GPU (NCCL 2.30+ with "
                        "NCCL_MULTI_RANK_GPU_ENABLE=1 allows several)",
                        local, n, n == 1 ? "" : "s");
  return TP_SUCCESS;
}

/* ------------------------------------------------------------ errors */

tp_status_t tp_nccl_error(nccl_ctx *x, const char *call, ncclResult_t r) {
  tp_status_t st;
  switch (r) {
    case ncclInvalidArgument: st = TP_ERR_INVALID_ARGUMENT; break;
    case ncclInvalidUsage: st = TP_ERR_INVALID_USAGE; break;
    case ncclRemoteError: st = TP_ERR_REMOTE; break;
    case ncclInternalError: st = TP_ERR_INTERNAL; break;
    default: st = TP_ERR_SYSTEM;
  }
  const char *last = x && x->nc ? x->api->GetLastError(x->nc) : x ? x->api->GetLastError(NULL) : NULL;
  int rank = x ? x->comm->rank : -1, size = x ? x->comm->size : 0;
  return tp_set_error(st, "nccl on rank %d of %d: %s failed: %s%s%s", rank, size, call,
                      x ? x->api->GetErrorString(r) : "error", last && *last ? ": " : "", last ? last : "");
}

/* ------------------------------------------------------------ descriptors */

static uint64_t counts_hash(const tp_coll_args_t *a, int n) {
  uint64_t h = 1469598103934665603ull;
  if (!a->counts) return 0;
  for (int i = 0; i < n; i++) h = (h ^ (uint64_t)a->counts[i]) * 1099511628211ull;
  return h;
}

static void describe(const nccl_desc_t *d, char *buf, size_t n) {
  const char *kind = tp_coll_name((tp_coll_kind_t)d->kind);
  const char *dt = tp_dtype_name((tp_dtype_t)d->dtype);
  unsigned long long cnt = (unsigned long long)d->count, tot = (unsigned long long)d->total;
  const char *op = tp_redop_name((tp_redop_t)d->op);
  switch (d->kind) {
    case TP_COLL_ALL_REDUCE: snprintf(buf, n, "%s(%s) of %llu %s", kind, op, cnt, dt); break;
    case TP_COLL_REDUCE: snprintf(buf, n, "%s(%s, root %d) of %llu %s", kind, op, d->root, cnt, dt); break;
    case TP_COLL_BROADCAST: snprintf(buf, n, "%s(root %d) of %llu %s", kind, d->root, cnt, dt); break;
    case TP_COLL_ALL_GATHER: snprintf(buf, n, "%s of %llu %s (%llu in all)", kind, cnt, dt, tot); break;
    case TP_COLL_REDUCE_SCATTER: snprintf(buf, n, "%s(%s) of %llu %s (receiving %llu)", kind, op, tot, dt, cnt); break;
    case TP_COLL_ALL_TO_ALL: snprintf(buf, n, "%s of %llu %s (receiving %llu)", kind, cnt, dt, tot); break;
    case TP_COLL_ALLOC: snprintf(buf, n, "alloc of %llu bytes", cnt); break;
    default: snprintf(buf, n, "%s", kind);
  }
}

/* A consistent copy of peer p's descriptor for `seq`: 1 when it has one. */
static int read_desc(nccl_ctx *x, int p, uint32_t seq, nccl_desc_t *out) {
  const nccl_desc_t *d = &x->slots[p].ring[seq % NCCL_RING];
  for (int tries = 0; tries < 4; tries++) {
    uint32_t s1 = atomic_load_explicit(&((nccl_desc_t *)d)->seq, memory_order_acquire);
    if (s1 != seq) return 0;
    out->kind = d->kind, out->dtype = d->dtype, out->op = d->op, out->root = d->root;
    out->count = d->count, out->total = d->total, out->counts_hash = d->counts_hash;
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&((nccl_desc_t *)d)->seq, memory_order_relaxed) == seq) {
      atomic_init(&out->seq, seq);
      return 1;
    }
  }
  return 0;
}

static int same_call(const nccl_desc_t *a, const nccl_desc_t *b, int pa, int pb) {
  if (a->kind != b->kind || a->dtype != b->dtype) return 0;
  switch (a->kind) {
    case TP_COLL_ALL_REDUCE: return a->op == b->op && a->count == b->count;
    case TP_COLL_REDUCE: return a->op == b->op && a->count == b->count && a->root == b->root;
    case TP_COLL_BROADCAST: return a->count == b->count && a->root == b->root;
    case TP_COLL_REDUCE_SCATTER: return a->op == b->op && a->total == b->total && a->counts_hash == b->counts_hash;
    case TP_COLL_ALL_GATHER: return a->total == b->total && a->counts_hash == b->counts_hash;
    case TP_COLL_ALLOC: return a->count == b->count;
    default: return 1;
  }
  (void)pa, (void)pb;
}

static tp_status_t mismatch(nccl_ctx *x, int p, const nccl_desc_t *theirs, const nccl_desc_t *mine) {
  char da[192], db[192];
  describe(theirs, da, sizeof da);
  describe(mine, db, sizeof db);
  atomic_store(&x->slots[x->comm->rank].state, NCCL_STATE_FAILED);
  return tp_set_error(TP_ERR_MISMATCH, "collective mismatch at #%u: rank %d called %s, rank %d %s", (unsigned)x->seq, p,
                      da, x->comm->rank, db);
}

/* Compares this rank's descriptor of x->seq with every peer that has posted it. */
static tp_status_t check_peers(nccl_ctx *x) {
  int n = x->comm->size, r = x->comm->rank;
  nccl_desc_t mine, theirs;
  if (!x->slots || !read_desc(x, r, x->seq, &mine)) return TP_SUCCESS; /* no segment across hosts */
  for (int i = 1; i < n; i++) {
    int p = (r + i) % n;
    if (read_desc(x, p, x->seq, &theirs) && !same_call(&theirs, &mine, p, r)) return mismatch(x, p, &theirs, &mine);
  }
  return TP_SUCCESS;
}

tp_status_t tp_nccl_post(nccl_ctx *x, const tp_coll_args_t *a) {
  uint32_t seq = ++x->seq;
  if (seq == 0) seq = ++x->seq;     /* 0 means empty */
  if (!x->slots) return TP_SUCCESS; /* across hosts: no descriptors (NCCL's own checks only) */
  nccl_slot_t *s = &x->slots[x->comm->rank];
  nccl_desc_t *d = &s->ring[seq % NCCL_RING];
  atomic_store_explicit(&d->seq, 0, memory_order_relaxed);
  atomic_thread_fence(memory_order_release);
  d->kind = (uint32_t)a->kind, d->dtype = (uint32_t)a->dtype, d->op = (uint32_t)a->op;
  d->root = a->root, d->count = a->count, d->total = a->total;
  d->counts_hash = counts_hash(a, x->comm->size);
  atomic_store_explicit(&d->seq, seq, memory_order_release);
  atomic_store_explicit(&s->last_seq, seq, memory_order_release);
  return check_peers(x);
}

/* ------------------------------------------------------------ waits */

void tp_nccl_note_stream(nccl_ctx *x, tp_stream_t stream) {
  for (int i = 0; i < x->nstreams; i++)
    if (x->streams[i] == stream) return;
  if (x->nstreams < NCCL_MAX_STREAMS) x->streams[x->nstreams++] = stream;
  else x->streams[NCCL_MAX_STREAMS - 1] = stream; /* destroy waits on the latest ones */
}

/* Aborts the NCCL communicator from the thread that is in NCCL's calls (this one). */
static void abort_nc(nccl_ctx *x) {
  if (x->slots) atomic_store(&x->slots[x->comm->rank].state, NCCL_STATE_FAILED);
  if (x->nc) {
    x->api->CommAbort(x->nc);
    x->nc = NULL;
  }
}

/* This rank's process in its slot, for the peers' liveness checks. */
static void claim_slot(nccl_ctx *x) {
  int pid = (int)getpid();
  char state;
  atomic_store(&x->slots[x->comm->rank].start, tp_shm_proc_starttime(pid, &state));
  atomic_store(&x->slots[x->comm->rank].pid, pid);
}

/* A peer whose process is gone (exited, killed, a zombie, or its pid reused), looked at every
 * 50 ms of a wait: NCCL itself would wait for it until the timeout.  The ranks share a host
 * (this backend's scope), so /proc tells. */
static tp_status_t check_alive(nccl_ctx *x, const char *what) {
  if (!x->slots) return TP_SUCCESS;
  double now = tp_now();
  if (now < x->next_alive_check) return TP_SUCCESS;
  x->next_alive_check = now + 0.05;
  for (int p = 0; p < x->comm->size; p++) {
    if (p == x->comm->rank) continue;
    int pid = atomic_load(&x->slots[p].pid);
    if (pid <= 0) continue; /* not mapped yet: init's own timeout covers it */
    uint64_t want = atomic_load(&x->slots[p].start);
    char state = '?';
    uint64_t st = tp_shm_proc_starttime(pid, &state);
    int dead = st == 0 ? (kill(pid, 0) != 0 && errno == ESRCH) : (state == 'Z' || state == 'X' || (want && st != want));
    if (dead) {
      abort_nc(x);
      return tp_set_error(TP_ERR_REMOTE,
                          "%s on rank %d of %d: rank %d (pid %d) died while this rank waited "
                          "for it",
                          what, x->comm->rank, x->comm->size, p, pid);
    }
  }
  return TP_SUCCESS;
}

/* A peer's failure or death, an abort of this rank, or an asynchronous NCCL error. */
static tp_status_t poll_failures(nccl_ctx *x, const char *what) {
  if (atomic_load(&x->abort_flag)) {
    abort_nc(x);
    return tp_set_error(TP_ERR_ABORTED, "%s on rank %d of %d: the communicator was aborted: %s", what, x->comm->rank,
                        x->comm->size, x->abort_reason);
  }
  for (int p = 0; x->slots && p < x->comm->size; p++)
    if (p != x->comm->rank && atomic_load(&x->slots[p].state) == NCCL_STATE_FAILED) {
      tp_status_t st = check_peers(x); /* a peer that saw a mismatch: the same sentence here */
      abort_nc(x);
      if (st != TP_SUCCESS) return st;
      return tp_set_error(TP_ERR_REMOTE, "%s on rank %d of %d: rank %d failed or aborted the communicator", what,
                          x->comm->rank, x->comm->size, p);
    }
  TP_CHECK(check_alive(x, what));
  if (x->nc) {
    ncclResult_t ar = ncclSuccess;
    ncclResult_t r = x->api->CommGetAsyncError(x->nc, &ar);
    if (r != ncclSuccess) return tp_nccl_error(x, "ncclCommGetAsyncError", r);
    if (ar != ncclSuccess && ar != ncclInProgress) {
      tp_status_t st = tp_nccl_error(x, what, ar);
      abort_nc(x);
      return st;
    }
  }
  return TP_SUCCESS;
}

/* Rank p's latest collective, "all_reduce #61" ("" before its first). */
static void last_call(nccl_ctx *x, int p, char *buf, size_t n) {
  uint32_t last = atomic_load(&x->slots[p].last_seq);
  nccl_desc_t d;
  if (!last) buf[0] = '\0';
  else if (read_desc(x, p, last, &d)) snprintf(buf, n, "%s #%u", tp_coll_name((tp_coll_kind_t)d.kind), (unsigned)last);
  else snprintf(buf, n, "#%u", (unsigned)last);
}

void tp_nccl_laggards(nccl_ctx *x, char *buf, size_t cap) {
  enum { T = 64 };
  int n = x->comm->size;
  buf[0] = '\0';
  if (!x->slots) { /* across hosts: no descriptor segment */
    snprintf(buf, cap, " (the ranks span hosts: which of them did not arrive is not known here)");
    return;
  }
  char (*late)[T] = calloc((size_t)n, T); /* a late rank's last call ("-": none, "+": in init) */
  if (!late) return;
  for (int p = 0; p < n; p++) {
    if (p == x->comm->rank) continue;
    if (atomic_load(&x->slots[p].state) == NCCL_STATE_INIT) late[p][0] = '+';
    else if (atomic_load(&x->slots[p].last_seq) < x->seq) last_call(x, p, late[p], T);
    else continue;
    if (!late[p][0]) late[p][0] = '-';
  }
  tp_late_ranks(&late[0][0], n, T, "no collective call", buf, cap);
  free(late);
}

static tp_status_t timeout_error(nccl_ctx *x, const char *what) {
  char who[512], at[48] = "";
  tp_nccl_laggards(x, who, sizeof who);
  tp_status_t st = check_peers(x); /* a different call for the same seq names both sides */
  abort_nc(x);
  if (st != TP_SUCCESS) return st;
  if (x->seq) snprintf(at, sizeof at, " waiting for collective #%u", (unsigned)x->seq);
  return tp_set_error(TP_ERR_TIMEOUT, "%s on rank %d of %d: timed out after %g s%s%s", what, x->comm->rank,
                      x->comm->size, x->comm->timeout_s, at,
                      who[0] ? who : " (every peer has called it: a GPU hang or a mismatch NCCL cannot see)");
}

static void pause_briefly(int *spins) {
  if (++*spins < 64) return;
  usleep(*spins < 1000 ? 50 : 500);
}

/* A peer's failed state or an abort of this rank, without asking NCCL. */
static tp_status_t peer_or_abort(nccl_ctx *x, const char *what) {
  if (atomic_load(&x->abort_flag)) return poll_failures(x, what);
  for (int p = 0; x->slots && p < x->comm->size; p++)
    if (p != x->comm->rank && atomic_load(&x->slots[p].state) == NCCL_STATE_FAILED) return poll_failures(x, what);
  return check_alive(x, what);
}

/* Polls the communicator `on` (the new one after a split) while it says ncclInProgress. */
static tp_status_t settle_on(nccl_ctx *x, ncclComm_t on, const char *call, ncclResult_t r) {
  if (r == ncclSuccess) return TP_SUCCESS;
  if (r != ncclInProgress) return tp_nccl_error(x, call, r);
  double deadline = tp_now() + x->comm->timeout_s;
  int spins = 0;
  for (;;) {
    ncclResult_t ar = ncclSuccess;
    ncclResult_t q = x->api->CommGetAsyncError(on, &ar);
    if (q != ncclSuccess) return tp_nccl_error(x, "ncclCommGetAsyncError", q);
    if (ar == ncclSuccess) return TP_SUCCESS;
    if (ar != ncclInProgress) return tp_nccl_error(x, call, ar);
    if (x->slots) TP_CHECK(peer_or_abort(x, call));
    if (tp_now() > deadline) return timeout_error(x, call);
    pause_briefly(&spins);
  }
}

tp_status_t tp_nccl_settle(nccl_ctx *x, const char *call, ncclResult_t r) { return settle_on(x, x->nc, call, r); }

tp_status_t tp_nccl_wait(nccl_ctx *x, tp_stream_t stream, const char *what) {
  double deadline = tp_now() + x->comm->timeout_s;
  int spins = 0;
  for (;;) {
    int done = 0;
    tp_status_t st = tp_device_query(TP_DEVICE_CUDA, x->device_id, stream, &done);
    if (st != TP_SUCCESS) {
      char msg[768];
      snprintf(msg, sizeof msg, "%s", tp_last_error());
      abort_nc(x);
      return tp_set_error(st, "%s on rank %d of %d: %s", what, x->comm->rank, x->comm->size, msg);
    }
    if (done) return TP_SUCCESS;
    TP_CHECK(poll_failures(x, what));
    if ((spins & 255) == 255) TP_CHECK(check_peers(x));
    if (tp_now() > deadline) return timeout_error(x, what);
    pause_briefly(&spins);
  }
}

/* ------------------------------------------------------------ init */

static uint64_t fnv1a(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

static void free_ctx(nccl_ctx *x) {
  if (!x) return;
  if (x->scratch) tp_device_free(TP_DEVICE_CUDA, x->device_id, x->scratch);
  if (x->slots) munmap(x->slots, x->seg_bytes);
  if (x->seg_fd >= 0) tp_seg_leave(x->seg_name, x->seg_fd);
  if (x->host) tp_comm_destroy(x->host);
  if (x->store) tp_store_close(x->store);
  free(x);
}

/* Rank 0 creates the descriptor segment before `publish` (the host broadcast or
 * barrier); the others open it after. */
static tp_status_t seg_create(nccl_ctx *x) {
  int exists = 0;
  void *base = NULL;
  tp_status_t st = tp_seg_create(x->seg_name, x->seg_bytes, &base, &x->seg_fd, &exists);
  if (exists) {
    /* A dead job's leftover of the same name (no live process locks it): sweep and retry once. */
    tp_seg_sweep(x->seg_name + 1);
    st = tp_seg_create(x->seg_name, x->seg_bytes, &base, &x->seg_fd, &exists);
  }
  if (st != TP_SUCCESS) return st;
  memset(base, 0, x->seg_bytes);
  x->slots = base;
  claim_slot(x);
  return TP_SUCCESS;
}

static tp_status_t seg_open(nccl_ctx *x) {
  int fd = -1;
  size_t nb = 0;
  TP_CHECK(tp_seg_open(x->seg_name, &fd, &nb));
  if (fd < 0 || nb < x->seg_bytes || !tp_seg_lock(x->seg_name, fd)) {
    if (fd >= 0) tp_seg_close(fd);
    return tp_set_error(TP_ERR_SYSTEM, "nccl on rank %d: the descriptor segment %s is missing or too small",
                        x->comm->rank, x->seg_name);
  }
  x->seg_fd = fd;
  x->slots = tp_seg_map(fd, x->seg_bytes);
  if (!x->slots) return tp_set_error(TP_ERR_SYSTEM, "nccl on rank %d: cannot map %s", x->comm->rank, x->seg_name);
  claim_slot(x);
  return TP_SUCCESS;
}

/* Once the NCCL communicator is up every rank has mapped the descriptor segment (each
 * opens it before ncclCommInitRank / ncclCommSplit, which complete only when all ranks
 * joined): its name goes now, so that a job killed later leaves nothing in /dev/shm. */
static void seg_forget_name(nccl_ctx *x) {
  if (x->seg_fd < 0) return;
  if (tp_seg_same(x->seg_name, x->seg_fd)) shm_unlink(x->seg_name);
  tp_seg_close(x->seg_fd);
  x->seg_fd = -1;
}

/* Picks and checks the device: config.device_id, else $LOCAL_RANK, else 0. */
static tp_status_t pick_device(struct tp_comm *c, int *out) {
  int id = c->device_id;
  if (id < 0) {
    const char *lr = getenv("LOCAL_RANK");
    id = lr && *lr ? atoi(lr) : 0;
  }
  const tp_device_ops *ops = tp_device_ops_of(TP_DEVICE_CUDA);
  int n = ops && ops->count ? ops->count() : 0;
  if (id < 0 || id >= n)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "nccl on rank %d: device %d is not one of this process's %d CUDA devices "
                        "(config.device_id, else LOCAL_RANK; CUDA_VISIBLE_DEVICES limits them)",
                        c->rank, id, n);
  TP_CHECK(tp_device_set_current(TP_DEVICE_CUDA, id));
  *out = id;
  return TP_SUCCESS;
}

static tp_status_t new_ctx(struct tp_comm *c, const tp_nccl_api_t *api, const char *comm_id, nccl_ctx **out) {
  nccl_ctx *x = calloc(1, sizeof *x);
  if (!x) return tp_set_error(TP_ERR_NOMEM, "nccl: out of memory");
  x->comm = c, x->api = api, x->seg_fd = -1;
  atomic_init(&x->abort_flag, 0);
  snprintf(x->comm_id, sizeof x->comm_id, "%s", comm_id);
  snprintf(x->seg_name, sizeof x->seg_name, "/%snccl_%s_%016llx", TP_SEG_PREFIX, c->job_id,
           (unsigned long long)fnv1a(comm_id));
  x->seg_bytes = sizeof(nccl_slot_t) * (size_t)c->size;
  *out = x;
  return TP_SUCCESS;
}

/* Polls a non-blocking init or split to its end, under the timeout. */
static tp_status_t finish_init(nccl_ctx *x, const char *call, ncclResult_t r) {
  tp_status_t st = tp_nccl_settle(x, call, r);
  if (st != TP_SUCCESS) {
    abort_nc(x);
    return st;
  }
  if (x->slots) atomic_store(&x->slots[x->comm->rank].state, NCCL_STATE_READY);
  return TP_SUCCESS;
}

static tp_status_t init_nccl(nccl_ctx *x, const ncclUniqueId *id) {
  ncclConfig_t cfg = TP_NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclResult_t r = x->api->CommInitRankConfig(&x->nc, x->comm->size, *id, x->comm->rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    tp_status_t st = tp_nccl_error(x, "ncclCommInitRankConfig", r);
    abort_nc(x);
    return st;
  }
  return finish_init(x, "ncclCommInitRankConfig", r);
}

/* Whether the ranks meet through the job's store instead of shared memory: TPCORE_NCCL_BOOTSTRAP
 * ("store" or "shm"), else a job over several hosts (TPCORE_NNODES > 1, or a world communicator
 * with fewer local ranks, LOCAL_WORLD_SIZE, than ranks). */
int tp_nccl_bootstrap_store(int size, int world_comm) {
  const char *how = getenv("TPCORE_NCCL_BOOTSTRAP");
  if (how && strcmp(how, "store") == 0) return 1;
  if (how && strcmp(how, "shm") == 0) return 0;
  const char *nn = getenv("TPCORE_NNODES"), *lws = getenv("LOCAL_WORLD_SIZE");
  if (nn && atoi(nn) > 1) return 1;
  return world_comm && lws && *lws && atoi(lws) > 0 && atoi(lws) < size;
}

/* The store connection of an init across hosts (closed once the id went through). */
static tp_status_t tp_nccl_store_init(nccl_ctx *x) {
  const char *how = getenv("TPCORE_NCCL_BOOTSTRAP");
  if (how && *how && strcmp(how, "store") != 0 && strcmp(how, "shm") != 0)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "TPCORE_NCCL_BOOTSTRAP must be 'store' or 'shm', got '%s'", how);
  char who[64];
  snprintf(who, sizeof who, "nccl init on rank %d of %d", x->comm->rank, x->comm->size);
  return tp_job_store_open(&x->store, x->comm->timeout_s, who);
}

/* A split's new rank and size from every rank's (color, key), through the store. */
static tp_status_t store_split(nccl_ctx *x, int color, int key, int *nrank, int *nsize) {
  char who[64], prefix[TP_STORE_MAX_KEY + 1];
  snprintf(who, sizeof who, "nccl split on rank %d of %d", x->comm->rank, x->comm->size);
  tp_store_t s;
  TP_CHECK(tp_job_store_open(&s, x->comm->timeout_s, who));
  snprintf(prefix, sizeof prefix, "tpcore/nccl/%s/%s/split%d", x->comm->job_id, x->comm_id, x->nsplits);
  tp_status_t st = tp_store_split_ranks(s, prefix, x->comm->rank, x->comm->size, color == TP_SPLIT_NOCOLOR ? -1 : color,
                                        key, nrank, nsize);
  if (st != TP_SUCCESS) tp_error_prefix("%s", who);
  tp_store_close(s);
  return st;
}

tp_status_t tp_nccl_comm_init(struct tp_comm *c, const char *comm_id, int world_comm) {
  const tp_nccl_api_t *api;
  TP_CHECK(load_api(&api));
  TP_CHECK(need_cuda());
  nccl_ctx *x;
  TP_CHECK(new_ctx(c, api, comm_id, &x));
  x->store_mode = tp_nccl_bootstrap_store(c->size, world_comm);
  if (x->store_mode) {
    /* The store outlives communicators: each init of the same id in this job (every rank makes
     * them in the same order) has keys of its own. */
    static atomic_int generation;
    snprintf(x->comm_id, sizeof x->comm_id, "%.60s.g%d", comm_id, atomic_fetch_add(&generation, 1));
  }
  tp_status_t st = pick_device(c, &x->device_id);
  if (x->store_mode && (st == TP_SUCCESS || c->rank == 0)) {
    /* rank 0 connects even after a local failure: it publishes the failure for the others */
    tp_status_t ost = tp_nccl_store_init(x);
    if (st == TP_SUCCESS) st = ost;
  } else if (st == TP_SUCCESS && !x->store_mode) {
    tp_comm_config_t hc = TP_COMM_CONFIG_INITIALIZER;
    hc.backend = "shm", hc.job_id = c->job_id, hc.timeout_s = c->timeout_s, hc.spin_us = c->spin_us;
    hc.registered_memory = 0, hc.job_id_unique = c->job_id_unique;
    st = tp_comm_init_rank(&x->host, c->size, c->rank, &hc);
  }
  /* The unique id: made on rank 0, broadcast over the host communicator. */
  struct {
    ncclUniqueId id;
    int version;
    int status;
  } msg;
  memset(&msg, 0, sizeof msg);
  if (st == TP_SUCCESS && c->rank == 0 && !x->store_mode) {
    st = seg_create(x);
    ncclResult_t r = st == TP_SUCCESS ? api->GetUniqueId(&msg.id) : ncclSuccess;
    if (st == TP_SUCCESS && r != ncclSuccess) st = tp_nccl_error(x, "ncclGetUniqueId", r);
    msg.version = api->version;
    msg.status = st == TP_SUCCESS ? 0 : 1;
  }
  if (x->host && (st == TP_SUCCESS || c->rank == 0)) {
    tp_status_t bst = tp_broadcast(&msg, &msg, sizeof msg, TP_UINT8, 0, x->host, NULL);
    if (st == TP_SUCCESS) st = bst;
  }
  if (x->store_mode && x->store && (st == TP_SUCCESS || c->rank == 0)) {
    /* Across hosts: the id travels through the job's store (rank 0 publishes, even its failure). */
    if (c->rank == 0) {
      msg.version = api->version;
      if (st == TP_SUCCESS) {
        ncclResult_t r = api->GetUniqueId(&msg.id);
        if (r != ncclSuccess) st = tp_nccl_error(x, "ncclGetUniqueId", r);
      }
      msg.status = st == TP_SUCCESS ? 0 : 1;
    }
    char key[TP_STORE_MAX_KEY + 1];
    snprintf(key, sizeof key, "tpcore/nccl/%s/%s/id", c->job_id, x->comm_id);
    tp_status_t bst = tp_store_bcast(x->store, key, c->rank, 0, &msg, sizeof msg);
    if (bst != TP_SUCCESS) tp_error_prefix("nccl init on rank %d of %d", c->rank, c->size);
    if (st == TP_SUCCESS) st = bst;
    tp_store_close(x->store);
    x->store = NULL;
  }
  if (st == TP_SUCCESS && msg.status)
    st = tp_set_error(TP_ERR_REMOTE, "nccl init on rank %d: rank 0 could not make the NCCL unique id", c->rank);
  if (st == TP_SUCCESS && msg.version != api->version)
    st = tp_set_error(TP_ERR_MISMATCH, "nccl init on rank %d: rank 0 loaded NCCL %d, this rank %d (%s)", c->rank,
                      msg.version, api->version, tp_dynlib_path(api->lib));
  if (st == TP_SUCCESS && c->rank != 0 && !x->store_mode) st = seg_open(x);
  if (st == TP_SUCCESS) st = tp_device_alloc(TP_DEVICE_CUDA, x->device_id, 16, &x->scratch);
  if (st == TP_SUCCESS) st = init_nccl(x, &msg.id);
  if (st == TP_SUCCESS) seg_forget_name(x);
  if (st != TP_SUCCESS) {
    char m[1024];
    snprintf(m, sizeof m, "%s", tp_last_error());
    if (x->slots) atomic_store(&x->slots[c->rank].state, NCCL_STATE_FAILED);
    if (x->host) tp_comm_abort(x->host, m);
    free_ctx(x);
    return tp_set_error(st, "%s", m);
  }
  (void)world_comm;
  c->ops = &tp_nccl_ops;
  c->impl = x;
  c->stage_device = TP_DEVICE_CUDA, c->stage_device_id = x->device_id;
  return TP_SUCCESS;
}

/* ------------------------------------------------------------ split, abort, destroy */

tp_status_t tp_nccl_split(struct tp_comm *c, int color, int key, struct tp_comm **out) {
  nccl_ctx *x = c->impl;
  *out = NULL;
  tp_comm_t host = NULL;
  int nrank = 0, nsize = 0;
  if (x->store_mode) TP_CHECK(store_split(x, color, key, &nrank, &nsize));
  else TP_CHECK(tp_comm_split(x->host, color, key, &host));
  char id[96];
  snprintf(id, sizeof id, "%.60ss%dc%d", x->comm_id, x->nsplits++, color);
  if (color == TP_SPLIT_NOCOLOR) {
    ncclComm_t none = NULL;
    ncclResult_t r = x->api->CommSplit(x->nc, TP_NCCL_SPLIT_NOCOLOR, key, &none, NULL);
    return tp_nccl_settle(x, "ncclCommSplit", r);
  }
  if (host) {
    tp_comm_rank(host, &nrank);
    tp_comm_size(host, &nsize);
  }
  struct tp_comm *nc;
  tp_status_t st = tp_comm_alloc_common(&nc, nsize, nrank, c->job_id, c->timeout_s, c->spin_us);
  if (st != TP_SUCCESS) {
    tp_comm_destroy(host);
    return st;
  }
  nc->device_id = x->device_id;
  nccl_ctx *y = NULL;
  st = new_ctx(nc, x->api, id, &y);
  if (st != TP_SUCCESS) {
    tp_comm_destroy(host);
    free(nc);
    return st;
  }
  y->host = host, y->device_id = x->device_id, y->store_mode = x->store_mode;
  if (!y->store_mode) { /* across hosts: no descriptor segment */
    if (nrank == 0) st = seg_create(y);
    tp_status_t bst = tp_barrier(host, NULL);
    if (st == TP_SUCCESS) st = bst;
    if (st == TP_SUCCESS && nrank != 0) st = seg_open(y);
  }
  if (st == TP_SUCCESS) st = tp_device_alloc(TP_DEVICE_CUDA, y->device_id, 16, &y->scratch);
  ncclConfig_t cfg = TP_NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  /* Every rank of the parent must call ncclCommSplit, even after a local failure. */
  ncclResult_t r = x->api->CommSplit(x->nc, color, key, &y->nc, &cfg);
  /* Non-blocking: the new communicator's state says when the split is done. */
  tp_status_t sst = r != ncclSuccess && r != ncclInProgress ? tp_nccl_error(x, "ncclCommSplit", r)
                    : !y->nc ? tp_set_error(TP_ERR_INTERNAL, "ncclCommSplit gave no communicator")
                             : TP_SUCCESS;
  if (st == TP_SUCCESS) st = sst;
  if (st == TP_SUCCESS) st = finish_init(y, "ncclCommSplit", r);
  if (st == TP_SUCCESS) seg_forget_name(y);
  if (st != TP_SUCCESS) {
    char m[1024];
    snprintf(m, sizeof m, "%s", tp_last_error());
    if (y->nc) abort_nc(y);
    free_ctx(y);
    free(nc);
    return tp_set_error(st, "%s", m);
  }
  nc->ops = &tp_nccl_ops;
  nc->impl = y;
  nc->stage_device = TP_DEVICE_CUDA, nc->stage_device_id = y->device_id;
  *out = nc;
  return TP_SUCCESS;
}

void tp_nccl_abort(struct tp_comm *c, const char *reason) {
  nccl_ctx *x = c->impl;
  if (!x) return;
  if (!atomic_load(&x->abort_flag)) snprintf(x->abort_reason, sizeof x->abort_reason, "%s", reason);
  atomic_store(&x->abort_flag, 1);
  if (x->slots) atomic_store(&x->slots[c->rank].state, NCCL_STATE_FAILED);
  if (x->host) tp_comm_abort(x->host, reason);
}

void tp_nccl_forget_mems(nccl_ctx *x);

void tp_nccl_destroy(struct tp_comm *c) {
  nccl_ctx *x = c->impl;
  if (!x) return;
  int clean = !atomic_load(&x->abort_flag) && atomic_load(&c->failed) != 1 && x->nc;
  for (int i = 0; clean && i < x->nstreams; i++)
    if (tp_nccl_wait(x, x->streams[i], "destroy") != TP_SUCCESS) clean = 0;
  tp_nccl_forget_mems(x);
  if (clean) {
    ncclResult_t r = x->api->CommFinalize(x->nc);
    if (tp_nccl_settle(x, "ncclCommFinalize", r) != TP_SUCCESS) clean = 0;
  }
  if (x->nc) {
    if (clean) x->api->CommDestroy(x->nc);
    else x->api->CommAbort(x->nc);
    x->nc = NULL;
  }
  free_ctx(x);
  c->impl = NULL;
}
