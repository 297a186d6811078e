/*
 * The collective history of a communicator and its per-region statistics.
 *
 * Every call that enters the dispatcher (comm.c) gets an entry in a ring of the
 * last TPCORE_HISTORY calls (default 64, 0: off): what was called, with which
 * dtype, count, root or peer, the collective's number (every rank counts the same
 * collectives, so #17 is the same call everywhere), the caller's site (set by the
 * Python extension, or "C"), the region tag, when it started, how long it took and
 * how it ended.  Recording is a few stores and a 48-byte copy per call; the ring is
 * allocated at the first call.  When a call fails with a mismatch or a timeout (the
 * ranks no longer agree) the ring's last entries are printed to stderr, once.
 *
 * Regions: layers tag their collectives ("attention", "mlp", "embedding", "head";
 * untagged calls are "other") with tp_comm_set_region, which interns the name in a
 * small table of the communicator; the statistics of a completed call go to the
 * total (tp_comm_stats_t) and to its region, with the same duration, so the regions'
 * seconds add up to the total.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_impl.h"

#define HIST_DEFAULT 64
#define HIST_MAX (1 << 20)
#define HIST_PRINT 16

tp_status_t tp_hist_setup(struct tp_comm *c) {
  c->hist_cap = HIST_DEFAULT;
  const char *e = getenv("TPCORE_HISTORY");
  if (e && *e) {
    char *end;
    long v = strtol(e, &end, 10);
    if (*end || v < 0 || v > HIST_MAX)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "TPCORE_HISTORY must be an integer in 0..%d (entries of the collective history; "
                          "0 turns it off), got '%s'",
                          HIST_MAX, e);
    c->hist_cap = (int)v;
  }
  snprintf(c->site, sizeof c->site, "C");
  snprintf(c->regions[0].name, sizeof c->regions[0].name, "other");
  c->nregions = 1;
  c->region = 0;
  return TP_SUCCESS;
}

tp_status_t tp_comm_set_site(tp_comm_t c, const char *site) {
  if (!c) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "comm_set_site: comm is NULL");
  if (!site || !*site) site = "C";
  size_t n = strnlen(site, sizeof c->site - 1);
  memcpy(c->site, site, n);
  c->site[n] = '\0';
  return TP_SUCCESS;
}

const char *tp_comm_set_region(tp_comm_t c, const char *name) {
  if (!c) return NULL;
  const char *prev = c->regions[c->region].name;
  if (!name || !*name) {
    c->region = 0;
    return prev;
  }
  for (int i = 0; i < c->nregions; i++) /* restoring a name this returned: the same pointer */
    if (name == c->regions[i].name) {
      c->region = i;
      return prev;
    }
  size_t len = strnlen(name, TP_COMM_REGION_NAME_MAX - 1);
  for (int i = 0; i < c->nregions; i++)
    if (strncmp(c->regions[i].name, name, len) == 0 && c->regions[i].name[len] == '\0') {
      c->region = i;
      return prev;
    }
  if (c->nregions == TP_COMM_REGIONS_MAX) { /* the table is full: counted as "other" */
    c->region = 0;
    return prev;
  }
  int i = c->nregions++;
  memcpy(c->regions[i].name, name, len);
  c->regions[i].name[len] = '\0';
  c->region = i;
  return prev;
}

tp_status_t tp_comm_history_capacity(tp_comm_t c, int *cap) {
  if (!c || !cap) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "comm_history_capacity: NULL argument");
  *cap = c->hist_cap;
  return TP_SUCCESS;
}

tp_status_t tp_comm_history(tp_comm_t c, tp_coll_record_t *out, int max, int *n) {
  if (!c || !n || (max > 0 && !out)) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "comm_history: NULL argument");
  if (max < 0) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "comm_history: max must be >= 0, got %d", max);
  uint64_t have = c->ring ? (c->hist_n < (uint64_t)c->hist_cap ? c->hist_n : (uint64_t)c->hist_cap) : 0;
  if (max == 0) {
    *n = (int)have; /* at most the capacity, an int */
    return TP_SUCCESS;
  }
  uint64_t k = have < (uint64_t)max ? have : (uint64_t)max;
  for (uint64_t i = 0; i < k; i++) out[i] = c->ring[(c->hist_n - k + i) % (uint64_t)c->hist_cap];
  *n = (int)k;
  return TP_SUCCESS;
}

