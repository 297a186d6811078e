/*
 * shm backend: naming a desync.  Every collective posts its header (what it is,
 * its number, the caller's "file.py:LINE") in the rank's slot of the shared
 * segment, so any rank can read what every peer called and compose one sentence
 * for a mismatch ("rank 2 called all_gather(4096 bfloat16) at model.py:88 while
 * ranks 0, 1, 3 called all_reduce(sum, 4096 float32) at model.py:91"), the same
 * on every rank, and for a timeout say what the rank it waited for is doing or
 * did last ("rank 3 never arrived at #17 all_reduce(...) at model.py:91: its last
 * collective was #16 barrier at train.py:40, begun 12.1 s ago").  Only the failure paths read
 * peers' headers; the calls themselves only post their own.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shm_impl.h"

/* The newer of rank p's two headers (the one of its current or last collective). */
static const coll_hdr_t *latest_hdr(const shm_ctx *c, int p) {
  const coll_hdr_t *a = &c->slots[p].hdr[0], *b = &c->slots[p].hdr[1];
  return reached(b->seq, a->seq) ? b : a;
}

/* "#17 all_reduce(sum, 4096 float32) at model.py:91" (the number when with_seq). */
static void describe(const coll_hdr_t *h, int with_seq, char *buf, size_t n) {
  coll_hdr_t v = *h; /* a copy: a peer may be writing its slot */
  v.site[sizeof v.site - 1] = '\0';
  int reduction = v.kind == TP_COLL_ALL_REDUCE || v.kind == TP_COLL_REDUCE || v.kind == TP_COLL_REDUCE_SCATTER;
  int typed = (v.kind >= TP_COLL_ALL_REDUCE && v.kind <= TP_COLL_REDUCE) || v.kind == TP_COLL_ALL_TO_ALL;
  char what[128], seq[24] = "";
  tp_coll_describe(what, sizeof what, v.kind, typed ? v.dtype : -1, reduction ? v.op : -1, v.count, v.root, -1);
  if (with_seq) snprintf(seq, sizeof seq, "#%u ", v.seq);
  snprintf(buf, n, "%s%s at %s", seq, what, v.site[0] ? v.site : "C");
}

/* "rank 2", "ranks 0, 1, 3", "ranks 0-5, 7": the ranks p with grp[p] == g. */
static size_t rank_list(const int *grp, int n, int g, char *buf, size_t cap) {
  int count = 0;
  for (int p = 0; p < n; p++) count += grp[p] == g;
  size_t len = (size_t)snprintf(buf, cap, "rank%s ", count > 1 ? "s" : "");
  int first = 1;
  for (int p = 0; p < n && len < cap; p++) {
    if (grp[p] != g) continue;
    int q = p;
    while (q + 1 < n && grp[q + 1] == g) q++;
    if (q - p >= 3) { /* a run of four or more */
      len += (size_t)snprintf(buf + len, cap - len, "%s%d-%d", first ? "" : ", ", p, q);
      p = q;
    } else {
      len += (size_t)snprintf(buf + len, cap - len, "%s%d", first ? "" : ", ", p);
    }
    first = 0;
  }
  return len < cap ? len : cap - 1;
}

