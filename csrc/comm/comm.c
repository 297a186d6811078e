/*
 * The communicator dispatcher: argument checks (once, at the boundary, naming
 * the operation and the argument: counts, dtypes, ops, roots, overlaps, the
 * device of every buffer against the backend's `devices`, the stream against
 * its `streams`), the one-thread-at-a-time guard, the failed state,
 * statistics, and the error context "<op> on rank r of n: ...".  It names no
 * backend: init looks config->backend up in the registry (backends.c), and
 * everything backend-specific (registered memory and its release, stats) goes
 * through the backend's table.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm_impl.h"
#include "staged_impl.h"
#include "tpcore/device.h"

const char *tp_redop_name(tp_redop_t op) {
  switch (op) {
    case TP_SUM: return "sum";
    case TP_PROD: return "prod";
    case TP_MIN: return "min";
    case TP_MAX: return "max";
    case TP_AVG: return "avg";
    default: return "invalid";
  }
}

const char *tp_coll_name(tp_coll_kind_t kind) {
  static const char *names[TP_COLL_NUM] = {"none",   "all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                           "reduce", "barrier",    "split",      "alloc",          "send",
                                           "recv",   "sendrecv",   "all_to_all"};
  return ((unsigned)kind < TP_COLL_NUM) ? names[kind] : "unknown";
}

static double env_timeout(void) {
  const char *s = getenv("TPCORE_TIMEOUT");
  if (s && *s) {
    char *end;
    double v = strtod(s, &end);
    if (end != s && v > 0) return v;
  }
  return 300.0;
}

tp_status_t tp_comm_alloc_common(struct tp_comm **out, int world, int rank, const char *job_id, double timeout_s,
                                 int spin_us) {
  struct tp_comm *c = calloc(1, sizeof *c);
  if (!c) return tp_set_error(TP_ERR_NOMEM, "out of memory allocating a communicator");
  c->rank = rank;
  c->size = world;
  c->timeout_s = timeout_s > 0 ? timeout_s : env_timeout();
  c->spin_us = spin_us;
  c->registered_memory = 1;
  snprintf(c->job_id, sizeof c->job_id, "%s", job_id);
  atomic_init(&c->busy, 0);
  atomic_init(&c->failed, 0);
  tp_status_t st = tp_hist_setup(c);
  if (st != TP_SUCCESS) {
    free(c);
    return st;
  }
  *out = c;
  return TP_SUCCESS;
}

void tp_comm_mark_failed(struct tp_comm *c, tp_status_t st, const char *msg) {
  int expect = 0;
  if (atomic_compare_exchange_strong(&c->failed, &expect, 2)) {
    c->fail_status = st;
    snprintf(c->fail_msg, sizeof c->fail_msg, "%s", msg);
    atomic_store(&c->failed, 1);
  }
}

static int valid_job_id(const char *s) {
  size_t n = strlen(s);
  if (n == 0 || n > TP_JOB_ID_MAX) return 0;
  for (size_t i = 0; i < n; i++)
    if (!(isalnum((unsigned char)s[i]) || s[i] == '_' || s[i] == '-')) return 0;
  return 1;
}

tp_status_t tp_comm_init_rank(tp_comm_t *out, int world, int rank, const tp_comm_config_t *cfg) {
  tp_clear_error();
  if (!out) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "comm_init_rank: comm pointer is NULL");
  *out = NULL;
  tp_comm_config_t dflt = TP_COMM_CONFIG_INITIALIZER;
  if (!cfg) cfg = &dflt;
  if (cfg->size < offsetof(tp_comm_config_t, spin_us) + sizeof(int) || cfg->version / 10000 != TP_VERSION_MAJOR)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "comm_init_rank: config was built for another tpcore version "
                        "(size %zu, version %u; this library is %d); use TP_COMM_CONFIG_INITIALIZER",
                        cfg->size, cfg->version, TP_VERSION);
  if (world < 1 || world > 1024)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "comm_init_rank: world size must be in 1..1024, got %d", world);
  if (rank < 0 || rank >= world)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "comm_init_rank: rank must be in 0..%d (world size %d), got %d",
                        world - 1, world, rank);
  const char *job = cfg->job_id;
  if (!job || !valid_job_id(job))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "comm_init_rank: job_id must be 1..%d characters of [A-Za-z0-9_-], got '%s'", TP_JOB_ID_MAX,
                        job ? job : "(null)");
  const tp_backend_entry *be = tp_backend_find(cfg->backend);
  if (!be) {
    char known[256];
    tp_backend_names(known, sizeof known);
    return tp_set_error(TP_ERR_UNSUPPORTED,
                        "comm_init_rank: backend '%s' is not available in this build (available: %s)", cfg->backend,
                        known);
  }
  int regmem = cfg->size >= offsetof(tp_comm_config_t, registered_memory) + sizeof(int) ? cfg->registered_memory : -1;
  if (regmem < 0) {
    const char *e = getenv("TPCORE_REGISTERED_MEMORY");
    regmem = !(e && strcmp(e, "0") == 0);
  }
  struct tp_comm *c;
  TP_CHECK(tp_comm_alloc_common(&c, world, rank, job, cfg->timeout_s, cfg->spin_us));
  c->registered_memory = regmem != 0;
  c->device_id = cfg->size >= offsetof(tp_comm_config_t, device_id) + sizeof(int) ? cfg->device_id : -1;
  c->job_id_unique = cfg->size >= offsetof(tp_comm_config_t, job_id_unique) + sizeof(int) ? cfg->job_id_unique != 0 : 0;
  tp_status_t st = be->init(c, "w", 1);
  if (st != TP_SUCCESS) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", tp_last_error());
    free(c);
    return tp_set_error(st, "%s%s%s%s", be->usable ? "backend " : "", be->usable ? be->name : "",
                        be->usable ? ": " : "", msg);
  }
  *out = c;
  return TP_SUCCESS;
}

tp_status_t tp_comm_destroy(tp_comm_t c) {
  if (!c) return TP_SUCCESS;
  if (atomic_load(&c->busy)) {
    /* Another thread is inside a call: fail it on every rank, then wait for it to leave. */
    tp_comm_abort(c, "the communicator was destroyed while a call was in progress");
    while (atomic_load(&c->busy)) usleep(1000);
  }
  if (c->ops && c->ops->destroy) c->ops->destroy(c);
  free(c->ring);
  free(c);
  return TP_SUCCESS;
}

