/*
 * shm backend: the collectives.  Each collective posts a header (sequence
 * number, kind, dtype, op, root, counts, where its buffers are) in this rank's
 * slot; the first wait doubles as the check that every rank called the same
 * thing (a mismatch fails every rank with TP_ERR_MISMATCH naming both sides).
 *
 * Data paths.  all_reduce splits each round's chunk into one part per rank; rank
 * r reduces part r (in rank order, so every rank gets the same bits) and the
 * parts are copied back out.  When every rank's buffer lies at the same offset
 * of the same registered allocation (tp_comm_mem_alloc) the copies in and out
 * are skipped: a rank reads peers' inputs and writes peers' outputs in place.
 * Small messages take a one-round path: each rank stages its whole input and
 * reduces all of them.  Large private arrays may move in one copy with the
 * kernel's process_vm_readv (CMA) when every rank can read every other.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/uio.h>

#include "../reduce_impl.h"
#include "shm_impl.h"

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
      snprintf(buf, n, "%s(%s, root %d) of %llu %s", kind, tp_redop_name((tp_redop_t)h->op), h->root, cnt, dt);
      break;
    case TP_COLL_BROADCAST: snprintf(buf, n, "%s(root %d) of %llu %s", kind, h->root, cnt, dt); break;
    case TP_COLL_ALL_GATHER:
      snprintf(buf, n, "%s of %llu %s (%llu in all)", kind, cnt, dt, (unsigned long long)h->total);
      break;
    case TP_COLL_REDUCE_SCATTER:
      snprintf(buf, n, "%s(%s) of %llu %s (receiving %llu)", kind, tp_redop_name((tp_redop_t)h->op),
               (unsigned long long)h->total, dt, cnt);
      break;
    case TP_COLL_ALL_TO_ALL:
      snprintf(buf, n, "%s of %llu %s (receiving %llu)", kind, cnt, dt, (unsigned long long)h->total);
      break;
    case TP_COLL_ALLOC: snprintf(buf, n, "alloc of %llu bytes", cnt); break;
    default: snprintf(buf, n, "%s", kind);
  }
}

static int hdr_matches(const coll_hdr_t *a, const coll_hdr_t *b, const tp_coll_args_t *args, int peer) {
  if (a->seq != b->seq || a->kind != b->kind) return 0;
  switch (a->kind) {
    case TP_COLL_ALL_REDUCE:
    case TP_COLL_REDUCE:
    case TP_COLL_BROADCAST: return a->dtype == b->dtype && a->count == b->count && a->op == b->op && a->root == b->root;
    case TP_COLL_ALL_GATHER:
    case TP_COLL_REDUCE_SCATTER:
      return a->dtype == b->dtype && a->op == b->op && a->total == b->total && b->count == args->counts[peer] &&
             a->counts_hash == b->counts_hash;
    case TP_COLL_ALLOC: return a->count == b->count;
    case TP_COLL_ALL_TO_ALL: return a->dtype == b->dtype; /* the counts: tp_shm_all_to_all's tables */
    default: return 1;
  }
}

void tp_shm_post_hdr(shm_ctx *c, const tp_coll_args_t *a, int color, int key, int64_t sreg, int64_t soff, int64_t rreg,
                     int64_t roff) {
  coll_hdr_t *h = &c->slots[c->comm->rank].hdr[c->seq & 1];
  h->seq = c->seq;
  h->kind = a->kind;
  h->dtype = a->dtype;
  h->op = (a->kind == TP_COLL_ALL_REDUCE || a->kind == TP_COLL_REDUCE || a->kind == TP_COLL_REDUCE_SCATTER)
              ? (int32_t)a->op
              : 0;
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
  memcpy(h->site, c->comm->site, sizeof h->site);
  if (a->counts) {
    uint64_t x = 1469598103934665603ULL;
    for (int p = 0; p < c->comm->size; p++) x = (x ^ (uint64_t)a->counts[p]) * 1099511628211ULL;
    h->counts_hash = x;
  }
}

/* ------------------------------------------------ single copy (CMA) */

/* Copy nbytes from peer p's address space (at raddr) into dst, with the
 * kernel's process_vm_readv: one copy instead of two through staging. */
