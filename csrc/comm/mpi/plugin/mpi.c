/*
 * The mpi backend (libtpcore_mpi.so; its ABI is csrc/comm/mpi/mpi_abi.h).  With mpi_ops.c, the
 * only files of tpcore that include <mpi.h>: built with mpicc's flags (setup.py, the
 * Makefile) when an MPI is found, opened by the core on first use (csrc/comm/mpi/mpi_load.c).
 *
 * Every operation is a non-blocking MPI call (MPI_Iallreduce, MPI_Isend, ...) polled with
 * MPI_Test under the communicator's timeout, so no call can hang for ever: a peer that
 * never arrives is a TP_ERR_TIMEOUT naming the operation and the peer (for a collective, the
 * ranks whose description did not come, with their last call: mpi_ops.c); a rank that aborts
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
 *
 * This file: the plugin's entry, MPI's start-up, communicators (init, split, destroy),
 * abort and the waits; mpi_ops.c: the reductions, collectives and point to point;
 * mpi_impl.h: what they share.
 */
#include "mpi_impl.h"

#define EXPORT __attribute__((visibility("default")))
#define STR2_(x) #x
#define STR_(x) STR2_(x)
#define BUILD_VERSION STR_(TP_VERSION_MAJOR) "." STR_(TP_VERSION_MINOR) "." STR_(TP_VERSION_PATCH)

const tp_mpi_host_api *tp_mpi_host;

/* ---- the core's helpers, through the host table ------------------------------------- */

tp_status_t tp_set_error(tp_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  tp_status_t s = tp_mpi_host->set_error_v(status, fmt, ap);
  va_end(ap);
  return s;
}

void tp_error_prefix(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  tp_mpi_host->error_prefix_v(fmt, ap);
  va_end(ap);
}

/* ---- process-wide MPI state ---------------------------------------------------------- */

static int we_initialised; /* MPI_Init_thread was ours: MPI_Finalize at exit */
static int thread_level;   /* what MPI_Init_thread provided */
/* An operation was left in flight, or a peer failed: skip MPI_Finalize (mpi_impl.h). */
atomic_int tp_mpi_any_failed;
int tp_mpi_check_calls = 1; /* TPCORE_MPI_CHECK */
static char library[256];

tp_status_t tp_mpi_error(struct tp_comm *comm, int rc, const char *what) {
  char text[MPI_MAX_ERROR_STRING + 1];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = snprintf(text, sizeof text, "MPI error %d", rc);
  text[len < 0 ? 0 : len > MPI_MAX_ERROR_STRING ? MPI_MAX_ERROR_STRING : len] = '\0';
  atomic_store(&tp_mpi_any_failed, 1);
  return tp_set_error(TP_ERR_REMOTE, "%s on rank %d of %d: MPI failed: %s", what, comm->rank, comm->size, text);
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
  atomic_store(&tp_mpi_any_failed, 1);
  return tp_set_error(TP_ERR_REMOTE, "%s on rank %d of %d: rank %d failed: %s", what, comm->rank, comm->size,
                      s.MPI_SOURCE, x->ctrl_note);
}

/* Waits for n requests; on a timeout why says why (after "timed out after N s"). */
tp_status_t tp_mpi_wait_why(struct tp_comm *comm, mpi_ctx *x, MPI_Request *reqs, int n, MPI_Status *stats,
                            const char *what, tp_mpi_why_fn why, const void *arg) {
  double t0 = tp_mpi_host->now(), next_ctrl = 0;
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
      return tp_mpi_error(comm, rc, what);
    }
    if (done) return TP_SUCCESS;
    double now = tp_mpi_host->now();
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
        return tp_set_error(TP_ERR_ABORTED, "%s on rank %d of %d: this rank aborted the communicator", what, comm->rank,
                            comm->size);
      }
    }
    if (now - t0 > comm->timeout_s) {
      x->pending = 1;
      atomic_store(&tp_mpi_any_failed, 1);
      char text[1024];
      why(comm, x, arg, text, sizeof text);
      return tp_set_error(TP_ERR_TIMEOUT, "%s on rank %d of %d: timed out after %.1f s%s", what, comm->rank, comm->size,
                          comm->timeout_s, text);
    }
    pause_briefly(&spins, now - t0);
  }
}