tp_status_t tp_comm_abort(tp_comm_t c, const char *reason) {
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "comm_abort: comm is NULL");
  char msg[1024];
  snprintf(msg, sizeof msg, "rank %d aborted the communicator: %s", c->rank,
           reason && *reason ? reason : "(no reason given)");
  if (c->ops && c->ops->abort) c->ops->abort(c, reason ? reason : "");
  tp_comm_mark_failed(c, TP_ERR_ABORTED, msg);
  return TP_SUCCESS;
}

static tp_status_t enter(tp_comm_t c, const char *op);

tp_status_t tp_comm_sync(tp_comm_t c, tp_stream_t stream) {
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "comm_sync: comm is NULL");
  if (!c->ops->streams || !c->ops->sync) return TP_SUCCESS; /* a host backend has finished every call */
  TP_CHECK(enter(c, "sync"));
  tp_status_t st = c->ops->sync(c, stream);
  atomic_store(&c->busy, 0);
  if (st != TP_SUCCESS) tp_comm_mark_failed(c, st, tp_last_error());
  return st;
}

tp_status_t tp_comm_get_async_error(tp_comm_t c, tp_status_t *err) {
  if (!c || !err) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "comm_get_async_error: NULL argument");
  *err = atomic_load(&c->failed) == 1 ? c->fail_status : TP_SUCCESS;
  return TP_SUCCESS;
}

#define GETTER(NAME, TYPE, EXPR)                                                         \
  tp_status_t NAME(tp_comm_t c, TYPE *v) {                                               \
    if (!c || !v) return tp_set_error(TP_ERR_INVALID_ARGUMENT, #NAME ": NULL argument"); \
    *v = (EXPR);                                                                         \
    return TP_SUCCESS;                                                                   \
  }
GETTER(tp_comm_rank, int, c->rank)
GETTER(tp_comm_size, int, c->size)
GETTER(tp_comm_backend, const char *, c->ops->name)
GETTER(tp_comm_timeout, double, c->timeout_s)
GETTER(tp_comm_devices, unsigned, c->ops->devices)
GETTER(tp_comm_seq, uint64_t, c->coll_seq)

tp_status_t tp_comm_get_stats(tp_comm_t c, tp_comm_stats_t *v) {
  if (!c || !v) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "tp_comm_get_stats: NULL argument");
  *v = c->stats;
  if (c->ops && c->ops->stats) c->ops->stats(c, v);
  return TP_SUCCESS;
}

