/*
 * The mpi backend (libtpcore_mpi.so; its ABI is csrc/comm/mpi_abi.h).  The only file of
 * tpcore that includes <mpi.h>: built with mpicc's flags (setup.py, the Makefile) when an
 * MPI is found, opened by the core on first use (csrc/comm/mpi_load.c).
 *
 * Every operation is a non-blocking MPI call (MPI_Iallreduce, MPI_Isend, ...) polled with
 * MPI_Test under the communicator's timeout, so no call can hang for ever: a peer that
 * never arrives is a TP_ERR_TIMEOUT naming the operation and the peer; a rank that aborts
 * (tp_comm_abort, Python's excepthook) tells the others through a control communicator,
 * and they fail with TP_ERR_REMOTE naming it.  Before each collective the ranks exchange
 * a small description of the call (sequence number, op, dtype, counts, root) and compare
 * it, as the shm backend does, so a mismatch is TP_ERR_MISMATCH naming both sides rather
 * than an MPI truncation or garbage (TPCORE_MPI_CHECK=0 turns the exchange off).
 *
 * Reductions: MPI's own ops for sum/prod of the standard types and for integers; the
 * core's reduce kernels (through user-defined MPI ops) for float16/bfloat16 and for the
 * min/max of floats (NumPy's NaN propagation).  avg widens to an accumulator (float32 for
 * the 16-bit floats and float32, float64, int64 for 8/32-bit integers, 128 bits for
 * int64), sums, divides (integers truncating toward zero) and narrows: the shm backend's
 * semantics.  Host buffers only; counts above INT_MAX elements are refused.
 */
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

#include "../comm/mpi_abi.h"

#define EXPORT __attribute__((visibility("default")))
#define STR2_(x) #x
#define STR_(x) STR2_(x)
#define BUILD_VERSION STR_(TP_VERSION_MAJOR) "." STR_(TP_VERSION_MINOR) "." STR_(TP_VERSION_PATCH)

static const tp_mpi_host_api *H;

/* ---- the core's helpers, through the host table ------------------------------------- */

tp_status_t tp_set_error(tp_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  tp_status_t s = H->set_error_v(status, fmt, ap);
  va_end(ap);
  return s;
}

void tp_error_prefix(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  H->error_prefix_v(fmt, ap);
  va_end(ap);
}

/* ---- process-wide MPI state ---------------------------------------------------------- */

#define TAG_P2P 11
#define TAG_ABORT 12
#define NOTE_MAX 512

static int we_initialised;  /* MPI_Init_thread was ours: MPI_Finalize at exit */
static int thread_level;    /* what MPI_Init_thread provided */
/* An operation was left in flight, or a peer failed: skip MPI_Finalize (it waits for every rank).
 * A mismatch that every rank saw leaves nothing in flight and does not count. */
static atomic_int any_failed;
static int check_calls = 1; /* TPCORE_MPI_CHECK */
static char library[256];
static MPI_Datatype dt_f16 = MPI_DATATYPE_NULL, dt_bf16 = MPI_DATATYPE_NULL, dt_i128 = MPI_DATATYPE_NULL;
static MPI_Op user_ops[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}; /* sum prod min max */
static MPI_Op op_sum_i128 = MPI_OP_NULL;

typedef struct {
  MPI_Comm mc;          /* the operations' communicator                   */
  MPI_Comm ctrl;        /* abort notes: one MPI_Irecv from any rank, always posted */
  MPI_Request ctrl_req;
  char ctrl_note[NOTE_MAX];
  char *abort_note;     /* what this rank sent on abort (kept until the sends complete) */
  MPI_Request *abort_reqs;
  int nabort;
  atomic_int abort_claimed; /* the first tp_comm_abort of this rank (prepares abort_note) */
  atomic_int aborted;   /* tp_comm_abort was called on this rank (abort_note is ready) */
  atomic_int notes_sent; /* the notes went (or are going) out: one thread sends them, once */
  int pending;          /* an operation timed out with its request still active */
  uint64_t seq;         /* collectives called so far (the description's sequence number) */
} mpi_ctx;

static tp_status_t mpi_error(struct tp_comm *comm, int rc, const char *what) {
  char text[MPI_MAX_ERROR_STRING + 1];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = snprintf(text, sizeof text, "MPI error %d", rc);
  text[len < 0 ? 0 : len > MPI_MAX_ERROR_STRING ? MPI_MAX_ERROR_STRING : len] = '\0';
  atomic_store(&any_failed, 1);
  return tp_set_error(TP_ERR_REMOTE, "%s on rank %d of %d: MPI failed: %s", what, comm->rank, comm->size, text);
}

#define MPI_TRY(comm, call, what)                     \
  do {                                                \
    int rc_ = (call);                                 \
    if (rc_ != MPI_SUCCESS) return mpi_error(comm, rc_, what); \
  } while (0)

/* ---- user-defined reductions ---------------------------------------------------------- */

static int user_dtype(MPI_Datatype t, tp_dtype_t *out) {
  if (t == dt_f16) *out = TP_FLOAT16;
  else if (t == dt_bf16) *out = TP_BFLOAT16;
  else if (t == MPI_FLOAT) *out = TP_FLOAT32;
  else if (t == MPI_DOUBLE) *out = TP_FLOAT64;
  else return 0;
  return 1;
}