tp_status_t tp_comm_region_stats(tp_comm_t c, tp_comm_region_stats_t *out, int max, int *n) {
  if (!c || !n || (max > 0 && !out)) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "comm_region_stats: NULL argument");
  if (max < 0) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "comm_region_stats: max must be >= 0, got %d", max);
  int k = c->nregions < max ? c->nregions : max;
  for (int i = 0; i < k; i++)
    out[i] =
        (tp_comm_region_stats_t){c->regions[i].name, c->regions[i].calls, c->regions[i].bytes, c->regions[i].seconds};
  *n = k;
  return TP_SUCCESS;
}

static int is_collective(tp_coll_kind_t k) { return k != TP_COLL_SEND && k != TP_COLL_RECV && k != TP_COLL_SENDRECV; }

void tp_hist_begin(struct tp_comm *c, tp_coll_kind_t kind, int dtype, int redop, size_t count, int root, int src,
                   double t0) {
  uint64_t seq = is_collective(kind) ? ++c->coll_seq : 0;
  c->call_t0 = t0;
  if (TP_UNLIKELY(!c->ring)) {
    if (c->hist_cap == 0) return;
    c->ring = calloc((size_t)c->hist_cap, sizeof *c->ring);
    if (!c->ring) { /* no memory for the history: the calls go on without it */
      c->hist_cap = 0;
      return;
    }
  }
  tp_coll_record_t *e = &c->ring[c->hist_n++ % (uint64_t)c->hist_cap];
  e->seq = seq;
  e->op = tp_coll_name(kind);
  e->redop = redop;
  e->dtype = dtype;
  e->count = count;
  e->root = root;
  e->src = src;
  memcpy(e->site, c->site, sizeof e->site);
  e->region = c->regions[c->region].name;
  e->start = t0;
  e->seconds = -1;
  e->status = TP_IN_PROGRESS;
  c->hist_cur = e;
}

static int kind_of(const char *op) {
  for (int k = 0; k < TP_COLL_NUM; k++)
    if (strcmp(op, tp_coll_name((tp_coll_kind_t)k)) == 0) return k;
  return TP_COLL_NONE;
}

void tp_coll_describe(char *buf, size_t n, int kind, int dtype, int redop, uint64_t count, int root, int src) {
  const char *name = tp_coll_name((tp_coll_kind_t)kind);
  const char *dt = dtype >= 0 ? tp_dtype_name((tp_dtype_t)dtype) : "";
  const char *op = redop >= 0 ? tp_redop_name((tp_redop_t)redop) : "";
  unsigned long long cnt = (unsigned long long)count;
  switch (kind) {
    case TP_COLL_ALL_REDUCE:
    case TP_COLL_REDUCE_SCATTER: snprintf(buf, n, "%s(%s, %llu %s)", name, op, cnt, dt); break;
    case TP_COLL_REDUCE: snprintf(buf, n, "%s(%s, %llu %s, root %d)", name, op, cnt, dt, root); break;
    case TP_COLL_BROADCAST: snprintf(buf, n, "%s(%llu %s, root %d)", name, cnt, dt, root); break;
    case TP_COLL_ALL_GATHER: snprintf(buf, n, "%s(%llu %s)", name, cnt, dt); break;
    case TP_COLL_ALL_TO_ALL: snprintf(buf, n, "%s(%llu %s sent)", name, cnt, dt); break;
    case TP_COLL_ALLOC: snprintf(buf, n, "alloc(%llu bytes)", cnt); break;
    case TP_COLL_SEND: snprintf(buf, n, "send(%llu %s to %d)", cnt, dt, root); break;
    case TP_COLL_RECV: snprintf(buf, n, "recv(%llu %s from %d)", cnt, dt, root); break;
    case TP_COLL_SENDRECV: snprintf(buf, n, "sendrecv(%llu %s to %d, from %d)", cnt, dt, root, src); break;
    default: snprintf(buf, n, "%s", name);
  }
}