tp_status_t tp_comm_set_timeout(tp_comm_t c, double s) {
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "comm_set_timeout: comm is NULL");
  if (!(s > 0))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "comm_set_timeout: timeout must be > 0 seconds, got %g", s);
  c->timeout_s = s;
  return TP_SUCCESS;
}

/* ---- the guarded call --------------------------------------------------- */

static tp_status_t enter(tp_comm_t c, const char *op) {
  tp_clear_error();
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: communicator is NULL", op);
  if (atomic_load(&c->failed) == 1)
    return tp_set_error(c->fail_status == TP_ERR_MISMATCH ? TP_ERR_MISMATCH : TP_ERR_ABORTED,
                        "%s on rank %d of %d: the communicator failed earlier and cannot be used: %s", op, c->rank,
                        c->size, c->fail_msg);
  int expect = 0;
  if (!atomic_compare_exchange_strong(&c->busy, &expect, 1))
    return tp_set_error(TP_ERR_INVALID_USAGE,
                        "%s on rank %d: the communicator is in use by another thread; "
                        "a communicator serves one thread at a time",
                        op, c->rank);
  return TP_SUCCESS;
}

static tp_status_t leave(tp_comm_t c, const char *op, tp_status_t st, double t0, size_t bytes) {
  tp_hist_end(c, st, tp_now() - t0, bytes); /* statistics, history, the ring printed on a desync */
  atomic_store(&c->busy, 0);                /* after them: the next caller finds them complete */
  if (st == TP_SUCCESS) return st;
  if (st == TP_ERR_TIMEOUT || st == TP_ERR_REMOTE || st == TP_ERR_MISMATCH || st == TP_ERR_ABORTED ||
      st == TP_ERR_SYSTEM || st == TP_ERR_INTERNAL) {
    /* The ranks no longer agree on where they are: nothing after this is safe. */
    tp_comm_mark_failed(c, st, tp_last_error());
  }
  (void)op;
  return st;
}

static tp_status_t check_common(tp_comm_t c, const char *op, const void *send, const void *recv, size_t count,
                                tp_dtype_t dtype, int need_send, int need_recv) {
  if ((unsigned)dtype >= TP_NUM_DTYPES)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: invalid dtype %d", op, (int)dtype);
  if (count > ((size_t)1 << 60) / tp_dtype_size(dtype))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: count %zu is too large", op, count);
  if (count && need_send && !send)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s on rank %d: send buffer is NULL", op, c->rank);
  if (count && need_recv && !recv)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s on rank %d: recv buffer is NULL", op, c->rank);
  return TP_SUCCESS;
}

/* send [s, s+sn) and recv [r, r+rn) may be the same buffer (in place) or disjoint;
 * a partial overlap would be read while it is written. */
static tp_status_t check_overlap(const char *op, const void *s, size_t sn, const void *r, size_t rn,
                                 const void *allowed_send) {
  if (!s || !r || !sn || !rn || s == allowed_send) return TP_SUCCESS;
  const char *a = s, *b = r;
  if (a < b + rn && b < a + sn)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: x and out overlap without being the same buffer (x at %p, %zu bytes; out at %p, "
                        "%zu bytes); use the in-place form or separate buffers",
                        op, s, sn, r, rn);
  return TP_SUCCESS;
}

static tp_status_t check_op(const char *op, tp_redop_t r) {
  if ((unsigned)r >= TP_NUM_REDOPS)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: invalid reduction op %d (expected sum, prod, min, max or avg)",
                        op, (int)r);
  return TP_SUCCESS;
}

static tp_status_t check_root(tp_comm_t c, const char *op, int root, const char *what) {
  if (root < 0 || root >= c->size)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s : invalid %s %d (world size %d)", op, what, root, c->size);
  return TP_SUCCESS;
}

/* A host backend runs the call now and has no stream to queue it on. */
static tp_status_t check_stream(tp_comm_t c, const char *op, tp_stream_t stream) {
  if (stream && !c->ops->streams)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: backend %s runs on the host and takes no stream; pass NULL", op,
                        c->ops->name);
  return TP_SUCCESS;
}