/* MPI's contract: inout[i] = in[i] op inout[i]. */
static void user_reduce(void *in, void *inout, int *len, MPI_Datatype *type, tp_redop_t op) {
  tp_dtype_t d;
  if (!user_dtype(*type, &d) || *len <= 0) return;
  const void *srcs[2] = {in, inout};
  H->reduce_n(inout, NULL, srcs, 2, (size_t)*len, d, op);
}
static void user_sum(void *a, void *b, int *n, MPI_Datatype *t) { user_reduce(a, b, n, t, TP_SUM); }
static void user_prod(void *a, void *b, int *n, MPI_Datatype *t) { user_reduce(a, b, n, t, TP_PROD); }
static void user_min(void *a, void *b, int *n, MPI_Datatype *t) { user_reduce(a, b, n, t, TP_MIN); }
static void user_max(void *a, void *b, int *n, MPI_Datatype *t) { user_reduce(a, b, n, t, TP_MAX); }

static void sum_i128(void *in, void *inout, int *len, MPI_Datatype *type) {
  (void)type;
  __int128 v, w;
  for (int i = 0; i < *len; i++) {
    memcpy(&v, (char *)in + 16 * (size_t)i, 16);
    memcpy(&w, (char *)inout + 16 * (size_t)i, 16);
    w = (__int128)((unsigned __int128)v + (unsigned __int128)w);
    memcpy((char *)inout + 16 * (size_t)i, &w, 16);
  }
}

static MPI_Datatype mpi_type(tp_dtype_t d) {
  switch (d) {
    case TP_FLOAT32: return MPI_FLOAT;
    case TP_FLOAT64: return MPI_DOUBLE;
    case TP_FLOAT16: return dt_f16;
    case TP_BFLOAT16: return dt_bf16;
    case TP_INT8: return MPI_INT8_T;
    case TP_UINT8: return MPI_UINT8_T;
    case TP_INT32: return MPI_INT32_T;
    case TP_INT64: return MPI_INT64_T;
    default: return MPI_DATATYPE_NULL;
  }
}

/* The MPI op for (dtype, op), op not avg. */
static MPI_Op mpi_op(tp_dtype_t d, tp_redop_t op) {
  int user = d == TP_FLOAT16 || d == TP_BFLOAT16 ||
             ((d == TP_FLOAT32 || d == TP_FLOAT64) && (op == TP_MIN || op == TP_MAX));
  if (user) return user_ops[op];
  switch (op) {
    case TP_SUM: return MPI_SUM;
    case TP_PROD: return MPI_PROD;
    case TP_MIN: return MPI_MIN;
    default: return MPI_MAX;
  }
}

/* ---- waiting under the timeout --------------------------------------------------------- */

static void send_abort_notes(struct tp_comm *comm, mpi_ctx *x);

/* Between two MPI_Tests.  Open MPI moves a non-blocking collective on only inside MPI_Test (no
 * progress thread), so a wait sleeps only once it has lasted long (waited_s): spin, then yield
 * the core (other ranks on it run), then short sleeps after 0.2 s. */
static void pause_briefly(long *spins, double waited_s) {
  ++*spins;
  if (*spins < 2000) return;
  if (waited_s < 0.2) {
    sched_yield();
    return;
  }
  struct timespec ts = {0, 50000};
  nanosleep(&ts, NULL);
}

/* A peer's abort note, if one has arrived. */
static tp_status_t check_ctrl(struct tp_comm *comm, mpi_ctx *x, const char *what) {
  if (x->ctrl_req == MPI_REQUEST_NULL) return TP_SUCCESS;
  int done = 0;
  MPI_Status s;
  if (MPI_Test(&x->ctrl_req, &done, &s) != MPI_SUCCESS || !done) return TP_SUCCESS;
  x->ctrl_note[NOTE_MAX - 1] = '\0';
  atomic_store(&any_failed, 1);
  return tp_set_error(TP_ERR_REMOTE, "%s on rank %d of %d: rank %d failed: %s", what, comm->rank, comm->size,
                      s.MPI_SOURCE, x->ctrl_note);
}

/* Waits for n (1 or 2) requests; peer (>= 0) is named on a timeout. */
static tp_status_t wait_all(struct tp_comm *comm, mpi_ctx *x, MPI_Request *reqs, int n, MPI_Status *stats,
                            const char *what, int peer) {
  double t0 = H->now(), next_ctrl = 0;
  long spins = 0;
  MPI_Status own[2]; /* n <= 2: the statuses say which error MPI_ERR_IN_STATUS stands for */
  if (!stats) stats = own;
  for (;;) {
    int done = 0;
    int rc = MPI_Testall(n, reqs, &done, stats);
    if (rc != MPI_SUCCESS) {
      if (rc == MPI_ERR_IN_STATUS)
        for (int i = 0; i < n; i++)
          if (stats[i].MPI_ERROR != MPI_SUCCESS && stats[i].MPI_ERROR != MPI_ERR_PENDING) {
            rc = stats[i].MPI_ERROR;
            break;
          }
      x->pending = 1;
      return mpi_error(comm, rc, what);
    }
    if (done) return TP_SUCCESS;
    double now = H->now();
    if (now >= next_ctrl) { /* the abort channel: at most every 100 us */
      next_ctrl = now + 1e-4;
      tp_status_t st = check_ctrl(comm, x, what);
      if (st != TP_SUCCESS) {
        x->pending = 1;
        return st;
      }
      if (atomic_load(&x->aborted)) {
        send_abort_notes(comm, x);
        x->pending = 1;
        return tp_set_error(TP_ERR_ABORTED, "%s on rank %d of %d: this rank aborted the communicator", what,
                            comm->rank, comm->size);
      }
    }
    if (now - t0 > comm->timeout_s) {
      x->pending = 1;
      atomic_store(&any_failed, 1);
      if (peer >= 0)
        return tp_set_error(TP_ERR_TIMEOUT, "%s on rank %d of %d: timed out after %.1f s waiting for rank %d", what,
                            comm->rank, comm->size, comm->timeout_s, peer);
      return tp_set_error(TP_ERR_TIMEOUT, "%s on rank %d of %d: timed out after %.1f s (not every rank of the "
                          "communicator reached it: one may have died, hung or called another operation)", what,
                          comm->rank, comm->size, comm->timeout_s);
    }
    pause_briefly(&spins, now - t0);
  }
}