tp_status_t tp_shm_cma_read(shm_ctx *c, int p, void *dst, uint64_t raddr, size_t nbytes) {
  char *d = dst;
  while (nbytes) {
    struct iovec l = {d, nbytes}, r = {(void *)(uintptr_t)raddr, nbytes};
    ssize_t got = process_vm_readv(c->slots[p].pid, &l, 1, &r, 1, 0);
    if (got <= 0) {
      int err = got < 0 ? errno : EIO;
      if (err == EINTR) continue;
      if (err == ESRCH || tp_shm_peer_dead(&c->slots[p])) {
        char msg[256];
        snprintf(msg, sizeof msg, "rank %d (pid %d) died while rank %d read its buffer", p, c->slots[p].pid,
                 c->comm->rank);
        tp_shm_publish_abort(c, p, msg);
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
static tp_status_t cma_reduce_range(shm_ctx *c, const char *send, int own_send, size_t lo, size_t m, char *out,
                                    tp_dtype_t dt, tp_redop_t op, size_t peer_off_elems) {
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
      TP_CHECK(tp_shm_cma_read(c, p, tmp, peer_hdr(c, p)->send_addr + (peer_off_elems + o) * es, k * es));
      srcs[p] = tmp;
    }
    tp_reduce_n(out + o * es, NULL, srcs, n, k, dt, op);
  }
  return TP_SUCCESS;
}

/* After the first wait of a collective: every peer's header must match. */
tp_status_t tp_shm_check_hdrs(shm_ctx *c, const tp_coll_args_t *a) {
  int n = c->comm->size, r = c->comm->rank;
  const coll_hdr_t *mine = &c->slots[r].hdr[c->seq & 1];
  for (int i = 1; i < n; i++) {
    int p = (r + i) % n;
    const coll_hdr_t *h = &c->slots[p].hdr[c->seq & 1];
    if (!hdr_matches(mine, h, a, p)) {
      /* Ranks that differ in the call itself: every rank's call and site, grouped (the same
       * sentence on every rank).  Different per-rank counts of one all_gather / reduce_scatter
       * (the ranks' own counts differ anyway when uneven): said so, below. */
      int counts_differ = h->seq == mine->seq && h->kind == mine->kind && h->counts_hash != mine->counts_hash &&
                          (h->kind == TP_COLL_ALL_GATHER || h->kind == TP_COLL_REDUCE_SCATTER);
      char named[1400];
      if (!counts_differ && tp_shm_divergence(c, named, sizeof named))
        return tp_set_error(TP_ERR_MISMATCH, "collective mismatch%s", named);
      char da[192], db[192];
      describe_hdr(h, da, sizeof da);
      describe_hdr(mine, db, sizeof db);
      char msg[600];
      if (h->seq != mine->seq)
        snprintf(msg, sizeof msg, "collective mismatch: rank %d is at collective #%u (%s), rank %d at #%u (%s)", p,
                 h->seq, da, r, mine->seq, db);
      else if (counts_differ)
        snprintf(msg, sizeof msg,
                 "collective mismatch at #%u: ranks %d and %d passed different per-rank "
                 "counts to %s (rank %d says rank %d has %llu elements; rank %d has %llu)",
                 mine->seq, p, r, tp_coll_name((tp_coll_kind_t)h->kind), r, p, (unsigned long long)a->counts[p], p,
                 (unsigned long long)h->count);
      else
        snprintf(msg, sizeof msg, "collective mismatch at #%u: rank %d called %s, rank %d %s", mine->seq, p, da, r, db);
      char sp[TP_COMM_SITE_MAX];
      memcpy(sp, h->site, sizeof sp); /* a peer's slot: copied, then terminated */
      sp[sizeof sp - 1] = '\0';
      return tp_set_error(TP_ERR_MISMATCH, "%s (rank %d at %s, rank %d at %s)", msg, p, sp, r, mine->site);
    }
  }
  return TP_SUCCESS;
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
    if ((recv_side ? h->recv_region : h->send_region) != reg || (recv_side ? h->recv_off : h->send_off) != o) return 0;
  }
  *m = tp_shm_region_by_id(c, reg);
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

static void stage_parts(shm_ctx *c, unsigned b, const char *send, size_t off, size_t m, size_t es, int nt) {
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
  int64_t sreg = tp_shm_find_region(c, send, nbytes, &soff);
  int64_t rreg = writes_out && !is_reduce ? tp_shm_find_region(c, recv, nbytes, &roff) : -1;
  tp_shm_post_hdr(c, a, 0, 0, sreg, soff, rreg, roff);

  if (nbytes <= c->small_bytes) {
    unsigned b = c->round++;
    if (nbytes) memcpy(stage_buf(c, r, b), send, nbytes);
    TP_CHECK(shm_sync_all(c, what));
    TP_CHECK(tp_shm_check_hdrs(c, a));
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
  TP_CHECK(shm_sync_all(c, what));
  TP_CHECK(tp_shm_check_hdrs(c, a));
  shm_mem *sm = NULL, *rm = NULL;
  int src_direct = all_registered(c, 0, &sm, &soff);
  int dst_direct = !is_reduce && all_registered(c, 1, &rm, &roff);
  if (src_direct || dst_direct) c->comm->stats.zero_copy++;
  if (cma && !(src_direct && dst_direct)) {
    /* Single copy: reduce my part pulling the peers' inputs, then pull their parts. */
    size_t lo = part_lo(cnt, n, r, es), hi = part_lo(cnt, n, r + 1, es);
    TP_CHECK(cma_reduce_range(c, send, 1, lo, hi - lo, recv + lo * es, a->dtype, a->op, lo));
    TP_CHECK(shm_sync_all(c, what));
    for (int i = 1; i < n; i++) {
      int p = (r + i) % n;
      size_t plo = part_lo(cnt, n, p, es), phi = part_lo(cnt, n, p + 1, es);
      TP_CHECK(tp_shm_cma_read(c, p, recv + plo * es, peer_hdr(c, p)->recv_addr + plo * es, (phi - plo) * es));
    }
    return shm_sync_all(c, what); /* peers may not touch their output before we have read it */
  }
  if (src_direct && dst_direct) chunk = cnt;
  if (!src_direct && (cma || any_send_registered(c))) {
    /* Mixed: some ranks skipped staging, expecting the in-place path. */
    if (!prestaged) stage_parts(c, b, send, 0, cnt < chunk ? cnt : chunk, es, nt);
    TP_CHECK(shm_sync_all(c, what));
  }
  for (size_t off = 0; off < cnt; off += chunk) {
    size_t m = cnt - off < chunk ? cnt - off : chunk;
    if (off > 0) {
      b = c->round++;
      if (!src_direct) {
        stage_parts(c, b, send, off, m, es, nt);
        TP_CHECK(shm_sync_all(c, what));
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
      tp_reduce_n(recv + (off + mylo) * es, is_reduce ? NULL : stage_buf(c, r, b) + mylo * es, srcs, n, mine, a->dtype,
                  a->op);
    } else {
      tp_reduce_n(stage_buf(c, r, b) + mylo * es, NULL, srcs, n, mine, a->dtype, a->op);
    }
    TP_CHECK(shm_sync_all(c, what));
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
  int64_t sreg = tp_shm_find_region(c, send, mybytes, &soff);
  tp_shm_post_hdr(c, a, 0, 0, sreg, soff, -1, 0);
  size_t chunk = c->stage_bytes / es;
  int nt = cmax * es * (size_t)n >= c->nt_bytes;
  unsigned b = c->round++;
  int cma = c->use_cma && displ[n] * es >= c->cma_bytes[TP_COLL_ALL_GATHER];
  int prestaged = sreg < 0 && !cma;
  if (prestaged) tp_copy(stage_buf(c, r, b), send, (counts[r] < chunk ? counts[r] : chunk) * es, nt);
  char *own = recv + displ[r] * es;
  if (own != send && mybytes) memmove(own, send, mybytes);
  TP_CHECK(shm_sync_all(c, what));
  TP_CHECK(tp_shm_check_hdrs(c, a));
  /* Registered source: the same region on every rank (offsets may differ). */
  const coll_hdr_t *h0 = &c->slots[0].hdr[c->seq & 1];
  shm_mem *sm = h0->send_region >= 0 ? tp_shm_region_by_id(c, h0->send_region) : NULL;
  for (int p = 1; p < n && sm; p++)
    if (c->slots[p].hdr[c->seq & 1].send_region != h0->send_region) sm = NULL;
  if (sm) {
    c->comm->stats.zero_copy++;
    for (int i = 1; i < n; i++) {
      int p = (r + i) % n;
      memcpy(recv + displ[p] * es, peer_ptr(sm, p, c->slots[p].hdr[c->seq & 1].send_off), counts[p] * es);
    }
    return shm_sync_all(c, what); /* peers may not touch their inputs before we are done */
  }
  if (cma) {
    for (int i = 1; i < n; i++) {
      int p = (r + i) % n;
      TP_CHECK(tp_shm_cma_read(c, p, recv + displ[p] * es, peer_hdr(c, p)->send_addr, counts[p] * es));
    }
    return shm_sync_all(c, what);
  }
  if (any_send_registered(c)) {
    if (!prestaged) tp_copy(stage_buf(c, r, b), send, (counts[r] < chunk ? counts[r] : chunk) * es, nt);
    TP_CHECK(shm_sync_all(c, what));
  }
  for (size_t off = 0; off < cmax || off == 0; off += chunk) {
    if (off > 0) {
      b = c->round++;
      if (off < counts[r]) {
        size_t m = counts[r] - off < chunk ? counts[r] - off : chunk;
        tp_copy(stage_buf(c, r, b), send + off * es, m * es, nt);
      }
      TP_CHECK(shm_sync_all(c, what));
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

static void stage_rs(shm_ctx *c, unsigned b, const char *send, const size_t *counts, const size_t *displ, size_t off,
                     size_t cp, size_t es, int nt) {
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
  int64_t sreg = tp_shm_find_region(c, send, a->total * es, &soff);
  tp_shm_post_hdr(c, a, 0, 0, sreg, soff, -1, 0);
  size_t cp = c->stage_bytes / ((size_t)n * es); /* elements per destination per round */
  cp = cp / (CL / es) * (CL / es);
  if (cp == 0) cp = 1;
  int nt = a->total * es >= c->nt_bytes;
  unsigned b = c->round++;
  int cma = c->use_cma && a->total * es >= c->cma_bytes[TP_COLL_REDUCE_SCATTER];
  int prestaged = sreg < 0 && !cma;
  if (prestaged) stage_rs(c, b, send, counts, displ, 0, cp, es, nt);
  TP_CHECK(shm_sync_all(c, what));
  TP_CHECK(tp_shm_check_hdrs(c, a));
  shm_mem *sm = NULL;
  if (all_registered(c, 0, &sm, &soff)) {
    c->comm->stats.zero_copy++;
    for (int p = 0; p < n; p++) srcs[p] = peer_ptr(sm, p, soff) + displ[r] * es;
    tp_reduce_n(recv, NULL, srcs, n, counts[r], a->dtype, a->op);
    return shm_sync_all(c, what);
  }
  if (cma) {
    TP_CHECK(cma_reduce_range(c, send, 1, displ[r], counts[r], recv, a->dtype, a->op, displ[r]));
    return shm_sync_all(c, what);
  }
  if (any_send_registered(c)) {
    if (!prestaged) stage_rs(c, b, send, counts, displ, 0, cp, es, nt);
    TP_CHECK(shm_sync_all(c, what));
  }
  for (size_t off = 0; off < cmax; off += cp) {
    if (off > 0) {
      b = c->round++;
      stage_rs(c, b, send, counts, displ, off, cp, es, nt);
      TP_CHECK(shm_sync_all(c, what));
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
  int64_t sreg = r == root ? tp_shm_find_region(c, send, nbytes, &soff) : -1;
  int64_t rreg = tp_shm_find_region(c, recv, nbytes, &roff);
  tp_shm_post_hdr(c, a, 0, 0, sreg, soff, rreg, roff);
  size_t chunk = c->stage_bytes / es;
  int nt = nbytes >= c->nt_bytes;
  unsigned b = c->round++;
  int cma = c->use_cma && nbytes >= c->cma_bytes[TP_COLL_BROADCAST];
  if (r == root) {
    if (sreg < 0 && !cma) tp_copy(stage_buf(c, root, b), send, (cnt < chunk ? cnt : chunk) * es, nt);
    if (recv != send && nbytes) memmove(recv, send, nbytes);
  }
  TP_CHECK(shm_sync_all(c, what));
  TP_CHECK(tp_shm_check_hdrs(c, a));
  const coll_hdr_t *rh = &c->slots[root].hdr[c->seq & 1];
  /* In place from the root's registered array only if every rank's output lies in the
   * same allocation: that proves every rank still holds it (a rank may have released
   * its handle, and must then take the same path as the others). */
  shm_mem *sm = NULL;
  if (rh->send_region >= 0) {
    int all = 1;
    for (int p = 0; p < c->comm->size; p++) all &= peer_hdr(c, p)->recv_region == rh->send_region;
    if (all) sm = tp_shm_region_by_id(c, rh->send_region);
  }
  if (sm) {
    c->comm->stats.zero_copy++;
    if (r != root && nbytes) memcpy(recv, peer_ptr(sm, root, rh->send_off), nbytes);
    return shm_sync_all(c, what);
  }
  if (cma) {
    if (r != root) TP_CHECK(tp_shm_cma_read(c, root, recv, rh->send_addr, nbytes));
    return shm_sync_all(c, what);
  }
  if (rh->send_region >= 0) {
    /* The root skipped staging expecting the in-place path, which not every rank can take. */
    if (r == root) tp_copy(stage_buf(c, root, b), send, (cnt < chunk ? cnt : chunk) * es, nt);
    TP_CHECK(shm_sync_all(c, what));
  }
  for (size_t off = 0; off < cnt; off += chunk) {
    size_t m = cnt - off < chunk ? cnt - off : chunk;
    if (off > 0) {
      b = c->round++;
      if (r == root) tp_copy(stage_buf(c, root, b), send + off * es, m * es, nt);
      TP_CHECK(shm_sync_all(c, what));
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

tp_status_t tp_shm_collective(struct tp_comm *comm, const tp_coll_args_t *a) {
  shm_ctx *c = comm->impl;
  RETURN_IF_ABORTED(c);
  const char *what = NULL; /* formatted only if an error needs it */
  c->seq++;
  if (comm->size == 1) return solo_collective(a);
  c->cur_kind = a->kind;
  c->cur_seq = c->seq;
  shm_set_activity(c, a->kind, c->seq, -1);
  tp_status_t st;
  switch (a->kind) {
    case TP_COLL_ALL_REDUCE:
    case TP_COLL_REDUCE: st = all_reduce_like(c, a, what); break;
    case TP_COLL_ALL_GATHER: st = all_gather(c, a, what); break;
    case TP_COLL_REDUCE_SCATTER: st = reduce_scatter(c, a, what); break;
    case TP_COLL_BROADCAST: st = broadcast(c, a, what); break;
    case TP_COLL_ALL_TO_ALL: st = tp_shm_all_to_all(c, a, what); break;
    case TP_COLL_BARRIER:
      tp_shm_post_hdr(c, a, 0, 0, -1, 0, -1, 0);
      st = shm_sync_all(c, what);
      if (st == TP_SUCCESS) st = tp_shm_check_hdrs(c, a);
      break;
    default: st = tp_set_error(TP_ERR_INTERNAL, "shm: unknown collective %d", a->kind);
  }
  atomic_store_explicit(&c->slots[comm->rank].last_start, comm->call_t0, memory_order_relaxed);
  atomic_store(&c->slots[comm->rank].last_seq, c->seq);
  shm_set_activity(c, TP_COLL_NONE, c->seq, -1);
  if (st != TP_SUCCESS) {
    /* Make sure no peer waits on us for the rest of a collective it thinks matched. */
    char msg[768];
    snprintf(msg, sizeof msg, "rank %d failed: %s", comm->rank, tp_last_error());
    tp_shm_publish_abort_status(c, comm->rank, msg, st);
  }
  return st;
}