/* The buffer `arg` of `op` must lie on a device the backend takes. */
static tp_status_t check_device(tp_comm_t c, const char *op, const char *arg, const void *p) {
  if (!p) return TP_SUCCESS;
  tp_device_t d;
  int id;
  tp_pointer_device(p, &d, &id);
  unsigned mask = c->ops->devices;
  if ((unsigned)d < 32 && (mask & (1u << d))) return TP_SUCCESS;
  char takes[96] = "";
  size_t len = 0;
  for (int t = 0; t < TP_NUM_DEVICE_TYPES && len < sizeof takes; t++)
    if (mask & (1u << t))
      len +=
          (size_t)snprintf(takes + len, sizeof takes - len, "%s%s", len ? " or " : "", tp_device_name((tp_device_t)t));
  return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s on rank %d: %s is %s:%d memory, but backend %s takes %s memory only",
                      op, c->rank, arg, tp_device_name(d), id, c->ops->name, takes);
}

/* The guarded call: one thread, the failed state, statistics. */
static tp_status_t guarded_coll(tp_comm_t c, tp_coll_args_t *a) {
  const char *op = tp_coll_name(a->kind);
  size_t n = a->kind == TP_COLL_ALL_GATHER || a->kind == TP_COLL_REDUCE_SCATTER ? a->total : a->count;
  if (a->kind == TP_COLL_ALL_TO_ALL) n = a->count > a->total ? a->count : a->total;
  TP_CHECK(enter(c, op));
  double t0 = tp_now();
  int reduction = a->kind == TP_COLL_ALL_REDUCE || a->kind == TP_COLL_REDUCE || a->kind == TP_COLL_REDUCE_SCATTER;
  int rooted = a->kind == TP_COLL_BROADCAST || a->kind == TP_COLL_REDUCE;
  tp_hist_begin(c, a->kind, a->kind == TP_COLL_BARRIER ? -1 : (int)a->dtype, reduction ? (int)a->op : -1, a->count,
                rooted ? a->root : -1, -1, t0);
  tp_status_t st = c->ops->collective(c, a);
  return leave(c, op, st, t0, n * tp_dtype_size(a->dtype));
}

/* used_send / used_recv: 1 when this rank's part reads send / writes recv. */
static tp_status_t run_coll(tp_comm_t c, tp_coll_args_t *a, size_t bytes, tp_stream_t stream, int used_send,
                            int used_recv) {
  const char *op = tp_coll_name(a->kind);
  int cs = used_send ? tp_comm_buffer_class(c, a->send) : 0, cr = used_recv ? tp_comm_buffer_class(c, a->recv) : 0;
  if (cs == 2) TP_CHECK(check_device(c, op, "send buffer", a->send));
  if (cr == 2) TP_CHECK(check_device(c, op, "recv buffer", a->recv));
  (void)bytes;
  if (cs == 1 || cr == 1) {
    size_t es = tp_dtype_size(a->dtype);
    size_t sn = a->kind == TP_COLL_REDUCE_SCATTER ? a->total : a->count;
    size_t rn = a->kind == TP_COLL_ALL_GATHER || a->kind == TP_COLL_ALL_TO_ALL ? a->total : a->count;
    a->stream = c->ops->streams ? stream : NULL;
    return tp_comm_staged(c, a, sn * es, rn * es, used_send, used_recv, stream, guarded_coll);
  }
  TP_CHECK(check_stream(c, op, stream));
  a->stream = stream;
  return guarded_coll(c, a);
}

tp_status_t tp_all_reduce(const void *send, void *recv, size_t count, tp_dtype_t dtype, tp_redop_t op, tp_comm_t c,
                          tp_stream_t stream) {
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "all_reduce: communicator is NULL");
  TP_CHECK(check_common(c, "all_reduce", send, recv, count, dtype, 1, 1));
  TP_CHECK(check_op("all_reduce", op));
  size_t nb = count * tp_dtype_size(dtype);
  TP_CHECK(check_overlap("all_reduce", send, nb, recv, nb, recv));
  tp_coll_args_t a = {TP_COLL_ALL_REDUCE, send, recv, count, NULL, count, dtype, op, 0, NULL, NULL};
  return run_coll(c, &a, count * tp_dtype_size(dtype), stream, count > 0, count > 0);
}