/* A wait for one peer names it; one for every rank says what is known. */
static void why_peer(struct tp_comm *comm, mpi_ctx *x, const void *arg, char *buf, size_t n) {
  int peer = *(const int *)arg;
  if (peer >= 0) snprintf(buf, n, " waiting for rank %d", peer);
  else if (!tp_mpi_check_calls)
    snprintf(buf, n,
             " (not every rank of the communicator reached it: one may have died, hung or called another "
             "operation; with TPCORE_MPI_CHECK=0 the ranks exchange no description of their calls, so which "
             "one is not known)");
  else if (x->arrived == x->seq)
    snprintf(buf, n, " (every rank arrived at it, but it did not complete: one may have died or hung inside it)");
  else
    snprintf(buf, n,
             " (not every rank of the communicator reached it: one may have died, hung or called another "
             "operation)");
  (void)comm;
}

/* Waits for n (1 or 2) requests; peer (>= 0) is named on a timeout. */
tp_status_t tp_mpi_wait_all(struct tp_comm *comm, mpi_ctx *x, MPI_Request *reqs, int n, MPI_Status *stats,
                            const char *what, int peer) {
  return tp_mpi_wait_why(comm, x, reqs, n, stats, what, why_peer, &peer);
}

tp_status_t tp_mpi_wait_one(struct tp_comm *comm, mpi_ctx *x, MPI_Request *req, const char *what, int peer) {
  return tp_mpi_wait_all(comm, x, req, 1, NULL, what, peer);
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
    .collective = tp_mpi_collective,
    .send = tp_mpi_send,
    .recv = tp_mpi_recv,
    .sendrecv = tp_mpi_sendrecv,
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
  if (we_initialised && !fin && !atomic_load(&tp_mpi_any_failed)) MPI_Finalize();
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
                          "or python -m tpcore.launch --backend mpi -n %d ...); this process was not",
                          comm->size, comm->size, comm->size);
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
    return tp_set_error(TP_ERR_UNSUPPORTED,
                        "MPI was initialised with thread level %d (%s); tpcore needs "
                        "MPI_THREAD_SERIALIZED or more (mpi4py: mpi4py.rc.thread_level = 'serialized')",
                        thread_level, thread_level == MPI_THREAD_SINGLE ? "MPI_THREAD_SINGLE" : "MPI_THREAD_FUNNELED");
  const char *chk = getenv("TPCORE_MPI_CHECK");
  tp_mpi_check_calls = !(chk && !strcmp(chk, "0"));
  if (!library[0]) {
    char v[MPI_MAX_LIBRARY_VERSION_STRING + 1];
    int len = 0;
    if (MPI_Get_library_version(v, &len) == MPI_SUCCESS) {
      v[len < 0 ? 0 : len > MPI_MAX_LIBRARY_VERSION_STRING ? MPI_MAX_LIBRARY_VERSION_STRING : len] = '\0';
      v[strcspn(v, ",\n")] = '\0';
      snprintf(library, sizeof library, "%.200s", v);
    }
  }
  return tp_mpi_setup_types();
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
  tp_status_t st = rc == MPI_SUCCESS ? tp_mpi_calls_setup(comm, x) : tp_mpi_error(comm, rc, "init");
  if (st != TP_SUCCESS) {
    mpi_destroy(comm);
    comm->ops = NULL;
  }
  return st;
}

static tp_status_t mpi_comm_init(struct tp_comm *comm, const char *comm_id, int world_comm) {
  (void)comm_id;
  if (!world_comm) return tp_set_error(TP_ERR_INTERNAL, "mpi: communicators other than the world come from split");
  TP_CHECK(start_mpi(comm));
  int size = 0, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (size != comm->size || rank != comm->rank)
    return tp_set_error(TP_ERR_MISMATCH,
                        "MPI_COMM_WORLD has %d ranks and this is rank %d, but tpcore was asked for "
                        "rank %d of %d (the environment's RANK/WORLD_SIZE disagree with mpirun's)",
                        size, rank, comm->rank, comm->size);
  MPI_Comm mc;
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  /* MPI_Comm_dup is collective and blocking: a rank that never comes is mpirun's to report. */
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &mc);
  if (rc != MPI_SUCCESS) return tp_mpi_error(comm, rc, "init (MPI_Comm_dup)");
  return adopt(comm, mc);
}