static tp_status_t wait_one(struct tp_comm *comm, mpi_ctx *x, MPI_Request *req, const char *what, int peer) {
  return wait_all(comm, x, req, 1, NULL, what, peer);
}

/* ---- the call's description, compared across ranks --------------------------------- */

enum { D_SEQ, D_KIND, D_DTYPE, D_OP, D_ROOT, D_COUNT, D_HASH, D_N };

static void describe(const int64_t *d, char *buf, size_t n) {
  tp_coll_kind_t k = (tp_coll_kind_t)d[D_KIND];
  int len = snprintf(buf, n, "%s #%lld", H->coll_name(k), (long long)d[D_SEQ]);
  if (len < 0 || (size_t)len >= n || k == TP_COLL_BARRIER || k == TP_COLL_SPLIT) return;
  len += snprintf(buf + len, n - (size_t)len, " (%s", tp_dtype_name((tp_dtype_t)d[D_DTYPE]));
  if ((size_t)len < n && (k == TP_COLL_ALL_REDUCE || k == TP_COLL_REDUCE || k == TP_COLL_REDUCE_SCATTER))
    len += snprintf(buf + len, n - (size_t)len, " %s", H->redop_name((tp_redop_t)d[D_OP]));
  if ((size_t)len < n && (k == TP_COLL_BROADCAST || k == TP_COLL_REDUCE))
    len += snprintf(buf + len, n - (size_t)len, ", root %lld", (long long)d[D_ROOT]);
  if ((size_t)len < n)
    snprintf(buf + len, n - (size_t)len, ", %s %lld elements)",
             k == TP_COLL_ALL_GATHER || k == TP_COLL_REDUCE_SCATTER ? "total" : "count", (long long)d[D_COUNT]);
}

static uint64_t hash_counts(const size_t *counts, int n) {
  uint64_t h = 1469598103934665603ull;
  for (int i = 0; counts && i < n; i++) {
    h ^= (uint64_t)counts[i];
    h *= 1099511628211ull;
  }
  return h;
}

/* All ranks exchange the description; any difference is TP_ERR_MISMATCH naming both. */
static tp_status_t check_call(struct tp_comm *comm, mpi_ctx *x, const tp_coll_args_t *a, const char *what) {
  int64_t mine[D_N] = {(int64_t)x->seq, a->kind, a->dtype, a->op, a->root, 0, 0};
  int v = a->kind == TP_COLL_ALL_GATHER || a->kind == TP_COLL_REDUCE_SCATTER;
  mine[D_COUNT] = (int64_t)(v ? a->total : a->count);
  mine[D_HASH] = v ? (int64_t)hash_counts(a->counts, comm->size) : 0;
  if (a->kind == TP_COLL_BARRIER || a->kind == TP_COLL_SPLIT) mine[D_DTYPE] = mine[D_OP] = mine[D_COUNT] = 0;
  if (a->kind == TP_COLL_ALL_REDUCE || a->kind == TP_COLL_ALL_GATHER || a->kind == TP_COLL_REDUCE_SCATTER)
    mine[D_ROOT] = 0;
  if (a->kind != TP_COLL_ALL_REDUCE && a->kind != TP_COLL_REDUCE && a->kind != TP_COLL_REDUCE_SCATTER)
    mine[D_OP] = 0;
  if (!check_calls) return TP_SUCCESS;
  /* mine and every rank's, on the heap: a request left in flight by a timeout may still use them */
  int64_t *buf = malloc(sizeof(int64_t) * D_N * ((size_t)comm->size + 1));
  if (!buf) return tp_set_error(TP_ERR_NOMEM, "%s on rank %d: out of memory", what, comm->rank);
  int64_t *all = buf + D_N;
  memcpy(buf, mine, sizeof mine);
  MPI_Request req;
  int rc = MPI_Iallgather(buf, D_N, MPI_INT64_T, all, D_N, MPI_INT64_T, x->mc, &req);
  tp_status_t st = rc == MPI_SUCCESS ? wait_one(comm, x, &req, what, -1) : mpi_error(comm, rc, what);
  for (int p = 0; st == TP_SUCCESS && p < comm->size; p++) {
    if (!memcmp(all + D_N * p, mine, sizeof mine)) continue;
    char theirs[160], ours[160];
    describe(all + D_N * p, theirs, sizeof theirs);
    describe(mine, ours, sizeof ours);
    if (!strcmp(theirs, ours))
      snprintf(theirs + strlen(theirs), sizeof theirs - strlen(theirs), " with other counts");
    st = tp_set_error(TP_ERR_MISMATCH, "%s on rank %d of %d: rank %d called %s but this rank called %s", what,
                      comm->rank, comm->size, p, theirs, ours);
  }
  if (!x->pending) free(buf); /* else left to the process's end */
  return st;
}

/* ---- collectives -------------------------------------------------------------------- */

static tp_status_t count_int(struct tp_comm *comm, size_t n, const char *what, int *out) {
  if (n > (size_t)INT_MAX)
    return tp_set_error(TP_ERR_UNSUPPORTED, "%s on rank %d: %zu elements is more than the mpi backend takes in one "
                        "call (%d); split the buffer", what, comm->rank, n, INT_MAX);
  *out = (int)n;
  return TP_SUCCESS;
}