static tp_status_t gather_scatter_v(tp_coll_kind_t kind, const void *send, void *recv, const size_t *counts,
                                    tp_dtype_t dtype, tp_redop_t op, tp_comm_t c, tp_stream_t stream) {
  const char *name = tp_coll_name(kind);
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: communicator is NULL", name);
  if (!counts) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: counts is NULL", name);
  if ((unsigned)dtype >= TP_NUM_DTYPES)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: invalid dtype %d", name, (int)dtype);
  size_t es = tp_dtype_size(dtype), limit = ((size_t)1 << 60) / es, total = 0;
  for (int p = 0; p < c->size; p++) {
    if (counts[p] > limit - total)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: counts add up past %zu elements (counts[%d] = %zu)", name,
                          limit, p, counts[p]);
    total += counts[p];
  }
  size_t mine = counts[c->rank];
  TP_CHECK(check_common(c, name, send, recv, total, dtype, 0, 0));
  size_t before = 0;
  for (int p = 0; p < c->rank; p++) before += counts[p];
  if (kind == TP_COLL_ALL_GATHER) /* in place: x is this rank's block of out */
    TP_CHECK(check_overlap(name, send, mine * es, recv, total * es, recv ? (const char *)recv + before * es : NULL));
  else /* in place: out is this rank's block of x */
    TP_CHECK(check_overlap(name, recv, mine * es, send, total * es, send ? (const char *)send + before * es : NULL));
  if (kind == TP_COLL_ALL_GATHER) {
    if (mine && !send)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s on rank %d: send buffer is NULL", name, c->rank);
    if (total && !recv)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s on rank %d: recv buffer is NULL", name, c->rank);
  } else {
    TP_CHECK(check_op(name, op));
    if (total && !send)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s on rank %d: send buffer is NULL", name, c->rank);
    if (mine && !recv)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s on rank %d: recv buffer is NULL", name, c->rank);
  }
  tp_coll_args_t a = {kind, send, recv, mine, counts, total, dtype, op, 0, NULL, NULL};
  int gather = kind == TP_COLL_ALL_GATHER;
  return run_coll(c, &a, total * tp_dtype_size(dtype), stream, (gather ? mine : total) > 0,
                  (gather ? total : mine) > 0);
}

static tp_status_t equal_counts(tp_coll_kind_t kind, const void *send, void *recv, size_t count, tp_dtype_t dtype,
                                tp_redop_t op, tp_comm_t c, tp_stream_t stream) {
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: communicator is NULL", tp_coll_name(kind));
  size_t stackbuf[64] = {0};
  size_t *counts = c->size <= 64 ? stackbuf : malloc(sizeof(size_t) * (size_t)c->size);
  if (!counts) return tp_set_error(TP_ERR_NOMEM, "out of memory");
  for (int p = 0; p < c->size; p++) counts[p] = count;
  tp_status_t st = gather_scatter_v(kind, send, recv, counts, dtype, op, c, stream);
  if (counts != stackbuf) free(counts);
  return st;
}

tp_status_t tp_all_gather(const void *send, void *recv, size_t sendcount, tp_dtype_t dtype, tp_comm_t c,
                          tp_stream_t stream) {
  return equal_counts(TP_COLL_ALL_GATHER, send, recv, sendcount, dtype, TP_SUM, c, stream);
}
tp_status_t tp_all_gather_v(const void *send, void *recv, const size_t *counts, tp_dtype_t dtype, tp_comm_t c,
                            tp_stream_t stream) {
  return gather_scatter_v(TP_COLL_ALL_GATHER, send, recv, counts, dtype, TP_SUM, c, stream);
}
tp_status_t tp_reduce_scatter(const void *send, void *recv, size_t recvcount, tp_dtype_t dtype, tp_redop_t op,
                              tp_comm_t c, tp_stream_t stream) {
  return equal_counts(TP_COLL_REDUCE_SCATTER, send, recv, recvcount, dtype, op, c, stream);
}
tp_status_t tp_reduce_scatter_v(const void *send, void *recv, const size_t *counts, tp_dtype_t dtype, tp_redop_t op,
                                tp_comm_t c, tp_stream_t stream) {
  return gather_scatter_v(TP_COLL_REDUCE_SCATTER, send, recv, counts, dtype, op, c, stream);
}

/* The sum of n counts (one per rank) into *total, in elements of at most `limit` in all. */
static tp_status_t sum_counts(const char *op, const char *arg, const size_t *counts, int n, size_t limit,
                              size_t *total) {
  size_t t = 0;
  for (int p = 0; p < n; p++) {
    if (counts[p] > limit - t)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s add up past %zu elements (%s[%d] = %zu)", op, arg, limit,
                          arg, p, counts[p]);
    t += counts[p];
  }
  *total = t;
  return TP_SUCCESS;
}

