/*
 * shm backend: all_to_all with uneven counts (MPI_Alltoallv with prefix-sum
 * displacements).  Per round each rank stages, in its own staging buffer, a piece
 * of its block for every peer (slot p: up to `cp` elements for rank p), syncs,
 * and copies out of every peer's buffer the piece that peer staged for it: the
 * round structure of reduce_scatter, so a buffer is written again only two
 * rounds later, after a sync that proves every peer has read it.  The block a
 * rank sends itself is a local copy.
 *
 * Counts.  The first round's staging buffers start with a table (this rank's
 * send counts, then its receive counts, one uint64 per rank).  After the first
 * sync every rank reads every table and checks that send_counts[q] on rank p
 * equals recv_counts[p] on rank q for every pair: all ranks see the same tables,
 * so all of them fail with the same sentence naming the first pair that
 * disagrees, and none waits for data that will not come.  The tables also give
 * every rank the largest block anyone sends, so all run the same rounds.
 *
 * Single copy.  When every rank can read every other with process_vm_readv (CMA), a
 * rank that sends at least cma_bytes[ALL_TO_ALL] in all stages nothing: its peers
 * pull their blocks straight out of its send buffer (at the displacement its table
 * gives), and a last sync keeps its buffer unchanged until they have.  Whether a
 * rank stages is known to all of them from its table, so every rank runs the same
 * rounds whatever mix of ranks stage.
 */
#include <stdio.h>
#include <string.h>

#include "../reduce_impl.h"
#include "shm_impl.h"

/* The bytes of a staging buffer before the data slots: the counts tables. */
static size_t table_bytes(int n) { return ALIGN_UP((size_t)n * 2 * sizeof(uint64_t), CL); }

/* displ[p] = where block p starts (prefix sums); the dispatcher checked the total. */
static void displacements(const size_t *counts, int n, size_t *displ) {
  displ[0] = 0;
  for (int p = 0; p < n; p++) displ[p + 1] = displ[p] + counts[p];
}

/* Rank p sends by CMA (stages nothing): every rank can read every other and p sends enough. */
static int pulled(const shm_ctx *c, uint64_t sent, size_t es) {
  return c->use_cma && sent * es >= c->cma_bytes[TP_COLL_ALL_TO_ALL];
}

/* Every rank's tables of round buffer b agree pairwise.  *gmax: the largest block a rank that
 * stages sends a peer; pull[p]: rank p sends by CMA, then at[p]: where in p's send buffer its
 * block for this rank starts (elements). */
static tp_status_t check_tables(shm_ctx *c, unsigned b, size_t es, size_t *gmax, unsigned char *pull, size_t *at) {
  int n = c->comm->size, r = c->comm->rank;
  uint64_t m = 0;
  for (int p = 0; p < n; p++) {
    const uint64_t *sp = (const uint64_t *)stage_buf(c, p, b);
    uint64_t sent = 0;
    for (int q = 0; q < n; q++) sent += sp[q]; /* <= 2^60 / es: the dispatcher checked p's total */
    pull[p] = (unsigned char)pulled(c, sent, es);
    at[p] = 0;
    for (int q = 0; q < r; q++) at[p] += (size_t)sp[q];
    for (int q = 0; q < n; q++) {
      uint64_t want = ((const uint64_t *)stage_buf(c, q, b))[n + p];
      if (sp[q] != want)
        return tp_set_error(TP_ERR_MISMATCH,
                            "collective mismatch at #%u: all_to_all counts disagree: rank %d sends %llu elements to "
                            "rank %d (send_counts[%d] on rank %d) but rank %d expects %llu from rank %d "
                            "(recv_counts[%d] on rank %d); they must be equal",
                            c->seq, p, (unsigned long long)sp[q], q, q, p, q, (unsigned long long)want, p, p, q);
      if (p != q && !pull[p] && sp[q] > m) m = sp[q];
    }
  }
  *gmax = (size_t)m;
  return TP_SUCCESS;
}

/* Stages elements [off, off + cp) of this rank's block for every peer into round buffer b. */
static void stage(shm_ctx *c, unsigned b, const char *send, const size_t *counts, const size_t *displ, size_t off,
                  size_t cp, size_t es, int nt) {
  int n = c->comm->size, r = c->comm->rank;
  char *st = stage_buf(c, r, b) + table_bytes(n);
  for (int p = 0; p < n; p++) {
    if (p == r || off >= counts[p]) continue;
    size_t m = counts[p] - off < cp ? counts[p] - off : cp;
    tp_copy(st + (size_t)p * cp * es, send + (displ[p] + off) * es, m * es, nt);
  }
}

tp_status_t tp_shm_all_to_all(shm_ctx *c, const tp_coll_args_t *a, const char *what) {
  int n = c->comm->size, r = c->comm->rank;
  size_t es = tp_dtype_size(a->dtype);
  const size_t *sc = a->counts, *rc = a->recv_counts;
  size_t sd[1025], rd[1025];
  displacements(sc, n, sd);
  displacements(rc, n, rd);
  const char *send = (const char *)a->send;
  char *recv = (char *)a->recv;
  unsigned char pull[1024];
  size_t at[1024];
  tp_shm_post_hdr(c, a, 0, 0, -1, 0, -1, 0);
  /* Elements per peer per round: the rest of the buffer after the tables, cache-line multiples
   * when it allows (stage_bytes >= 64 KiB and world <= 1024 leave at least 3 elements). */
  size_t cp = (c->stage_bytes - table_bytes(n)) / ((size_t)n * es);
  if (cp >= CL / es) cp = cp / (CL / es) * (CL / es);
  int nt = (a->count > a->total ? a->count : a->total) * es >= c->nt_bytes;
  unsigned b = c->round++;
  uint64_t *table = (uint64_t *)stage_buf(c, r, b);
  for (int p = 0; p < n; p++) {
    table[p] = sc[p];
    table[n + p] = rc[p];
  }
  int mine_pulled = pulled(c, a->count, es);
  if (!mine_pulled) stage(c, b, send, sc, sd, 0, cp, es, nt);
  if (sc[r]) memcpy(recv + rd[r] * es, send + sd[r] * es, sc[r] * es);
  TP_CHECK(shm_sync_all(c, what));
  TP_CHECK(tp_shm_check_hdrs(c, a));
  size_t gmax = 0;
  TP_CHECK(check_tables(c, b, es, &gmax, pull, at));
  int any_pulled = 0;
  for (int i = 1; i < n; i++) {
    int p = (r + i) % n;
    any_pulled |= pull[p];
    if (pull[p] && rc[p])
      TP_CHECK(tp_shm_cma_read(c, p, recv + rd[p] * es, peer_hdr(c, p)->send_addr + at[p] * es, rc[p] * es));
  }
  any_pulled |= mine_pulled;
  size_t tbl = table_bytes(n);
  for (size_t off = 0; off < gmax; off += cp) {
    if (off > 0) {
      b = c->round++;
      if (!mine_pulled) stage(c, b, send, sc, sd, off, cp, es, nt);
      TP_CHECK(shm_sync_all(c, what));
    }
    for (int i = 1; i < n; i++) {
      int p = (r + i) % n;
      if (pull[p] || off >= rc[p]) continue;
      size_t m = rc[p] - off < cp ? rc[p] - off : cp;
      memcpy(recv + (rd[p] + off) * es, stage_buf(c, p, b) + tbl + (size_t)r * cp * es, m * es);
    }
  }
  /* A rank read by CMA must not change its send buffer before its peers have read it. */
  return any_pulled ? shm_sync_all(c, what) : TP_SUCCESS;
}