/* The ring's last entries, one line each, to stderr (one write). */
static void print_ring(struct tp_comm *c, tp_status_t st) {
  if (!c->ring || !c->hist_n) return;
  uint64_t have = c->hist_n < (uint64_t)c->hist_cap ? c->hist_n : (uint64_t)c->hist_cap;
  uint64_t k = have < HIST_PRINT ? have : HIST_PRINT;
  double now = tp_now();
  size_t cap = 512 + (size_t)k * 192, len = 0;
  char *out = malloc(cap);
  if (!out) return;
  len += (size_t)snprintf(out + len, cap - len,
                          "tpcore: rank %d of %d: the communicator failed (%s); its last %llu calls, oldest first:\n"
                          "tpcore:  %5s  %-40s %-24s %-10s %9s %9s  %s\n",
                          c->rank, c->size, tp_status_name(st), (unsigned long long)k, "#", "call", "site", "region",
                          "ago (s)", "took (s)", "status");
  for (uint64_t i = 0; i < k && len < cap; i++) {
    const tp_coll_record_t *e = &c->ring[(c->hist_n - k + i) % (uint64_t)c->hist_cap];
    char what[128], seq[24], took[24];
    tp_coll_describe(what, sizeof what, kind_of(e->op), e->dtype, e->redop, e->count, e->root, e->src);
    if (e->seq) snprintf(seq, sizeof seq, "%llu", (unsigned long long)e->seq);
    else snprintf(seq, sizeof seq, "p2p");
    if (e->seconds >= 0) snprintf(took, sizeof took, "%.6f", e->seconds);
    else snprintf(took, sizeof took, "-");
    len +=
        (size_t)snprintf(out + len, cap - len, "tpcore:  %5s  %-40s %-24s %-10s %9.3f %9s  %s\n", seq, what, e->site,
                         e->region, now - e->start, took, e->status == TP_SUCCESS ? "ok" : tp_status_name(e->status));
  }
  if (len > cap - 1) len = cap - 1;
  fwrite(out, 1, len, stderr);
  fflush(stderr);
  free(out);
}

void tp_hist_end(struct tp_comm *c, tp_status_t st, double dt, size_t bytes) {
  tp_coll_record_t *e = c->hist_cur;
  if (e) {
    e->seconds = dt;
    e->status = st;
    c->hist_cur = NULL;
  }
  if (TP_LIKELY(st == TP_SUCCESS)) {
    c->stats.collectives++;
    c->stats.bytes += bytes;
    c->stats.seconds += dt;
    c->regions[c->region].calls++;
    c->regions[c->region].bytes += bytes;
    c->regions[c->region].seconds += dt;
    return;
  }
  if ((st == TP_ERR_MISMATCH || st == TP_ERR_TIMEOUT) && atomic_load(&c->failed) == 0) {
    char at[TP_COMM_SITE_MAX + 8];
    snprintf(at, sizeof at, " at %s", e ? e->site : "");
    if (e && !strstr(tp_last_error(), at)) {
      /* A backend that could not name this rank's call site (mpi, nccl): add it. */
      char msg[2048], what[128], seq[24] = "";
      snprintf(msg, sizeof msg, "%s", tp_last_error());
      tp_coll_describe(what, sizeof what, kind_of(e->op), e->dtype, e->redop, e->count, e->root, e->src);
      if (e->seq) snprintf(seq, sizeof seq, "#%llu ", (unsigned long long)e->seq);
      tp_set_error(st, "%s [rank %d was in %s%s at %s]", msg, c->rank, seq, what, e->site);
    }
    print_ring(c, st);
  }
}