tp_status_t tp_all_to_all(const void *send, const size_t *send_counts, void *recv, const size_t *recv_counts,
                          tp_dtype_t dtype, tp_comm_t c, tp_stream_t stream) {
  const char *op = "all_to_all";
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: communicator is NULL", op);
  if (!send_counts) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: send_counts is NULL", op);
  if (!recv_counts) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: recv_counts is NULL", op);
  if ((unsigned)dtype >= TP_NUM_DTYPES)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: invalid dtype %d", op, (int)dtype);
  size_t es = tp_dtype_size(dtype), limit = ((size_t)1 << 60) / es, sent = 0, got = 0;
  TP_CHECK(sum_counts(op, "send_counts", send_counts, c->size, limit, &sent));
  TP_CHECK(sum_counts(op, "recv_counts", recv_counts, c->size, limit, &got));
  if (send_counts[c->rank] != recv_counts[c->rank])
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s on rank %d: send_counts[%d] is %zu but recv_counts[%d] is %zu (this rank's block to "
                        "itself: they must be equal)",
                        op, c->rank, c->rank, send_counts[c->rank], c->rank, recv_counts[c->rank]);
  TP_CHECK(check_common(c, op, send, recv, sent, dtype, 1, 0));
  TP_CHECK(check_common(c, op, send, recv, got, dtype, 0, 1));
  if (send && recv && sent && got) {
    const char *s = send, *r = recv;
    if (s < r + got * es && r < s + sent * es)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "%s: x and out overlap (x at %p, %zu bytes; out at %p, %zu bytes); all_to_all has no "
                          "in-place form: use separate buffers",
                          op, send, sent * es, recv, got * es);
  }
  tp_coll_args_t a = {TP_COLL_ALL_TO_ALL, send, recv, sent, send_counts, got, dtype, TP_SUM, 0, NULL, recv_counts};
  return run_coll(c, &a, (sent > got ? sent : got) * es, stream, sent > 0, got > 0);
}

tp_status_t tp_broadcast(const void *send, void *recv, size_t count, tp_dtype_t dtype, int root, tp_comm_t c,
                         tp_stream_t stream) {
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "broadcast: communicator is NULL");
  TP_CHECK(check_root(c, "broadcast", root, "root"));
  TP_CHECK(check_common(c, "broadcast", send, recv, count, dtype, c->rank == root, 1));
  if (c->rank == root)
    TP_CHECK(check_overlap("broadcast", send, count * tp_dtype_size(dtype), recv, count * tp_dtype_size(dtype), recv));
  tp_coll_args_t a = {TP_COLL_BROADCAST, send, recv, count, NULL, count, dtype, TP_SUM, root, NULL, NULL};
  return run_coll(c, &a, count * tp_dtype_size(dtype), stream, count && c->rank == root, count > 0);
}

tp_status_t tp_reduce(const void *send, void *recv, size_t count, tp_dtype_t dtype, tp_redop_t op, int root,
                      tp_comm_t c, tp_stream_t stream) {
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "reduce: communicator is NULL");
  TP_CHECK(check_root(c, "reduce", root, "root"));
  TP_CHECK(check_op("reduce", op));
  TP_CHECK(check_common(c, "reduce", send, recv, count, dtype, 1, c->rank == root));
  if (c->rank == root)
    TP_CHECK(check_overlap("reduce", send, count * tp_dtype_size(dtype), recv, count * tp_dtype_size(dtype), recv));
  tp_coll_args_t a = {TP_COLL_REDUCE, send, recv, count, NULL, count, dtype, op, root, NULL, NULL};
  return run_coll(c, &a, count * tp_dtype_size(dtype), stream, count > 0, count && c->rank == root);
}

tp_status_t tp_barrier(tp_comm_t c, tp_stream_t stream) {
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "barrier: communicator is NULL");
  tp_coll_args_t a = {TP_COLL_BARRIER, NULL, NULL, 0, NULL, 0, TP_UINT8, TP_SUM, 0, NULL, NULL};
  return run_coll(c, &a, 0, stream, 0, 0);
}

static tp_status_t check_peer(tp_comm_t c, const char *op, int peer, const char *what) {
  TP_CHECK(check_root(c, op, peer, what));
  if (peer == c->rank)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s : %s %d is this rank itself; use a local copy (or sendrecv)", op,
                        what, peer);
  return TP_SUCCESS;
}