/* displacements and counts of a v-collective, as MPI's ints. */
static tp_status_t v_arrays(struct tp_comm *comm, const size_t *counts, const char *what, int **cnt, int **dsp) {
  *cnt = malloc(sizeof(int) * (size_t)comm->size);
  *dsp = malloc(sizeof(int) * (size_t)comm->size);
  if (!*cnt || !*dsp) return tp_set_error(TP_ERR_NOMEM, "%s on rank %d: out of memory", what, comm->rank);
  size_t off = 0;
  for (int p = 0; p < comm->size; p++) {
    TP_CHECK(count_int(comm, counts[p], what, &(*cnt)[p]));
    TP_CHECK(count_int(comm, off, what, &(*dsp)[p]));
    off += counts[p];
  }
  return TP_SUCCESS;
}

/* Accumulator of avg: 0 float32, 1 float64, 2 int64, 3 int128. */
static int avg_acc(tp_dtype_t d) {
  switch (d) {
    case TP_FLOAT64: return 1;
    case TP_INT8: case TP_UINT8: case TP_INT32: return 2;
    case TP_INT64: return 3;
    default: return 0;
  }
}
static const size_t acc_size[4] = {4, 8, 8, 16};

static void widen(const void *src, void *dst, size_t n, tp_dtype_t d) {
  for (size_t i = 0; i < n; i++) {
    switch (d) {
      case TP_FLOAT32: ((float *)dst)[i] = ((const float *)src)[i]; break;
      case TP_FLOAT16: ((float *)dst)[i] = tp_half_to_float(((const uint16_t *)src)[i]); break;
      case TP_BFLOAT16: ((float *)dst)[i] = tp_bf16_to_float(((const uint16_t *)src)[i]); break;
      case TP_FLOAT64: ((double *)dst)[i] = ((const double *)src)[i]; break;
      case TP_INT8: ((int64_t *)dst)[i] = ((const int8_t *)src)[i]; break;
      case TP_UINT8: ((int64_t *)dst)[i] = ((const uint8_t *)src)[i]; break;
      case TP_INT32: ((int64_t *)dst)[i] = ((const int32_t *)src)[i]; break;
      case TP_INT64: {
        __int128 v = ((const int64_t *)src)[i];
        memcpy((char *)dst + 16 * i, &v, 16);
        break;
      }
      default: break;
    }
  }
}

/* dst[i] = acc[i] / world, narrowed to d (integers truncate toward zero). */
static void narrow_avg(const void *acc, void *dst, size_t n, tp_dtype_t d, int world) {
  for (size_t i = 0; i < n; i++) {
    switch (d) {
      case TP_FLOAT32: ((float *)dst)[i] = ((const float *)acc)[i] / (float)world; break;
      case TP_FLOAT16: ((uint16_t *)dst)[i] = tp_float_to_half(((const float *)acc)[i] / (float)world); break;
      case TP_BFLOAT16: ((uint16_t *)dst)[i] = tp_float_to_bf16(((const float *)acc)[i] / (float)world); break;
      case TP_FLOAT64: ((double *)dst)[i] = ((const double *)acc)[i] / (double)world; break;
      case TP_INT8: ((int8_t *)dst)[i] = (int8_t)(((const int64_t *)acc)[i] / world); break;
      case TP_UINT8: ((uint8_t *)dst)[i] = (uint8_t)(((const int64_t *)acc)[i] / world); break;
      case TP_INT32: ((int32_t *)dst)[i] = (int32_t)(((const int64_t *)acc)[i] / world); break;
      case TP_INT64: {
        __int128 v;
        memcpy(&v, (const char *)acc + 16 * i, 16);
        ((int64_t *)dst)[i] = (int64_t)(v / world);
        break;
      }
      default: break;
    }
  }
}

/* avg of all_reduce / reduce / reduce_scatter: widen, sum, divide, narrow. */
static tp_status_t avg_collective(struct tp_comm *comm, mpi_ctx *x, const tp_coll_args_t *a, const char *what) {
  int acc = avg_acc(a->dtype);
  MPI_Datatype at = acc == 0 ? MPI_FLOAT : acc == 1 ? MPI_DOUBLE : acc == 2 ? MPI_INT64_T : dt_i128;
  MPI_Op op = acc == 3 ? op_sum_i128 : MPI_SUM;
  size_t in_n = a->kind == TP_COLL_REDUCE_SCATTER ? a->total : a->count;
  size_t out_n = a->count;
  int out_here = a->kind != TP_COLL_REDUCE || comm->rank == a->root;
  size_t in_bytes, out_bytes;
  if (!tp_mul_size(in_n, acc_size[acc], &in_bytes) || !tp_mul_size(out_n, acc_size[acc], &out_bytes))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s on rank %d: %zu elements overflow the avg accumulator", what,
                        comm->rank, in_n);
  void *in = malloc(in_bytes ? in_bytes : 1), *out = malloc(out_bytes ? out_bytes : 1);
  int *cnt = NULL, *dsp = NULL;
  tp_status_t st = TP_SUCCESS;
  if (!in || !out) st = tp_set_error(TP_ERR_NOMEM, "%s on rank %d: out of memory for avg's %zu-byte accumulator",
                                     what, comm->rank, in_bytes + out_bytes);
  int n_in = 0, rc = MPI_SUCCESS;
  if (st == TP_SUCCESS) st = count_int(comm, in_n, what, &n_in);
  MPI_Request req = MPI_REQUEST_NULL;
  if (st == TP_SUCCESS) {
    widen(a->send, in, in_n, a->dtype);
    if (a->kind == TP_COLL_ALL_REDUCE) {
      rc = MPI_Iallreduce(in, out, n_in, at, op, x->mc, &req);
    } else if (a->kind == TP_COLL_REDUCE) {
      rc = MPI_Ireduce(in, out, n_in, at, op, a->root, x->mc, &req);
    } else {
      st = v_arrays(comm, a->counts, what, &cnt, &dsp);
      if (st == TP_SUCCESS) rc = MPI_Ireduce_scatter(in, out, cnt, at, op, x->mc, &req);
    }
    if (st == TP_SUCCESS) st = rc == MPI_SUCCESS ? wait_one(comm, x, &req, what, -1) : mpi_error(comm, rc, what);
  }
  if (st == TP_SUCCESS && out_here) narrow_avg(out, a->recv, out_n, a->dtype, comm->size);
  if (!x->pending) { /* a request still running may use them */
    free(in);
    free(out);
    free(cnt);
    free(dsp);
  }
  return st;
}