static tp_status_t mpi_split(struct tp_comm *comm, int color, int key, struct tp_comm **out) {
  mpi_ctx *x = comm->impl;
  char what[48];
  snprintf(what, sizeof what, "split #%llu", (unsigned long long)(x->seq + 1));
  TP_CHECK(tp_mpi_refuse_if_failed(comm, x, what));
  x->seq++;
  /* Every rank is there (under the timeout) before the blocking MPI_Comm_split. */
  tp_coll_args_t a = {TP_COLL_SPLIT, NULL, NULL, 0, NULL, 0, TP_UINT8, TP_SUM, 0, NULL, NULL};
  if (tp_mpi_check_calls) {
    TP_CHECK(tp_mpi_check_call(comm, x, &a, what));
  } else {
    MPI_Request req;
    MPI_TRY(comm, MPI_Ibarrier(x->mc, &req), what);
    TP_CHECK(tp_mpi_wait_one(comm, x, &req, what, -1));
  }
  MPI_Comm nc = MPI_COMM_NULL;
  MPI_TRY(comm, MPI_Comm_split(x->mc, color == TP_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key, &nc), what);
  if (nc == MPI_COMM_NULL) return TP_SUCCESS;
  int size = 0, rank = 0;
  MPI_Comm_size(nc, &size);
  MPI_Comm_rank(nc, &rank);
  struct tp_comm *c;
  tp_status_t st = tp_mpi_host->comm_alloc(&c, size, rank, comm->job_id, comm->timeout_s, comm->spin_us);
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
    if (p != comm->rank && MPI_Isend(x->abort_note, (int)strlen(x->abort_note) + 1, MPI_CHAR, p, TAG_ABORT, x->ctrl,
                                     &x->abort_reqs[p]) != MPI_SUCCESS)
      x->abort_reqs[p] = MPI_REQUEST_NULL;
  }
  x->nabort = comm->size;
}

static void mpi_abort(struct tp_comm *comm, const char *reason) {
  mpi_ctx *x = comm->impl;
  if (!x || atomic_exchange(&x->abort_claimed, 1)) return;
  atomic_store(&tp_mpi_any_failed, 1);
  char *note = malloc(NOTE_MAX);
  if (note)
    snprintf(note, NOTE_MAX, "it aborted the communicator: %s", reason && *reason ? reason : "(no reason given)");
  x->abort_note = note;
  atomic_store(&x->aborted, 1); /* after the note: a waiting thread that sees the flag sends it */
  /* From any thread only under MPI_THREAD_MULTIPLE; else the thread inside a call sends them
   * (tp_mpi_wait_all), or this one when none is. */
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
      double t0 = tp_mpi_host->now();
      long spins = 0;
      int done = 0;
      while (MPI_Testall(x->nabort, x->abort_reqs, &done, MPI_STATUSES_IGNORE) == MPI_SUCCESS && !done &&
             tp_mpi_host->now() - t0 < 1.0)
        pause_briefly(&spins, tp_mpi_host->now() - t0);
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
  if (fin || !x->pending) tp_mpi_calls_free(x); /* else a request may still use them */
  free(x);
  comm->impl = NULL;
}

static const char *mpi_library(void) { return library; }

EXPORT tp_status_t tp_mpi_plugin_init_v1(const tp_mpi_host_api *host, tp_mpi_plugin *out) {
  out->abi_version = TP_MPI_PLUGIN_ABI;
  out->size = sizeof *out;
  out->tpcore_version = BUILD_VERSION;
  if (!host || host->abi_version != TP_MPI_PLUGIN_ABI || host->size < sizeof *host) return TP_ERR_UNSUPPORTED;
  tp_mpi_host = host;
  if (host->comm_struct_size != sizeof(struct tp_comm) || strcmp(host->tpcore_version, BUILD_VERSION))
    return tp_set_error(TP_ERR_UNSUPPORTED,
                        "the MPI plugin was built from tpcore %s with another communicator layout; "
                        "this is tpcore %s: rebuild them together",
                        BUILD_VERSION, host->tpcore_version);
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