tp_status_t tp_send(const void *buf, size_t count, tp_dtype_t dtype, int peer, tp_comm_t c, tp_stream_t stream) {
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "send: communicator is NULL");
  TP_CHECK(check_peer(c, "send", peer, "peer"));
  TP_CHECK(check_common(c, "send", buf, NULL, count, dtype, 1, 0));
  int cl = count ? tp_comm_buffer_class(c, buf) : 0;
  if (cl == 2) TP_CHECK(check_device(c, "send", "buffer", buf));
  void *host = NULL;
  size_t nb = count * tp_dtype_size(dtype);
  if (cl == 1) TP_CHECK(tp_comm_stage_in(c, "send", buf, nb, 1, stream, &host));
  else TP_CHECK(check_stream(c, "send", stream));
  tp_status_t st = enter(c, "send");
  if (st == TP_SUCCESS) {
    double t0 = tp_now();
    tp_hist_begin(c, TP_COLL_SEND, (int)dtype, -1, count, peer, -1, t0);
    st = c->ops->send(c, host ? host : buf, count, dtype, peer, !host || c->ops->streams ? stream : NULL);
    st = leave(c, "send", st, t0, nb);
  }
  if (host) st = tp_comm_stage_out(c, "send", (void *)buf, host, nb, 0, st, stream);
  return st;
}

tp_status_t tp_recv(void *buf, size_t count, tp_dtype_t dtype, int peer, tp_comm_t c, tp_stream_t stream) {
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "recv: communicator is NULL");
  TP_CHECK(check_peer(c, "recv", peer, "peer"));
  TP_CHECK(check_common(c, "recv", NULL, buf, count, dtype, 0, 1));
  int cl = count ? tp_comm_buffer_class(c, buf) : 0;
  if (cl == 2) TP_CHECK(check_device(c, "recv", "buffer", buf));
  void *host = NULL;
  size_t nb = count * tp_dtype_size(dtype);
  if (cl == 1) TP_CHECK(tp_comm_stage_in(c, "recv", buf, nb, 0, stream, &host));
  else TP_CHECK(check_stream(c, "recv", stream));
  tp_status_t st = enter(c, "recv");
  if (st == TP_SUCCESS) {
    double t0 = tp_now();
    tp_hist_begin(c, TP_COLL_RECV, (int)dtype, -1, count, peer, -1, t0);
    st = c->ops->recv(c, host ? host : buf, count, dtype, peer, !host || c->ops->streams ? stream : NULL);
    st = leave(c, "recv", st, t0, nb);
  }
  if (host) st = tp_comm_stage_out(c, "recv", buf, host, nb, 1, st, stream);
  return st;
}

static tp_status_t staged_sendrecv(tp_comm_t c, const void *sendbuf, size_t sendcount, int dst, void *recvbuf,
                                   size_t recvcount, int src, tp_dtype_t dtype, tp_stream_t stream, int ss, int sr) {
  size_t es = tp_dtype_size(dtype);
  void *hs = NULL, *hr = NULL;
  if (ss) TP_CHECK(tp_comm_stage_in(c, "sendrecv", sendbuf, sendcount * es, 1, stream, &hs));
  tp_status_t st = sr ? tp_comm_stage_in(c, "sendrecv", recvbuf, recvcount * es, 0, stream, &hr) : TP_SUCCESS;
  if (st == TP_SUCCESS) st = enter(c, "sendrecv");
  if (st == TP_SUCCESS) {
    double t0 = tp_now();
    tp_hist_begin(c, TP_COLL_SENDRECV, (int)dtype, -1, sendcount, dst, src, t0);
    st = c->ops->sendrecv(c, hs ? hs : sendbuf, sendcount, dst, hr ? hr : recvbuf, recvcount, src, dtype,
                          c->ops->streams ? stream : NULL);
    st = leave(c, "sendrecv", st, t0, (sendcount + recvcount) * es);
  }
  if (hr) st = tp_comm_stage_out(c, "sendrecv", recvbuf, hr, recvcount * es, 1, st, stream);
  if (hs) st = tp_comm_stage_out(c, "sendrecv", (void *)sendbuf, hs, sendcount * es, 0, st, stream);
  return st;
}