static tp_status_t run_collective(struct tp_comm *comm, mpi_ctx *x, const tp_coll_args_t *a, const char *what) {
  if (a->op == TP_AVG &&
      (a->kind == TP_COLL_ALL_REDUCE || a->kind == TP_COLL_REDUCE || a->kind == TP_COLL_REDUCE_SCATTER))
    return avg_collective(comm, x, a, what);
  MPI_Datatype t = mpi_type(a->dtype);
  MPI_Request req = MPI_REQUEST_NULL;
  int n = 0, rc = MPI_SUCCESS, *cnt = NULL, *dsp = NULL;
  tp_status_t st = TP_SUCCESS;
  int in_place = a->send == a->recv;
  switch (a->kind) {
    case TP_COLL_ALL_REDUCE:
      TP_CHECK(count_int(comm, a->count, what, &n));
      rc = MPI_Iallreduce(in_place ? MPI_IN_PLACE : a->send, a->recv, n, t, mpi_op(a->dtype, a->op), x->mc, &req);
      break;
    case TP_COLL_REDUCE: {
      TP_CHECK(count_int(comm, a->count, what, &n));
      int root = comm->rank == a->root;
      const void *s = root && in_place ? MPI_IN_PLACE : a->send;
      rc = MPI_Ireduce(s, root ? a->recv : NULL, n, t, mpi_op(a->dtype, a->op), a->root, x->mc, &req);
      break;
    }
    case TP_COLL_BROADCAST: {
      TP_CHECK(count_int(comm, a->count, what, &n));
      if (comm->rank == a->root && n && !in_place) memmove(a->recv, a->send, a->count * tp_dtype_size(a->dtype));
      rc = MPI_Ibcast(a->recv, n, t, a->root, x->mc, &req);
      break;
    }
    case TP_COLL_ALL_GATHER: {
      st = v_arrays(comm, a->counts, what, &cnt, &dsp);
      if (st != TP_SUCCESS) break;
      /* in place: x is this rank's block of out */
      size_t es = tp_dtype_size(a->dtype);
      const char *mine = a->recv ? (const char *)a->recv + (size_t)dsp[comm->rank] * es : NULL;
      int ip = cnt[comm->rank] == 0 || a->send == (const void *)mine;
      rc = MPI_Iallgatherv(ip ? MPI_IN_PLACE : a->send, cnt[comm->rank], t, a->recv, cnt, dsp, t, x->mc, &req);
      break;
    }
    case TP_COLL_REDUCE_SCATTER: {
      st = v_arrays(comm, a->counts, what, &cnt, &dsp);
      if (st != TP_SUCCESS) break;
      /* in place (out is this rank's block of x): reduced into a scratch block, then copied,
       * so the rest of x is left as it was (MPI_IN_PLACE would overwrite it). */
      const char *mine = (const char *)a->send + (size_t)dsp[comm->rank] * tp_dtype_size(a->dtype);
      int ip = a->recv == (const void *)mine && a->count;
      void *out = a->count ? a->recv : (void *)a->send, *tmp = NULL;
      if (ip && !(out = tmp = malloc(a->count * tp_dtype_size(a->dtype)))) {
        st = tp_set_error(TP_ERR_NOMEM, "%s on rank %d: out of memory", what, comm->rank);
        break;
      }
      rc = MPI_Ireduce_scatter(a->send, out, cnt, t, mpi_op(a->dtype, a->op), x->mc, &req);
      if (rc == MPI_SUCCESS) st = wait_one(comm, x, &req, what, -1);
      if (rc == MPI_SUCCESS && st == TP_SUCCESS && ip) memcpy(a->recv, tmp, a->count * tp_dtype_size(a->dtype));
      if (!x->pending) { /* a request still running may use them */
        free(tmp);
        free(cnt);
        free(dsp);
      }
      return rc == MPI_SUCCESS ? st : mpi_error(comm, rc, what);
    }
    case TP_COLL_BARRIER: rc = MPI_Ibarrier(x->mc, &req); break;
    default: return tp_set_error(TP_ERR_INTERNAL, "mpi: unknown collective %d", (int)a->kind);
  }
  if (st == TP_SUCCESS) st = rc == MPI_SUCCESS ? wait_one(comm, x, &req, what, -1) : mpi_error(comm, rc, what);
  if (!x->pending) { /* a request still running may read them */
    free(cnt);
    free(dsp);
  }
  return st;
}

static tp_status_t refuse_if_failed(struct tp_comm *comm, mpi_ctx *x, const char *what) {
  if (atomic_load(&x->aborted))
    return tp_set_error(TP_ERR_ABORTED, "%s on rank %d: this rank aborted the communicator", what, comm->rank);
  return TP_SUCCESS;
}

static tp_status_t mpi_collective(struct tp_comm *comm, const tp_coll_args_t *a) {
  mpi_ctx *x = comm->impl;
  char what[64];
  snprintf(what, sizeof what, "%s #%llu", H->coll_name(a->kind), (unsigned long long)(x->seq + 1));
  TP_CHECK(refuse_if_failed(comm, x, what));
  x->seq++;
  TP_CHECK(check_call(comm, x, a, what));
  return run_collective(comm, x, a, what);
}