int tp_shm_divergence(const shm_ctx *c, char *buf, size_t n) {
  int world = c->comm->size;
  enum { DESC = 256 };
  char (*desc)[DESC] = malloc((size_t)world * DESC);
  int *grp = malloc(sizeof(int) * (size_t)world);
  int *gsize = calloc((size_t)world, sizeof(int));
  if (!desc || !grp || !gsize) {
    free(desc), free(grp), free(gsize);
    return 0;
  }
  /* The ranks' numbers differ when one skipped or added a call: then each says its own. */
  const coll_hdr_t *h0 = latest_hdr(c, 0);
  uint32_t seq0 = h0->seq;
  int same_seq = 1;
  for (int p = 1; p < world; p++) same_seq &= latest_hdr(c, p)->seq == seq0;
  int ngroups = 0;
  for (int p = 0; p < world; p++) {
    describe(latest_hdr(c, p), !same_seq, desc[p], DESC);
    grp[p] = -1;
    for (int q = 0; q < p; q++)
      if (strcmp(desc[q], desc[p]) == 0) {
        grp[p] = grp[q];
        break;
      }
    if (grp[p] < 0) grp[p] = ngroups++;
    gsize[grp[p]]++;
  }
  int found = ngroups > 1;
  if (found) {
    size_t len = same_seq ? (size_t)snprintf(buf, n, " at #%u: ", seq0) : (size_t)snprintf(buf, n, ": ");
    if (ngroups == 2) {
      /* The smaller group first ("rank 2 called X while ranks 0, 1, 3 called Y"); in a tie,
       * the one without rank 0.  Every rank composes the same sentence. */
      int a = gsize[1] <= gsize[0] ? 1 : 0, b = 1 - a, fa = -1, fb = -1; /* group 0 holds rank 0 */
      for (int p = world - 1; p >= 0; p--) {
        if (grp[p] == a) fa = p;
        if (grp[p] == b) fb = p;
      }
      len += rank_list(grp, world, a, buf + len, n - len);
      len += (size_t)snprintf(buf + len, len < n ? n - len : 0, " called %s while ", desc[fa]);
      if (len < n) len += rank_list(grp, world, b, buf + len, n - len);
      if (len < n) snprintf(buf + len, n - len, " called %s", desc[fb]);
    } else {
      for (int g = 0; g < ngroups && len < n; g++) {
        int f = 0;
        while (grp[f] != g) f++;
        if (g) len += (size_t)snprintf(buf + len, n - len, "; ");
        if (len < n) len += rank_list(grp, world, g, buf + len, n - len);
        if (len < n) len += (size_t)snprintf(buf + len, n - len, " called %s", desc[f]);
      }
    }
  }
  free(desc), free(grp), free(gsize);
  return found;
}

void tp_shm_describe_activity(const shm_ctx *c, int p, char *buf, size_t n) {
  const rank_slot_t *s = &c->slots[p];
  int kind = atomic_load(&s->act_kind);
  uint32_t last = atomic_load(&s->last_seq);
  char mine[256], theirs[256];
  if (kind == TP_COLL_SEND || kind == TP_COLL_RECV || kind == TP_COLL_SENDRECV) {
    snprintf(buf, n, "rank %d is in %s with peer %d (its last collective was #%u)", p,
             tp_coll_name((tp_coll_kind_t)kind), atomic_load(&s->act_peer), last);
    return;
  }
  if (kind != TP_COLL_NONE) {
    describe(latest_hdr(c, p), 1, theirs, sizeof theirs);
    snprintf(buf, n, "rank %d is waiting in %s", p, theirs);
    return;
  }
  /* Not inside any call: what this rank waits in, and the peer's last collective. */
  int me = atomic_load(&c->slots[c->comm->rank].act_kind);
  int in_coll = me != TP_COLL_SEND && me != TP_COLL_RECV && me != TP_COLL_SENDRECV && me != TP_COLL_NONE;
  if (in_coll) describe(&c->slots[c->comm->rank].hdr[c->seq & 1], 1, mine, sizeof mine);
  if (last == 0) {
    snprintf(buf, n, "rank %d never arrived%s%s; it has made no collective call on this communicator yet", p,
             in_coll ? " at " : "", in_coll ? mine : "");
    return;
  }
  const coll_hdr_t *h = latest_hdr(c, p);
  if (h->seq == last) describe(h, 1, theirs, sizeof theirs);
  else snprintf(theirs, sizeof theirs, "#%u", last);
  double ago = tp_now() - atomic_load_explicit(&s->last_start, memory_order_relaxed);
  snprintf(buf, n, "rank %d never arrived%s%s: its last collective was %s, begun %.1f s ago", p, in_coll ? " at " : "",
           in_coll ? mine : "", theirs, ago);
}