tp_status_t tp_sendrecv(const void *sendbuf, size_t sendcount, int dst, void *recvbuf, size_t recvcount, int src,
                        tp_dtype_t dtype, tp_comm_t c, tp_stream_t stream) {
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "sendrecv: communicator is NULL");
  TP_CHECK(check_root(c, "sendrecv", dst, "dst"));
  TP_CHECK(check_root(c, "sendrecv", src, "src"));
  TP_CHECK(check_common(c, "sendrecv", sendbuf, NULL, sendcount, dtype, 1, 0));
  TP_CHECK(check_common(c, "sendrecv", NULL, recvbuf, recvcount, dtype, 0, 1));
  if ((dst == c->rank) != (src == c->rank))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "sendrecv on rank %d: dst %d and src %d must both be this rank or both other ranks", c->rank,
                        dst, src);
  int cs = sendcount ? tp_comm_buffer_class(c, sendbuf) : 0, cr = recvcount ? tp_comm_buffer_class(c, recvbuf) : 0;
  if (cs == 2) TP_CHECK(check_device(c, "sendrecv", "send buffer", sendbuf));
  if (cr == 2) TP_CHECK(check_device(c, "sendrecv", "recv buffer", recvbuf));
  if (cs != 1 && cr != 1) TP_CHECK(check_stream(c, "sendrecv", stream));
  size_t es = tp_dtype_size(dtype);
  if (dst == c->rank) {
    if (sendcount != recvcount)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "sendrecv on rank %d: sends %zu %s to itself but expects %zu",
                          c->rank, sendcount, tp_dtype_name(dtype), recvcount);
    if (!sendcount) return TP_SUCCESS;
    tp_device_t sd, rd;
    tp_pointer_device(sendbuf, &sd, NULL);
    tp_pointer_device(recvbuf, &rd, NULL);
    if (sd == TP_DEVICE_CPU && rd == TP_DEVICE_CPU) {
      memmove(recvbuf, sendbuf, sendcount * es);
      return TP_SUCCESS;
    }
    return tp_device_copy(rd, recvbuf, sd, sendbuf, sendcount * es, stream); /* queued on the stream */
  }
  if (cs == 1 || cr == 1)
    return staged_sendrecv(c, sendbuf, sendcount, dst, recvbuf, recvcount, src, dtype, stream, cs == 1, cr == 1);
  TP_CHECK(enter(c, "sendrecv"));
  double t0 = tp_now();
  tp_hist_begin(c, TP_COLL_SENDRECV, (int)dtype, -1, sendcount, dst, src, t0);
  tp_status_t st = c->ops->sendrecv(c, sendbuf, sendcount, dst, recvbuf, recvcount, src, dtype, stream);
  return leave(c, "sendrecv", st, t0, (sendcount + recvcount) * es);
}

tp_status_t tp_comm_split(tp_comm_t c, int color, int key, tp_comm_t *newcomm) {
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "split: communicator is NULL");
  if (!newcomm) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "split: newcomm pointer is NULL");
  *newcomm = NULL;
  if (color < 0 && color != TP_SPLIT_NOCOLOR)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "split: color must be >= 0 or TP_SPLIT_NOCOLOR (-1), got %d", color);
  TP_CHECK(enter(c, "split"));
  double t0 = tp_now();
  tp_hist_begin(c, TP_COLL_SPLIT, -1, -1, 0, -1, -1, t0);
  tp_status_t st = c->ops->split(c, color, key, newcomm);
  if (st == TP_SUCCESS && *newcomm) (*newcomm)->registered_memory = c->registered_memory;
  return leave(c, "split", st, t0, 0);
}

tp_status_t tp_comm_mem_alloc(tp_comm_t c, size_t nbytes, void **ptr, tp_mem_t *handle) {
  if (!c || !ptr || !handle) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "mem_alloc: NULL argument");
  *ptr = NULL;
  *handle = NULL;
  if (!c->ops->mem_alloc)
    return tp_set_error(TP_ERR_UNSUPPORTED, "mem_alloc: backend %s has no registered memory", c->ops->name);
  if (!c->registered_memory)
    return tp_set_error(TP_ERR_UNSUPPORTED,
                        "mem_alloc: registered memory is turned off for this communicator "
                        "(TPCORE_REGISTERED_MEMORY=0 or config.registered_memory = 0); use plain "
                        "device memory");
  if (nbytes > ((size_t)1 << 46))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "mem_alloc: %zu bytes is too large", nbytes);
  TP_CHECK(enter(c, "alloc"));
  double t0 = tp_now();
  tp_hist_begin(c, TP_COLL_ALLOC, -1, -1, nbytes, -1, -1, t0);
  tp_status_t st = c->ops->mem_alloc(c, nbytes, ptr, handle);
  return leave(c, "alloc", st, t0, 0);
}

void tp_mem_release(tp_mem_t m) {
  if (m && m->release) m->release(m);
}