/* ---- point to point ------------------------------------------------------------------- */

/* A receive must get exactly the count it expects. */
static tp_status_t check_received(struct tp_comm *comm, MPI_Status *s, MPI_Datatype t, int expect, const char *what,
                                  int src) {
  int got = 0;
  MPI_Get_count(s, t, &got);
  if (got != expect) /* the message was received whole: nothing is left in flight */
    return tp_set_error(TP_ERR_MISMATCH, "%s on rank %d: rank %d sent %d elements but this rank expects %d", what,
                        comm->rank, src, got, expect);
  return TP_SUCCESS;
}

static tp_status_t mpi_send(struct tp_comm *comm, const void *buf, size_t count, tp_dtype_t dt, int peer,
                            tp_stream_t stream) {
  (void)stream;
  mpi_ctx *x = comm->impl;
  char what[48];
  snprintf(what, sizeof what, "send (to rank %d)", peer);
  TP_CHECK(refuse_if_failed(comm, x, what));
  int n = 0;
  TP_CHECK(count_int(comm, count, what, &n));
  MPI_Request req;
  MPI_TRY(comm, MPI_Isend(buf, n, mpi_type(dt), peer, TAG_P2P, x->mc, &req), what);
  return wait_one(comm, x, &req, what, peer);
}

static tp_status_t mpi_recv(struct tp_comm *comm, void *buf, size_t count, tp_dtype_t dt, int peer,
                            tp_stream_t stream) {
  (void)stream;
  mpi_ctx *x = comm->impl;
  char what[48];
  snprintf(what, sizeof what, "recv (from rank %d)", peer);
  TP_CHECK(refuse_if_failed(comm, x, what));
  int n = 0;
  TP_CHECK(count_int(comm, count, what, &n));
  MPI_Request req;
  MPI_Status s;
  MPI_TRY(comm, MPI_Irecv(buf, n, mpi_type(dt), peer, TAG_P2P, x->mc, &req), what);
  TP_CHECK(wait_all(comm, x, &req, 1, &s, what, peer));
  return check_received(comm, &s, mpi_type(dt), n, what, peer);
}

static tp_status_t mpi_sendrecv(struct tp_comm *comm, const void *sbuf, size_t scount, int dst, void *rbuf,
                                size_t rcount, int src, tp_dtype_t dt, tp_stream_t stream) {
  (void)stream;
  mpi_ctx *x = comm->impl;
  char what[64];
  snprintf(what, sizeof what, "sendrecv (to rank %d, from rank %d)", dst, src);
  TP_CHECK(refuse_if_failed(comm, x, what));
  int sn = 0, rn = 0;
  TP_CHECK(count_int(comm, scount, what, &sn));
  TP_CHECK(count_int(comm, rcount, what, &rn));
  MPI_Request reqs[2];
  MPI_Status s[2];
  MPI_TRY(comm, MPI_Irecv(rbuf, rn, mpi_type(dt), src, TAG_P2P, x->mc, &reqs[0]), what);
  int rc = MPI_Isend(sbuf, sn, mpi_type(dt), dst, TAG_P2P, x->mc, &reqs[1]);
  if (rc != MPI_SUCCESS) {
    x->pending = 1;
    return mpi_error(comm, rc, what);
  }
  TP_CHECK(wait_all(comm, x, reqs, 2, s, what, src));
  return check_received(comm, &s[0], mpi_type(dt), rn, what, src);
}

/* ---- life cycle ------------------------------------------------------------------------ */

static void mpi_destroy(struct tp_comm *comm);
static void mpi_abort(struct tp_comm *comm, const char *reason);
static tp_status_t mpi_split(struct tp_comm *comm, int color, int key, struct tp_comm **out);

static void mpi_stats(struct tp_comm *comm, tp_comm_stats_t *stats) {
  (void)comm;
  stats->single_copy = 0;
}

static const tp_backend_ops mpi_ops = {
    .name = "mpi",
    .devices = 1u << TP_DEVICE_CPU,
    .streams = 0,
    .collective = mpi_collective,
    .send = mpi_send,
    .recv = mpi_recv,
    .sendrecv = mpi_sendrecv,
    .split = mpi_split,
    .mem_alloc = NULL,
    .stats = mpi_stats,
    .abort = mpi_abort,
    .destroy = mpi_destroy,
};

/* Called at exit: MPI_Finalize when tpcore initialised MPI and nothing failed (MPI_Finalize
 * synchronises with every rank; after a failure it could wait for a dead one, so the
 * process leaves without it and mpirun reports the job as failed). */
static void finalize_at_exit(void) {
  int fin = 0;
  MPI_Finalized(&fin);
  if (we_initialised && !fin && !atomic_load(&any_failed)) MPI_Finalize();
}

static tp_status_t setup_types(void) {
  if (dt_f16 != MPI_DATATYPE_NULL) return TP_SUCCESS;
  MPI_Datatype f16, bf16, i128;
  if (MPI_Type_contiguous(1, MPI_UINT16_T, &f16) || MPI_Type_commit(&f16) ||
      MPI_Type_contiguous(1, MPI_UINT16_T, &bf16) || MPI_Type_commit(&bf16) ||
      MPI_Type_contiguous(2, MPI_INT64_T, &i128) || MPI_Type_commit(&i128))
    return tp_set_error(TP_ERR_INTERNAL, "mpi: cannot create the 16-bit datatypes");
  MPI_User_function *fns[4] = {user_sum, user_prod, user_min, user_max};
  for (int i = 0; i < 4; i++)
    if (MPI_Op_create(fns[i], 1, &user_ops[i]) != MPI_SUCCESS)
      return tp_set_error(TP_ERR_INTERNAL, "mpi: cannot create the user-defined reductions");
  if (MPI_Op_create(sum_i128, 1, &op_sum_i128) != MPI_SUCCESS)
    return tp_set_error(TP_ERR_INTERNAL, "mpi: cannot create the 128-bit sum");
  dt_f16 = f16;
  dt_bf16 = bf16;
  dt_i128 = i128;
  return TP_SUCCESS;
}

static tp_status_t start_mpi(struct tp_comm *comm) {
  int inited = 0, fin = 0;
  MPI_Finalized(&fin);
  if (fin) return tp_set_error(TP_ERR_INVALID_USAGE, "MPI was finalized in this process and cannot start again");
  MPI_Initialized(&inited);
  if (!inited) {
    const char *env_size = getenv("OMPI_COMM_WORLD_SIZE");
    if (comm->size > 1 && !env_size && !getenv("PMIX_RANK") && !getenv("PMI_RANK"))
      return tp_set_error(TP_ERR_INVALID_USAGE,
                          "a job of %d ranks on the mpi backend must be launched by mpirun (mpirun -n %d python ..., "
                          "or python -m tpcore.launch --backend mpi -n %d ...); this process was not", comm->size,
                          comm->size, comm->size);
#ifdef OMPI_MAJOR_VERSION
    /* Open MPI's non-blocking all-reduce picks, by default, an algorithm that is 2-3x slower than
     * its blocking one at 1-16 MiB here; Rabenseifner's (reduce-scatter + all-gather) is on a par.
     * Every rank runs this same line; a value the user set is kept. */
    setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "3", 0);
#endif
    int provided = 0;
    int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) return tp_set_error(TP_ERR_SYSTEM, "MPI_Init_thread failed (error %d)", rc);
    we_initialised = 1;
    atexit(finalize_at_exit);
  }
  MPI_Query_thread(&thread_level);
  if (thread_level < MPI_THREAD_SERIALIZED)
    return tp_set_error(TP_ERR_UNSUPPORTED, "MPI was initialised with thread level %d (%s); tpcore needs "
                        "MPI_THREAD_SERIALIZED or more (mpi4py: mpi4py.rc.thread_level = 'serialized')",
                        thread_level, thread_level == MPI_THREAD_SINGLE ? "MPI_THREAD_SINGLE" : "MPI_THREAD_FUNNELED");
  const char *chk = getenv("TPCORE_MPI_CHECK");
  check_calls = !(chk && !strcmp(chk, "0"));
  if (!library[0]) {
    char v[MPI_MAX_LIBRARY_VERSION_STRING + 1];
    int len = 0;
    if (MPI_Get_library_version(v, &len) == MPI_SUCCESS) {
      v[len < 0 ? 0 : len > MPI_MAX_LIBRARY_VERSION_STRING ? MPI_MAX_LIBRARY_VERSION_STRING : len] = '\0';
      v[strcspn(v, ",\n")] = '\0';
      snprintf(library, sizeof library, "%.200s", v);
    }
  }
  return setup_types();
}

/* Wraps an MPI communicator (taken over: freed by destroy) into comm. */
static tp_status_t adopt(struct tp_comm *comm, MPI_Comm mc) {
  mpi_ctx *x = calloc(1, sizeof *x);
  if (!x) {
    MPI_Comm_free(&mc);
    return tp_set_error(TP_ERR_NOMEM, "out of memory allocating the mpi communicator");
  }
  x->mc = mc;
  x->ctrl = MPI_COMM_NULL;
  x->ctrl_req = MPI_REQUEST_NULL;
  atomic_init(&x->aborted, 0);
  atomic_init(&x->abort_claimed, 0);
  atomic_init(&x->notes_sent, 0);
  MPI_Comm_set_errhandler(mc, MPI_ERRORS_RETURN);
  int rc = MPI_Comm_dup(mc, &x->ctrl);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(x->ctrl, MPI_ERRORS_RETURN);
  if (rc == MPI_SUCCESS)
    rc = MPI_Irecv(x->ctrl_note, NOTE_MAX, MPI_CHAR, MPI_ANY_SOURCE, TAG_ABORT, x->ctrl, &x->ctrl_req);
  comm->impl = x;
  comm->ops = &mpi_ops;
  if (rc != MPI_SUCCESS) {
    tp_status_t st = mpi_error(comm, rc, "init");
    mpi_destroy(comm);
    comm->ops = NULL;
    return st;
  }
  return TP_SUCCESS;
}

static tp_status_t mpi_comm_init(struct tp_comm *comm, const char *comm_id, int world_comm) {
  (void)comm_id;
  if (!world_comm) return tp_set_error(TP_ERR_INTERNAL, "mpi: communicators other than the world come from split");
  TP_CHECK(start_mpi(comm));
  int size = 0, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (size != comm->size || rank != comm->rank)
    return tp_set_error(TP_ERR_MISMATCH, "MPI_COMM_WORLD has %d ranks and this is rank %d, but tpcore was asked for "
                        "rank %d of %d (the environment's RANK/WORLD_SIZE disagree with mpirun's)", size, rank,
                        comm->rank, comm->size);
  MPI_Comm mc;
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  /* MPI_Comm_dup is collective and blocking: a rank that never comes is mpirun's to report. */
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &mc);
  if (rc != MPI_SUCCESS) return mpi_error(comm, rc, "init (MPI_Comm_dup)");
  return adopt(comm, mc);
}

static tp_status_t mpi_split(struct tp_comm *comm, int color, int key, struct tp_comm **out) {
  mpi_ctx *x = comm->impl;
  char what[48];
  snprintf(what, sizeof what, "split #%llu", (unsigned long long)(x->seq + 1));
  TP_CHECK(refuse_if_failed(comm, x, what));
  x->seq++;
  /* Every rank is there (under the timeout) before the blocking MPI_Comm_split. */
  tp_coll_args_t a = {TP_COLL_SPLIT, NULL, NULL, 0, NULL, 0, TP_UINT8, TP_SUM, 0, NULL};
  if (check_calls) {
    TP_CHECK(check_call(comm, x, &a, what));
  } else {
    MPI_Request req;
    MPI_TRY(comm, MPI_Ibarrier(x->mc, &req), what);
    TP_CHECK(wait_one(comm, x, &req, what, -1));
  }
  MPI_Comm nc = MPI_COMM_NULL;
  MPI_TRY(comm, MPI_Comm_split(x->mc, color == TP_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key, &nc), what);
  if (nc == MPI_COMM_NULL) return TP_SUCCESS;
  int size = 0, rank = 0;
  MPI_Comm_size(nc, &size);
  MPI_Comm_rank(nc, &rank);
  struct tp_comm *c;
  tp_status_t st = H->comm_alloc(&c, size, rank, comm->job_id, comm->timeout_s, comm->spin_us);
  if (st != TP_SUCCESS) {
    MPI_Comm_free(&nc);
    return st;
  }
  st = adopt(c, nc);
  if (st != TP_SUCCESS) {
    free(c);
    return st;
  }
  *out = c;
  return TP_SUCCESS;
}

/* Tells every peer (once) that this rank aborted; their waits fail with TP_ERR_REMOTE. */
static void send_abort_notes(struct tp_comm *comm, mpi_ctx *x) {
  if (!x->abort_note || comm->size < 2 || atomic_exchange(&x->notes_sent, 1)) return;
  x->abort_reqs = calloc((size_t)comm->size, sizeof(MPI_Request));
  if (!x->abort_reqs) return;
  for (int p = 0; p < comm->size; p++) {
    x->abort_reqs[p] = MPI_REQUEST_NULL;
    if (p != comm->rank &&
        MPI_Isend(x->abort_note, (int)strlen(x->abort_note) + 1, MPI_CHAR, p, TAG_ABORT, x->ctrl, &x->abort_reqs[p]) !=
            MPI_SUCCESS)
      x->abort_reqs[p] = MPI_REQUEST_NULL;
  }
  x->nabort = comm->size;
}

static void mpi_abort(struct tp_comm *comm, const char *reason) {
  mpi_ctx *x = comm->impl;
  if (!x || atomic_exchange(&x->abort_claimed, 1)) return;
  atomic_store(&any_failed, 1);
  char *note = malloc(NOTE_MAX);
  if (note)
    snprintf(note, NOTE_MAX, "it aborted the communicator: %s", reason && *reason ? reason : "(no reason given)");
  x->abort_note = note;
  atomic_store(&x->aborted, 1); /* after the note: a waiting thread that sees the flag sends it */
  /* From any thread only under MPI_THREAD_MULTIPLE; else the thread inside a call sends them
   * (wait_all), or this one when none is. */
  if (thread_level >= MPI_THREAD_MULTIPLE || !atomic_load(&comm->busy)) send_abort_notes(comm, x);
}

static void mpi_destroy(struct tp_comm *comm) {
  mpi_ctx *x = comm->impl;
  if (!x) return;
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin) {
    /* Give the abort notes a moment to leave, then let go of what is still in flight. */
    int sent = 1;
    if (x->abort_reqs) {
      double t0 = H->now();
      long spins = 0;
      int done = 0;
      while (MPI_Testall(x->nabort, x->abort_reqs, &done, MPI_STATUSES_IGNORE) == MPI_SUCCESS && !done &&
             H->now() - t0 < 1.0)
        pause_briefly(&spins, H->now() - t0);
      sent = done;
    }
    if (x->ctrl_req != MPI_REQUEST_NULL) {
      MPI_Cancel(&x->ctrl_req);
      MPI_Request_free(&x->ctrl_req);
    }
    if (!x->pending && sent) {
      if (x->ctrl != MPI_COMM_NULL) MPI_Comm_free(&x->ctrl);
      MPI_Comm_free(&x->mc);
    }
    if (sent) {
      free(x->abort_reqs);
      free(x->abort_note);
    } /* else MPI may still read them: left to the process's end */
  }
  free(x);
  comm->impl = NULL;
}

static const char *mpi_library(void) { return library; }

EXPORT tp_status_t tp_mpi_plugin_init_v1(const tp_mpi_host_api *host, tp_mpi_plugin *out) {
  out->abi_version = TP_MPI_PLUGIN_ABI;
  out->size = sizeof *out;
  out->tpcore_version = BUILD_VERSION;
  if (!host || host->abi_version != TP_MPI_PLUGIN_ABI || host->size < sizeof *host) return TP_ERR_UNSUPPORTED;
  H = host;
  if (host->comm_struct_size != sizeof(struct tp_comm) || strcmp(host->tpcore_version, BUILD_VERSION))
    return tp_set_error(TP_ERR_UNSUPPORTED, "the MPI plugin was built from tpcore %s with another communicator layout; "
                        "this is tpcore %s: rebuild them together", BUILD_VERSION, host->tpcore_version);
  static char build[192];
  snprintf(build, sizeof build, "%s (MPI %d.%d headers)",
#if defined(OMPI_MAJOR_VERSION)
           "Open MPI " STR_(OMPI_MAJOR_VERSION) "." STR_(OMPI_MINOR_VERSION) "." STR_(OMPI_RELEASE_VERSION),
#elif defined(MPICH_VERSION)
           "MPICH " MPICH_VERSION,
#else
           "MPI",
#endif
           MPI_VERSION, MPI_SUBVERSION);
  out->build = build;
  out->comm_init = mpi_comm_init;
  out->library = mpi_library;
  return TP_SUCCESS;
}
